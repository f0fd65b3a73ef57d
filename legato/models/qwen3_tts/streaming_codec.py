"""The codec decoder as a time-major streaming step over slots whose state is updated in place.

`StreamingCodecDecoder.step(slots, codes)` decodes the next `T` frames of each stream in `slots` and returns
their audio; every stream's state (conv histories, attention keys and values, position) lives in its slot of
one bank (`codec_slots.py`) and is read and written there by the kernels, so a call gathers, scatters,
concatenates and clones nothing. Activations are `[rows, channels]` with rows (stream, time), every conv is
one GEMM (`legato/layers/causal_conv.py`), and the weights are folded at construction (`codec_stages.py`).

It equals `CodecDecoder.stream_step` chunk for chunk (fp32 within rounding; tested on the CPU against it),
so chunks of any sizes concatenate to the whole-utterance forward. Two paths, chosen by dtype and device:
Triton kernels in bf16/fp16 storage with fp32 math on CUDA, and their PyTorch twins elsewhere (the CPU,
and the exact fp32 path on CUDA, where matmuls stay in full fp32 unless the process enabled TF32).
"""

from __future__ import annotations

import os

import torch

from legato.layers import causal_conv
from legato.layers.causal_conv import conv_gemm

from .codec_decoder import CodecDecoder
from .codec_slots import CodecSlots, SlotLayout
from .codec_stages import (
    Conv,
    Quantizer,
    StepContext,
    Transformer,
    UpsampleStage,
    VocoderBlock,
    conv_weight,
    snake_params,
)
from .config import CodecDecoderConfig

MAX_CALL_FRAMES = 32  # frames one call decodes; longer inputs run as several calls (the state carries)


