"""Codec decoder of the Qwen3-TTS 12 Hz speech tokenizer: 16 codebooks per frame -> 1920 samples at 24 kHz.

Codes [B, T, 16] (every public method takes frames in this layout, the talker's) -> RVQ dequantise
(codebook 0 and codebooks 1..15 as two groups, summed) -> causal conv -> sliding-window transformer -> 2
upsampling stages (transposed conv + ConvNeXt) -> SnakeBeta vocoder (4 upsampling blocks) -> clamp to [-1, 1].

The state_dict keys are the official `decoder.*` keys of `Qwen3TTSTokenizerV2Model` with the `decoder.`
prefix removed, so a model that holds this module as `decoder` loads the released checkpoint strictly.
The same layer modules serve the whole-utterance `forward` and the stateful `stream_step`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .codec_modules import CausalConv1d, SnakeBeta, StreamingLayer, UpsampleStage, VocoderBlock
from .codec_streaming import CodecStreamState, StreamContext
from .codec_transformer import CodecTransformer
from .config import CodecDecoderConfig


class _Codebook(nn.Module):
    """Codebook kept as running sums: entry = embedding_sum / max(cluster_usage, 1e-5)."""

    def __init__(self, size: int, dim: int) -> None:
        super().__init__()
        self.cluster_usage = nn.Parameter(torch.ones(size))
        self.embedding_sum = nn.Parameter(torch.zeros(size, dim))

    def lookup(self, codes: torch.Tensor) -> torch.Tensor:
        # Dividing the looked-up rows equals looking up the divided table, at B*T rows instead of 2048.
        usage = F.embedding(codes, self.cluster_usage[:, None]).clamp(min=1e-5)
        return F.embedding(codes, self.embedding_sum) / usage


class _CodebookSlot(nn.Module):
    def __init__(self, size: int, dim: int) -> None:
        super().__init__()
        self._codebook = _Codebook(size, dim)


class _CodebookList(nn.Module):
    def __init__(self, count: int, size: int, dim: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_CodebookSlot(size, dim) for _ in range(count))


class CodebookGroup(nn.Module):
    """Residual codebooks whose entries are summed, then projected dim -> out_dim by a 1x1 conv."""

    def __init__(self, count: int, size: int, dim: int, out_dim: int) -> None:
        super().__init__()
        # The encoder-side projection: unused when decoding, present so the checkpoint loads strictly.
        self.input_proj = nn.Conv1d(out_dim, dim, 1, bias=False)
        self.output_proj = nn.Conv1d(dim, out_dim, 1, bias=False)
        self.vq = _CodebookList(count, size, dim)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [B, count, T] -> [B, out_dim, T]."""
        total = self.vq.layers[0]._codebook.lookup(codes[:, 0])
        for j in range(1, codes.shape[1]):
            total = total + self.vq.layers[j]._codebook.lookup(codes[:, j])
        return self.output_proj(total.transpose(1, 2))


class SplitDequantizer(nn.Module):
    def __init__(self, cfg: CodecDecoderConfig) -> None:
        super().__init__()
        dim = cfg.codebook_dim // 2
        first = cfg.num_semantic_quantizers
        if not 0 < first < cfg.num_quantizers:
            raise ValueError("codec decoder: need 0 < num_semantic_quantizers < num_quantizers")
        self.first = first
        self.rvq_first = CodebookGroup(first, cfg.codebook_size, dim, cfg.codebook_dim)
        self.rvq_rest = CodebookGroup(cfg.num_quantizers - first, cfg.codebook_size, dim, cfg.codebook_dim)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        return self.rvq_first(codes[:, : self.first]) + self.rvq_rest(codes[:, self.first :])


