"""Speaker encoder (ECAPA-TDNN + log-mel front end): parity with the official qwen_tts classes."""

from __future__ import annotations

import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
for _p in (str(_ROOT), str(_ROOT / "tests")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import copy  # noqa: E402
import math  # noqa: E402

import numpy as np  # noqa: E402
import oracle  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from legato.layers.same_conv import same_conv1d  # noqa: E402
from legato.models.qwen3_tts.config import SpeakerEncoderConfig  # noqa: E402
from legato.models.qwen3_tts.mel import LogMelSpectrogram, MelConfig, slaney_mel_filterbank  # noqa: E402
from legato.models.qwen3_tts.speaker_encoder import SameConv, SpeakerEncoder  # noqa: E402
from legato.models.qwen3_tts.tiny import tiny_config  # noqa: E402

PROMPT_WAV = Path(__file__).parent / "data" / "voice01.wav"  # from shared/data/prompts/en (synthetic voice)
SR = 24000


def _official_modeling():
    oracle.qwen_tts()
    from qwen_tts.core.models import modeling_qwen3_tts

    return modeling_qwen3_tts


def _official_mel(wav: torch.Tensor) -> torch.Tensor:
    """The official features with the arguments `extract_speaker_embedding` passes, [B, 128, T]."""
    return _official_modeling().mel_spectrogram(
        wav, n_fft=1024, num_mels=128, sampling_rate=SR, hop_size=256, win_size=1024, fmin=0, fmax=12000
    )


def _randomise_(module: torch.nn.Module, seed: int) -> None:
    """Replaces every parameter with seeded noise at a scale that keeps activations O(1), so the parity
    checks do not ride on the official initialisation (the ECAPA has no buffers to randomise)."""
    assert not list(module.buffers()), "the ECAPA is expected to hold no BatchNorm statistics"
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            scale = 1.0 / math.sqrt(p[0].numel()) if name.endswith("weight") else 0.2
            p.copy_(noise * scale)


def _real_clip(seconds: float | None = None) -> np.ndarray:
    sf = pytest.importorskip("soundfile")
    wav, sr = sf.read(PROMPT_WAV, dtype="float32")
    assert sr == SR and wav.ndim == 1, "the parity clip must be mono 24 kHz (no resampling in this test)"
    return wav if seconds is None else wav[: int(seconds * SR)]


def _noise(num_samples: int, seed: int) -> np.ndarray:
    gen = torch.Generator().manual_seed(seed)
    return (torch.rand(num_samples, generator=gen) - 0.5).numpy()


@pytest.fixture(scope="module")
def tiny_pair():
    """(official full model, ours) sharing one randomised tiny speaker-encoder state."""
    torch.manual_seed(0)
    official = oracle.official_model(tiny_config("base").to_dict())
    _randomise_(official.speaker_encoder, seed=1)
    ours = SpeakerEncoder(tiny_config("base").speaker_encoder_config).eval()
    ours.load_state_dict(official.speaker_encoder.state_dict(), strict=True)
    return official, ours


@pytest.mark.parametrize(
    "sr, n_fft, n_mels, fmin, fmax",
    [(24000, 1024, 128, 0, 12000), (16000, 512, 80, 55.0, 7600.0)],
)
def test_filterbank_matches_librosa(sr, n_fft, n_mels, fmin, fmax):
    librosa = pytest.importorskip("librosa")
    want = librosa.filters.mel(sr=sr, n_fft=n_fft, n_mels=n_mels, fmin=fmin, fmax=fmax)
    got = slaney_mel_filterbank(sr, n_fft, n_mels, fmin, fmax)
    assert got.dtype == np.float32 and got.shape == want.shape == (n_mels, n_fft // 2 + 1)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    assert (got > 0).any(axis=1).all(), "every mel band must cover at least one FFT bin"


def test_state_dict_keys_match_official(tiny_pair):
    official, ours = tiny_pair
    want = {k: tuple(v.shape) for k, v in official.speaker_encoder.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in ours.state_dict().items()}
    assert got == want
    assert not list(ours.buffers())


@pytest.mark.parametrize("source", ["real", "noise_short", "noise_odd"])
def test_log_mel_matches_official(source):
    wav = {
        "real": lambda: _real_clip(),
        "noise_short": lambda: _noise(1280, seed=2),
        "noise_odd": lambda: _noise(SR + 123, seed=3),
    }[source]()
    wav = torch.from_numpy(wav).unsqueeze(0)
    want = _official_mel(wav)
    got = LogMelSpectrogram(MelConfig())(wav)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert got.shape[2] == MelConfig().num_frames(wav.shape[1])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("kernel,dilation,length", [(5, 1, 40), (3, 2, 41), (3, 4, 30), (1, 1, 17), (2, 1, 10),
                                                    (4, 3, 20)])
def test_same_conv_as_one_gemm_equals_conv1d(kernel, dilation, length):
    """The GEMM form (CUDA's path: no cuDNN plan per clip length) computes the reflect-"same" Conv1d."""
    conv = torch.nn.Conv1d(6, 5, kernel, dilation=dilation, padding="same", padding_mode="reflect").double()
    x = torch.randn(2, 6, length, dtype=torch.float64, generator=torch.Generator().manual_seed(length))
    torch.testing.assert_close(same_conv1d(x, conv.weight, conv.bias, dilation), conv(x), rtol=0, atol=1e-12)


def test_the_encoder_through_gemm_convs_gives_the_conv1d_embedding(tiny_pair):
    """Every SameConv as a GEMM against Conv1d, also after new weights are loaded (the stacked weights it keeps
    are made again)."""
    ours = copy.deepcopy(tiny_pair[1])  # its weights are changed below
    convs = [m for m in ours.modules() if isinstance(m, SameConv)]
    assert len(convs) >= 5 and all(m.gemm is None for m in convs)  # the default: GEMMs on CUDA, Conv1d here
    wav = torch.from_numpy(_noise(SR + 123, seed=7))
    for reload in (False, True):
        if reload:
            state = {k: v + 0.01 * torch.randn_like(v) for k, v in ours.state_dict().items()}
            ours.load_state_dict(state)
        want = ours.embed(wav)
        try:
            for m in convs:
                m.gemm = True
            got = ours.embed(wav)
        finally:
            for m in convs:
                m.gemm = None
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert torch.equal(ours.embed(wav), want), "the default on a CPU input is Conv1d, the official op"


@pytest.mark.parametrize("source", ["real", "noise_min", "noise_5000", "noise_1s_odd"])
def test_embedding_matches_official_tiny(tiny_pair, source):
    official, ours = tiny_pair
    wav = {
        "real": lambda: _real_clip(),
        "noise_min": lambda: _noise(ours.min_samples, seed=4),
        "noise_5000": lambda: _noise(5000, seed=5),
        "noise_1s_odd": lambda: _noise(SR + 123, seed=6),
    }[source]()
    with torch.no_grad():
        want = official.extract_speaker_embedding(wav, SR)
    got = ours.embed(torch.from_numpy(wav))
    assert got.shape == (1, 64) and want.shape == (64,)
    assert want.abs().max() > 1e-2, "degenerate embedding: the comparison would prove little"
    torch.testing.assert_close(got[0], want, rtol=0, atol=1e-4)


def test_embedding_matches_official_full_config():
    """The released shape (enc_dim 1024, channels 512x4 + 1536), on 2 s of real speech."""
    modeling = _official_modeling()
    torch.manual_seed(0)
    official = modeling.Qwen3TTSSpeakerEncoder(modeling.Qwen3TTSSpeakerEncoderConfig(enc_dim=1024)).eval()
    _randomise_(official, seed=7)
    ours = SpeakerEncoder(SpeakerEncoderConfig()).eval()
    ours.load_state_dict(official.state_dict(), strict=True)
    wav = torch.from_numpy(_real_clip(seconds=2.0))
    with torch.no_grad():
        want = official(_official_mel(wav.unsqueeze(0)).transpose(1, 2))
    got = ours.embed(wav)
    assert got.shape == want.shape == (1, 1024)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


def test_batch_equals_one_by_one(tiny_pair):
    _, ours = tiny_pair
    clips = torch.stack([torch.from_numpy(_noise(4000, seed=s)) for s in (8, 9, 10)])
    batched = ours.embed(clips)
    singles = torch.cat([ours.embed(c) for c in clips])
    assert batched.shape == (3, 64)
    torch.testing.assert_close(batched, singles, rtol=0, atol=1e-5)


def test_min_samples_is_the_real_limit(tiny_pair):
    """Our declared minimum (5 mel frames = 1280 samples for the released kernels) is exactly where the
    official model stops working: one sample less and its reflect padding fails."""
    official, ours = tiny_pair
    assert ours.min_samples == 1280
    ours.embed(torch.zeros(ours.min_samples))
    with pytest.raises(RuntimeError):
        official.extract_speaker_embedding(np.zeros(ours.min_samples - 1, dtype=np.float32), SR)
    with pytest.raises(ValueError, match="too short"):
        ours.embed(torch.zeros(ours.min_samples - 1))


@pytest.mark.parametrize(
    "wav, message",
    [
        (torch.zeros(()), "shape"),
        (torch.zeros(1, 2, 4000), "shape"),
        (torch.zeros(4000, dtype=torch.int16), "floating"),
        (torch.zeros(2, 100), "too short"),
    ],
)
def test_rejects_bad_input(tiny_pair, wav, message):
    _, ours = tiny_pair
    with pytest.raises(ValueError, match=message):
        ours.embed(wav)


def test_bf16_model_keeps_fp32_front_end(tiny_pair):
    _, ours = tiny_pair
    wav = torch.from_numpy(_noise(6000, seed=11))
    want = ours.embed(wav)
    half = SpeakerEncoder(ours.config).eval()
    half.load_state_dict(ours.state_dict(), strict=True)
    half.to(torch.bfloat16)
    got = half.embed(wav)
    assert got.dtype == torch.bfloat16
    assert half.mel._constants(torch.device("cpu"))[0].dtype == torch.float32
    torch.testing.assert_close(got.float(), want, rtol=0.05, atol=0.05 * want.abs().max().item())