def slot_bytes(cfg: CodecDecoderConfig, dtype: torch.dtype, max_call_frames: int = MAX_CALL_FRAMES) -> int:
    """The state one slot holds (attention rings and both copies of every conv history), for memory budgets
    made before the decoder exists; `CodecSlots.nbytes_per_slot` is the exact figure once it does."""
    ring = cfg.sliding_window - 1 + max_call_frames
    kv = 2 * cfg.num_hidden_layers * ring * cfg.num_key_value_heads * cfg.head_dim
    dims = [cfg.decoder_dim // 2**i for i in range(len(cfg.upsample_rates) + 1)]
    hist = 2 * cfg.codebook_dim + 6 * cfg.latent_dim * (len(cfg.upsampling_ratios) + 1) + 6 * dims[-1]
    hist += sum(dims[i] + 78 * dims[i + 1] for i in range(len(cfg.upsample_rates)))  # 1 + 6 * (1 + 3 + 9)
    return (kv + 2 * hist) * torch.empty(0, dtype=dtype).element_size()


class StreamingCodecDecoder:
    def __init__(self, decoder: CodecDecoder, slots: int, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, max_call_frames: int = MAX_CALL_FRAMES,
                 kernels: bool | None = None) -> None:
        """Folds `decoder`'s weights into a streaming decoder with a bank of `slots` slots, in `dtype` on
        `device` (both default to the decoder's). `kernels`: run the Triton kernels (default: on CUDA below
        fp32) or the PyTorch twins."""
        ref = decoder.pre_conv.conv.weight
        self.device = torch.device(device) if device is not None else ref.device
        self.dtype = dtype or ref.dtype
        if kernels is None:
            kernels = self.device.type == "cuda" and self.dtype != torch.float32
        if kernels and causal_conv.triton is None:
            raise ValueError(f"the streaming codec in {self.dtype} on {self.device} runs Triton kernels, and Triton is "
                             "not installed: pip install triton, or use --codec-dtype float32")
        if kernels and self.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("the streaming codec's Triton kernels need a CUDA device")
        self.kernels = kernels
        self.config = decoder.config
        self.samples_per_frame = decoder.samples_per_frame
        self.num_quantizers = decoder.num_quantizers
        self.max_call_frames = max_call_frames
        dt, dev = self.dtype, self.device
        with torch.no_grad():
            self.quantizer = Quantizer(decoder.quantizer, dt, dev)
            pre = decoder.pre_conv.conv.weight.detach().double()  # [latent, codebook_dim, k]
            folded = torch.einsum("oik,ij->ojk", pre, self.quantizer.proj)
            self.pre_conv = Conv("pre_conv", conv_weight(folded), decoder.pre_conv.conv.bias,
                                 pre.shape[2], 1, 1, dt, dev)
            self.transformer = Transformer(decoder.pre_transformer, decoder.config.sliding_window - 1
                                           + max_call_frames, dt, dev)
            rate = 1
            self.upsample = []
            for i, module in enumerate(decoder.upsample):
                self.upsample.append(UpsampleStage(f"upsample{i}", module, rate, dt, dev))
                rate *= self.upsample[-1].factor
            first, *blocks, snake, last = decoder.decoder
            self.conv0 = Conv("conv0", conv_weight(first.conv.weight), first.conv.bias, first.conv.kernel_size[0],
                              first.conv.dilation[0], rate, dt, dev)
            self.blocks = []
            for i, module in enumerate(blocks):
                self.blocks.append(VocoderBlock(f"block{i}", module, rate, dt, dev))
                rate *= self.blocks[-1].factor
            self.last = Conv("last", conv_weight(last.conv.weight), last.conv.bias, last.conv.kernel_size[0],
                             last.conv.dilation[0], rate, dt, dev, snake_in=snake_params(snake, dev),
                             epilogue="clamp")
        if rate != self.samples_per_frame:
            raise ValueError(f"codec decoder: stages give {rate} samples per frame, expected {self.samples_per_frame}")
        t = self.transformer
        self.layout = SlotLayout(self._histories(), len(t.layers), t.ring, t.kv_heads, t.head_dim)
        self.bank = CodecSlots(self.layout, slots, dt, dev)

    def _convs(self) -> list[Conv]:
        convs = [self.pre_conv, self.conv0, self.last]
        for up in self.upsample:
            convs += [up.up, up.pw1, up.pw2]
        for block in self.blocks:
            convs.append(block.up)
            for unit in block.units:
                convs += [unit.conv7, unit.conv1]
        return convs

    def _histories(self) -> dict[str, tuple[int, int]]:
        hist = {c.name: (c.history, c.cin) for c in self._convs() if c.staged}
        for up in self.upsample:
            hist[up.dw_name] = (up.dw_history, up.up.cout)
        return hist

    @property
    def slots(self) -> int:
        return self.bank.size

    def resize(self, slots: int) -> None:
        """Reallocates the bank with `slots` slots, keeping the state of the first ones (captured graphs that
        point at the old bank must be dropped)."""
        self.bank = self.bank.resized(slots)

    def reset(self, slots: torch.Tensor) -> None:
        self.bank.reset(slots)

    @torch.inference_mode()
    def step(self, slots: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        """codes [B, T, num_quantizers] (int64) through `slots` [B] (int64, on the device; distinct, except
        a scratch slot whose state nobody reads) -> audio [B, T * samples_per_frame] float32. Every slot
        advances by T frames."""
        if codes.ndim != 3 or codes.shape[2] != self.num_quantizers or codes.shape[0] != slots.shape[0]:
            raise ValueError(f"codes must be [{slots.shape[0]}, T, {self.num_quantizers}], got {tuple(codes.shape)}")
        n = codes.shape[1]
        if n > self.max_call_frames:
            return torch.cat([self.step(slots, codes[:, i: i + self.max_call_frames])
                              for i in range(0, n, self.max_call_frames)], dim=1)
        if n == 0:
            return torch.zeros(codes.shape[0], 0, dtype=torch.float32, device=codes.device)
        ctx = StepContext(slots, n, self.bank, self.kernels)
        b = slots.shape[0]
        p = self.quantizer(codes, ctx, self.pre_conv.name)
        c = self.pre_conv  # over the quantizer's output, which already holds the conv's history
        h = conv_gemm(p, c.weight, c.bias, n, c.taps, c.dil, kernel=ctx.kernels)
        h = self.transformer(h, ctx)
        x = h.view(b, n, -1)
        for up in self.upsample:
            x = up(x, ctx)
        # From here on each conv's epilogue also stages its output for the next staged conv (`feed`), and that
        # conv adds only the history rows (`pre`).
        chain = [*(block.up for block in self.blocks), self.last]
        pre = chain[0].new_input(b, x.shape[1], ctx)
        x = self.conv0(x, ctx, feed=pre).view(b, x.shape[1], -1)
        for block, then in zip(self.blocks, chain[1:], strict=True):
            x, pre = block(x, ctx, pre=pre, then=then)
        wav = self.last(x, ctx, out_dtype=torch.float32, pre=pre)
        self.bank.advance(slots, n)
        return wav.view(b, n * self.samples_per_frame)