class CodecDecoder(nn.Module):
    """Codes -> waveform. `forward` decodes whole utterances; `stream_step` decodes the next chunk of
    each request given its `CodecStreamState`, and the chunks' outputs concatenate to exactly the
    whole-utterance waveform (the chunking is the caller's: first chunk of 1 frame, then 4, then 25 ...).
    """

    def __init__(self, cfg: CodecDecoderConfig) -> None:
        super().__init__()
        self.config = cfg
        self.num_quantizers = cfg.num_quantizers
        self.samples_per_frame = cfg.samples_per_frame
        self.quantizer = SplitDequantizer(cfg)
        self.pre_conv = CausalConv1d(cfg.codebook_dim, cfg.latent_dim, 3)
        self.pre_transformer = CodecTransformer(cfg)
        self.upsample = nn.ModuleList(UpsampleStage(cfg.latent_dim, f) for f in cfg.upsampling_ratios)
        dims = [cfg.decoder_dim // 2**i for i in range(len(cfg.upsample_rates) + 1)]
        self.decoder = nn.ModuleList(
            [CausalConv1d(cfg.latent_dim, dims[0], 7)]
            + [VocoderBlock(dims[i], dims[i + 1], r) for i, r in enumerate(cfg.upsample_rates)]
            + [SnakeBeta(dims[-1]), CausalConv1d(dims[-1], 1, 7)]
        )
        self._buffer_shapes: dict[str, tuple[int, ...]] = {}
        for name, module in self.named_modules():
            if isinstance(module, StreamingLayer):
                module.state_key = name
                for suffix, shape in module.stream_buffers().items():
                    self._buffer_shapes[f"{name}.{suffix}"] = shape

    def _run(self, codes: torch.Tensor, stream: StreamContext | None) -> torch.Tensor:
        if codes.ndim != 3 or codes.shape[2] != self.num_quantizers:
            raise ValueError(f"codes must be [B, T, {self.num_quantizers}], got {tuple(codes.shape)}")
        h = self.pre_conv(self.quantizer(codes.transpose(1, 2)), stream)
        h = self.pre_transformer(h.transpose(1, 2), stream).transpose(1, 2)
        for stage in self.upsample:
            h = stage(h, stream)
        for layer in self.decoder:
            h = layer(h, stream)
        return h.clamp(-1.0, 1.0)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [B, T, num_quantizers] (int64, each in [0, codebook_size)) -> wav [B, 1, T * samples_per_frame].

        One window over the whole sequence, i.e. the reference decoder's `forward` (not its 300-frame
        chunking; see `decode`).
        """
        return self._run(codes, None)

    @torch.no_grad()
    def decode(self, codes: torch.Tensor, chunk_size: int = 300, left_context: int = 25) -> list[torch.Tensor]:
        """codes [B, T, num_quantizers], right-padded with -1 -> one waveform [n_i * samples_per_frame] each.

        Follows the reference tokenizer's `decode`: a request's length is its count of frames whose
        codebook-0 code is > -1, codes are clamped to >= 0, and sequences longer than `chunk_size`
        frames are decoded in windows of `chunk_size` frames, each preceded by `left_context` frames
        whose output is dropped (so beyond `chunk_size` frames this is not the whole-utterance forward).
        """
        lengths = (codes[..., 0] > -1).sum(1) * self.samples_per_frame
        codes = codes.clamp(min=0)
        total = codes.shape[1]
        pieces = []
        start = 0
        while start < total:
            end = min(start + chunk_size, total)
            context = min(left_context, start)
            wav = self(codes[:, start - context : end])
            pieces.append(wav[..., context * self.samples_per_frame :])
            start = end
        wav = torch.cat(pieces, dim=-1)[:, 0]
        return [w[:n] for w, n in zip(wav, lengths.tolist(), strict=True)]

    def new_stream_state(
        self, batch_size: int = 1, device: torch.device | None = None, dtype: torch.dtype | None = None
    ) -> CodecStreamState:
        """A state for `batch_size` fresh requests (position 0, all buffers zero), on the weights' device/dtype."""
        ref = self.pre_conv.conv.weight
        device = ref.device if device is None else device
        dtype = ref.dtype if dtype is None else dtype
        return CodecStreamState(
            position=torch.zeros(batch_size, dtype=torch.long, device=device),
            buffers={
                k: torch.zeros((batch_size, *shape), dtype=dtype, device=device)
                for k, shape in self._buffer_shapes.items()
            },
        )

    @torch.no_grad()
    def stream_step(
        self, codes: torch.Tensor, state: CodecStreamState, lengths: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, CodecStreamState]:
        """Decodes the next chunk of B requests: codes [B, N, num_quantizers] -> (wav [B, 1, N * spf], new state).

        `lengths` [B] (optional) gives each request's valid frames when shorter chunks were right-padded
        (with valid codes) to N; samples past `lengths[i] * spf` are then meaningless and the state
        advances by `lengths[i]` frames only. `state` is not modified; the returned state is new (or
        `state` itself when N is 0).
        """
        if state.batch_size != codes.shape[0]:
            raise ValueError(f"state holds {state.batch_size} requests, codes {codes.shape[0]}")
        if codes.shape[1] == 0:
            return codes.new_zeros((codes.shape[0], 1, 0), dtype=self.pre_conv.conv.weight.dtype), state
        if lengths is not None:
            lengths = lengths.to(device=codes.device, dtype=torch.long)
        stream = StreamContext(state, codes.shape[1], lengths)
        wav = self._run(codes, stream)
        return wav, stream.finish()
