"""The 12 Hz codec encoder: 24 kHz reference audio -> 16-codebook codes, for in-context voice cloning.

It is transformers' Mimi encoder path, which the official speech tokenizer reuses unchanged:
SEANet causal conv encoder (to 25 Hz) -> encoder transformer -> causal stride-2 conv (to 12.5 Hz) ->
split residual vector quantizer (one semantic codebook, then acoustic codebooks on the same input).
The official tokenizer quantizes with all 32 codebooks and keeps the first 16; the residual chain is
sequential, so stopping after 16 gives the same codes.

State-dict keys (parameters and persistent buffers) equal the official `encoder.*` keys with the prefix
stripped; `CodecEncoder.load_state_dict(..., strict=True)` takes the released weights.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from legato.models.qwen3_tts.config import CodecEncoderConfig
from legato.models.qwen3_tts.mimi_layers import CausalStridedConv, EncoderTransformer, SeanetEncoder

# Floor on a codebook entry's usage count before dividing the running sum by it (the Mimi value).
_USAGE_FLOOR = 1e-5


class Codebook(nn.Module):
    """Centroids stored as training-time running statistics: centroid = embed_sum / max(cluster_usage, 1e-5).

    All three tensors are persistent buffers in the checkpoint; `initialized` is a training-only flag that
    encoding never reads (kept so the checkpoint loads strictly).
    """

    def __init__(self, size: int, dim: int) -> None:
        super().__init__()
        self.register_buffer("initialized", torch.ones(1))
        self.register_buffer("cluster_usage", torch.ones(size))
        self.register_buffer("embed_sum", torch.zeros(size, dim))

    def centroids(self) -> torch.Tensor:
        # Recomputed per call (cheap) rather than cached, so loading new weights or moving devices is safe.
        return self.embed_sum / self.cluster_usage.clamp(min=_USAGE_FLOOR)[:, None]


class _CodebookSlot(nn.Module):
    """Holds one codebook at `layers.<i>.codebook`, the checkpoint's nesting."""

    def __init__(self, size: int, dim: int) -> None:
        super().__init__()
        self.codebook = Codebook(size, dim)


class ResidualQuantizer(nn.Module):
    """Projects [B, hidden, T] to the codebook width, then picks codes one codebook at a time on the
    residual left by the previous ones (nearest centroid by euclidean distance)."""

    def __init__(self, cfg: CodecEncoderConfig, num_codebooks: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_CodebookSlot(cfg.codebook_size, cfg.codebook_dim) for _ in range(num_codebooks))
        if cfg.vector_quantization_hidden_dimension != cfg.hidden_size:
            width = cfg.vector_quantization_hidden_dimension
            self.input_proj: nn.Conv1d | None = nn.Conv1d(cfg.hidden_size, width, 1, bias=False)
            # Decoder side only (codes -> latents); never used to encode, kept for strict loading.
            self.output_proj: nn.Conv1d | None = nn.Conv1d(width, cfg.hidden_size, 1, bias=False)
        else:
            self.input_proj = None
            self.output_proj = None

    def encode(self, latents: torch.Tensor, num_codebooks: int) -> torch.Tensor:
        """latents [B, hidden, T] -> codes [B, T, num_codebooks] (int64)."""
        x = latents if self.input_proj is None else self.input_proj(latents)
        batch, dim, frames = x.shape
        residual = x.transpose(1, 2).reshape(batch * frames, dim)
        codes = []
        for slot in self.layers[:num_codebooks]:
            centroids = slot.codebook.centroids()
            # torch.cdist in fp32 over all rows at once, exactly as the reference computes it: its
            # matmul-based distance decides near-ties, so a different formula could flip a code.
            dists = torch.cdist(residual[None].float(), centroids[None].float(), p=2)[0]
            idx = dists.argmin(dim=-1)
            residual = residual - centroids[idx]
            codes.append(idx)
        return torch.stack(codes, dim=-1).view(batch, frames, -1)


class SplitQuantizer(nn.Module):
    """The first `num_semantic_quantizers` codes come from the semantic quantizer, the rest from the
    acoustic one; both start from the same latents (the acoustic chain does not see the semantic residual)."""

    def __init__(self, cfg: CodecEncoderConfig) -> None:
        super().__init__()
        if not 0 < cfg.num_semantic_quantizers < cfg.num_quantizers:
            raise ValueError("encoder_config: need 0 < num_semantic_quantizers < num_quantizers")
        self.num_semantic = cfg.num_semantic_quantizers
        self.semantic_residual_vector_quantizer = ResidualQuantizer(cfg, cfg.num_semantic_quantizers)
        self.acoustic_residual_vector_quantizer = ResidualQuantizer(
            cfg, cfg.num_quantizers - cfg.num_semantic_quantizers
        )

    def encode(self, latents: torch.Tensor, num_codebooks: int) -> torch.Tensor:
        """latents [B, hidden, T] -> codes [B, T, num_codebooks]."""
        semantic = self.semantic_residual_vector_quantizer.encode(latents, min(num_codebooks, self.num_semantic))
        if num_codebooks <= self.num_semantic:
            return semantic
        acoustic = self.acoustic_residual_vector_quantizer.encode(latents, num_codebooks - self.num_semantic)
        return torch.cat([semantic, acoustic], dim=-1)


