"""Log-mel front end of the speaker encoder.

The released speaker encoder was trained on HiFi-GAN-style log-mel features of 24 kHz audio: a librosa
"slaney" mel filterbank over a Hann-windowed magnitude STFT whose frames are aligned by reflect padding
instead of `center=True`. The filterbank is computed here (librosa is a test-only dependency) and checked
against `librosa.filters.mel` in the tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

# Slaney's auditory-toolbox mel scale: linear up to 1 kHz (66.67 Hz per mel), logarithmic above it with
# 27 mels per factor 6.4 in frequency.
_HZ_PER_MEL = 200.0 / 3.0
_BREAK_HZ = 1000.0
_BREAK_MEL = _BREAK_HZ / _HZ_PER_MEL
_LOG_STEP = np.log(6.4) / 27.0

# Added under the square root of |X|^2 and the floor before the log, as in the training features.
_POWER_EPS = 1e-9
_LOG_FLOOR = 1e-5


def hz_to_mel(hz: np.ndarray) -> np.ndarray:
    """Slaney mel scale (not HTK)."""
    hz = np.asarray(hz, dtype=np.float64)
    linear = hz / _HZ_PER_MEL
    log = _BREAK_MEL + np.log(np.maximum(hz, _BREAK_HZ) / _BREAK_HZ) / _LOG_STEP
    return np.where(hz >= _BREAK_HZ, log, linear)


def mel_to_hz(mel: np.ndarray) -> np.ndarray:
    """Inverse of `hz_to_mel`."""
    mel = np.asarray(mel, dtype=np.float64)
    linear = mel * _HZ_PER_MEL
    log = _BREAK_HZ * np.exp(_LOG_STEP * (np.maximum(mel, _BREAK_MEL) - _BREAK_MEL))
    return np.where(mel >= _BREAK_MEL, log, linear)


def slaney_mel_filterbank(sample_rate: int, n_fft: int, n_mels: int, fmin: float, fmax: float) -> np.ndarray:
    """Triangular mel filters with slaney area normalisation, float32 [n_mels, n_fft // 2 + 1].

    Equal to `librosa.filters.mel(sr=sample_rate, n_fft=n_fft, n_mels=n_mels, fmin=fmin, fmax=fmax)`
    (norm="slaney", htk=False) up to float32 rounding.
    """
    bin_hz = np.fft.rfftfreq(n_fft, d=1.0 / sample_rate)
    # n_mels + 2 edges: filter i rises from edge i to its peak at edge i+1 and falls to zero at edge i+2.
    edges_hz = mel_to_hz(np.linspace(hz_to_mel(fmin), hz_to_mel(fmax), n_mels + 2))
    left, centre, right = edges_hz[:-2, None], edges_hz[1:-1, None], edges_hz[2:, None]
    rising = (bin_hz[None, :] - left) / (centre - left)
    falling = (right - bin_hz[None, :]) / (right - centre)
    triangles = np.maximum(0.0, np.minimum(rising, falling))
    # Scale each filter to unit area in Hz so wide high-frequency bands do not dominate. Rounding the
    # triangles to float32 first reproduces librosa's float32 intermediate, making the result bit-exact
    # with the filterbank the model was trained with.
    area_norm = 2.0 / (right - left)
    return (triangles.astype(np.float32) * area_norm).astype(np.float32)


@dataclass(slots=True)
class MelConfig:
    """STFT / mel settings of the speaker-encoder features (fixed in the released model)."""

    sample_rate: int = 24000
    n_fft: int = 1024
    hop_length: int = 256
    win_length: int = 1024
    n_mels: int = 128
    fmin: float = 0.0
    fmax: float = 12000.0

    def __post_init__(self) -> None:
        if self.win_length > self.n_fft:
            raise ValueError(f"win_length {self.win_length} exceeds n_fft {self.n_fft}")
        if not 0 <= self.fmin < self.fmax <= self.sample_rate / 2:
            raise ValueError(f"need 0 <= fmin < fmax <= sample_rate / 2, got fmin={self.fmin} fmax={self.fmax}")

    @property
    def edge_pad(self) -> int:
        """Reflect padding on each side, so frame t is centred near sample t * hop + hop / 2."""
        return (self.n_fft - self.hop_length) // 2

    def num_frames(self, num_samples: int) -> int:
        return (num_samples + 2 * self.edge_pad - self.n_fft) // self.hop_length + 1

    def min_samples_for(self, num_frames: int) -> int:
        """Fewest input samples that give at least `num_frames` frames (reflect padding also needs
        more samples than it pads)."""
        need = (num_frames - 1) * self.hop_length + self.n_fft - 2 * self.edge_pad
        return max(need, self.edge_pad + 1)


class LogMelSpectrogram(nn.Module):
    """Waveforms [B, num_samples] -> natural-log mel magnitudes [B, n_mels, num_frames], always in fp32.

    Holds no parameters or buffers: the filterbank and window are kept outside the state dict (the
    checkpoint has none) and outside `Module.to(dtype)`, so casting the model to bf16 never rounds them;
    per-device copies are cached on first use.
    """

    def __init__(self, config: MelConfig) -> None:
        super().__init__()
        self.config = config
        basis = slaney_mel_filterbank(config.sample_rate, config.n_fft, config.n_mels, config.fmin, config.fmax)
        self._basis_cpu = torch.from_numpy(basis)
        self._window_cpu = torch.hann_window(config.win_length, dtype=torch.float32)
        self._per_device: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def _constants(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self._per_device:
            self._per_device[device] = (self._basis_cpu.to(device), self._window_cpu.to(device))
        return self._per_device[device]

    def forward(self, wav: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        basis, window = self._constants(wav.device)
        wav = wav.float()
        padded = F.pad(wav.unsqueeze(1), (cfg.edge_pad, cfg.edge_pad), mode="reflect").squeeze(1)
        spec = torch.stft(
            padded,
            cfg.n_fft,
            hop_length=cfg.hop_length,
            win_length=cfg.win_length,
            window=window,
            center=False,
            normalized=False,
            onesided=True,
            return_complex=True,
        )
        magnitude = torch.sqrt(spec.real.square() + spec.imag.square() + _POWER_EPS)
        return torch.log(torch.clamp(torch.matmul(basis, magnitude), min=_LOG_FLOOR))
