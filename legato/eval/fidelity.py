"""How far a waveform is from a reference waveform of the same codes: the measures of the codec's fidelity
report (docs/benchmarks.md) and of the tests that hold a reduced-precision path to its threshold."""

from __future__ import annotations

import numpy as np
import torch

from legato.models.qwen3_tts.mel import slaney_mel_filterbank

SNR_THRESHOLD_DB = 35.0  # the bf16 codec's floor against fp32 (pega-omni's streamed bf16 codec reads 36.6 dB)


def snr_db(ref: torch.Tensor, x: torch.Tensor) -> float:
    """10 log10(|ref|² / |ref - x|²) over all samples (inf when equal)."""
    ref, x = ref.double().flatten(), x.double().flatten()
    noise = (ref - x).pow(2).sum().item()
    return float("inf") if noise == 0 else 10.0 * np.log10(ref.pow(2).sum().item() / noise)


def peak_error(ref: torch.Tensor, x: torch.Tensor) -> float:
    return (ref.double() - x.double()).abs().max().item()


def log_mel_distance(ref: torch.Tensor, x: torch.Tensor, sample_rate: int = 24000) -> float:
    """Mean absolute difference of the 80-band log-mel spectrograms (natural log, floor 1e-5) of two
    waveforms [..., T] (1024-point FFT, hop 256)."""
    bank = torch.from_numpy(slaney_mel_filterbank(sample_rate, 1024, 80, 0.0, sample_rate / 2)).double()

    def logmel(w: torch.Tensor) -> torch.Tensor:
        w = w.double().cpu().reshape(-1, w.shape[-1])
        spec = torch.stft(w, 1024, 256, window=torch.hann_window(1024, dtype=torch.float64), return_complex=True)
        return torch.log((bank @ spec.abs()).clamp(min=1e-5))

    return (logmel(ref) - logmel(x)).abs().mean().item()


def compare(ref: torch.Tensor, x: torch.Tensor) -> dict[str, float]:
    return {"snr_db": snr_db(ref, x), "log_mel_l1": log_mel_distance(ref, x), "peak_error": peak_error(ref, x)}