class CodecEncoder(nn.Module):
    """Mimi encoder of the 12 Hz codec, keeping the first `valid_num_quantizers` codebooks.

    Holds every tensor of the official `encoder.*` state dict; those encoding never reads are the
    quantizers' `output_proj` weights, the codebooks beyond `valid_num_quantizers` (codebooks 16..31 of
    the released model) and the `initialized` flags.
    """

    def __init__(self, cfg: CodecEncoderConfig, valid_num_quantizers: int = 16) -> None:
        super().__init__()
        if cfg.audio_channels != 1:
            raise ValueError(f"encoder_config.audio_channels must be 1 (mono), got {cfg.audio_channels}")
        if not cfg.use_causal_conv:
            raise ValueError("encoder_config.use_causal_conv=False is not supported (the released codec is causal)")
        if cfg.vector_quantization_hidden_dimension != cfg.codebook_dim:
            raise ValueError("encoder_config: vector_quantization_hidden_dimension must equal codebook_dim")
        if not cfg.num_semantic_quantizers <= valid_num_quantizers <= cfg.num_quantizers:
            raise ValueError(
                f"valid_num_quantizers must be in [{cfg.num_semantic_quantizers}, {cfg.num_quantizers}], "
                f"got {valid_num_quantizers}"
            )
        conv_rate = math.ceil(cfg.sampling_rate / math.prod(cfg.upsampling_ratios))
        # Without an explicit `_frame_rate`, Mimi derives it from the conv strides times the stride-2 downsample.
        frame_rate = cfg._frame_rate or cfg.sampling_rate / (2 * math.prod(cfg.upsampling_ratios))
        if frame_rate == conv_rate:
            raise ValueError("encoder_config: _frame_rate equals the conv-stack rate; the codec expects a downsample")
        self.config = cfg
        self.num_codebooks = valid_num_quantizers
        self.encoder = SeanetEncoder(cfg)
        self.encoder_transformer = EncoderTransformer(cfg)
        # Mimi fixes the stride at 2 and sizes the kernel from the rate ratio; it replicates edge values
        # (not zeros) into its padding, unlike every other conv here.
        self.downsample = CausalStridedConv(
            cfg.hidden_size,
            cfg.hidden_size,
            2 * int(conv_rate / frame_rate),
            stride=2,
            bias=False,
            pad_mode="replicate",
        )
        self.quantizer = SplitQuantizer(cfg)
        self.samples_per_frame = math.prod(cfg.upsampling_ratios) * 2

    def latents(self, wav: torch.Tensor) -> torch.Tensor:
        """Pre-quantisation latents: wav [B, N] -> [B, hidden_size, ceil(N / samples_per_frame)]."""
        x = self.encoder(wav[:, None, :])
        x = self.encoder_transformer(x.transpose(1, 2)).transpose(1, 2)
        return self.downsample(x)

    @torch.inference_mode()
    def encode(self, wav_24k: torch.Tensor) -> torch.Tensor:
        """Codes of 24 kHz mono audio.

        wav_24k: float tensor [N] or [B, N] (a batch of equal-length clips, in the module's device/dtype
        after conversion). Returns int64 codes [T, K] or [B, T, K] with T = ceil(N / 1920) and K =
        `valid_num_quantizers`. The last frame covers zero padding when N is not a multiple of 1920, as in
        the official single-clip encode. Each clip should be encoded on its own (or with equal-length
        batch-mates): the official tokenizer's padded batch of unequal clips feeds the padded region
        through the convs, which can change a shorter clip's last frame.
        """
        if not isinstance(wav_24k, torch.Tensor):
            raise ValueError(f"expected a torch.Tensor waveform, got {type(wav_24k).__name__}")
        if wav_24k.dim() not in (1, 2):
            raise ValueError(
                f"expected a waveform of shape [num_samples] or [batch, num_samples], got {tuple(wav_24k.shape)}"
            )
        if not wav_24k.is_floating_point():
            raise ValueError(f"expected a floating-point waveform, got {wav_24k.dtype}")
        if wav_24k.numel() == 0:
            raise ValueError(f"empty waveform of shape {tuple(wav_24k.shape)}")
        single = wav_24k.dim() == 1
        weight = self.downsample.conv.weight
        wav = (wav_24k[None] if single else wav_24k).to(device=weight.device, dtype=weight.dtype)
        codes = self.quantizer.encode(self.latents(wav), self.num_codebooks)
        return codes[0] if single else codes
