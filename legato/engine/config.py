"""Engine configuration: one dataclass, validated where it is built."""

from __future__ import annotations

import math
from dataclasses import dataclass

_DTYPES = ("bfloat16", "float16", "float32")
_CODEC_DTYPES = ("auto", "bfloat16", "float32")


def _is_positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclass(slots=True)
class EngineConfig:
    """Limits and switches for one engine (one worker, one device).

    Token counts are talker positions: a request holds ``prompt_len + max_frames`` of them at most
    (one KV position per generated frame).
    """

    max_num_seqs: int = 64
    """Most requests holding a slot at once (running or receiving a handoff); also the largest decode batch."""
    max_num_batched_tokens: int = 4096
    """Token budget of one step: every decode counts 1, a prefill chunk counts its length."""
    block_size: int = 16
    """Tokens per KV block."""
    num_kv_blocks: int | None = None
    """KV blocks in the cache; None until the runner has profiled memory."""
    enable_chunked_prefill: bool = True
    """Split long prompts across steps; when off, a prompt is prefilled whole in one step or waits."""
    enable_prefix_caching: bool = False
    """Share full prompt blocks between requests whose prefix keys match."""
    max_model_len: int = 32768
    """Most positions one request may use (prompt + frames); the talker's max_position_embeddings."""
    max_prompt_tokens: int | None = None
    """Most prompt positions (talker prefill tokens) one request may bring; a longer prompt is refused at
    admission (RequestTooLargeError) before any of it runs. None: no limit beyond `max_model_len`. The server
    sets it from `--max-prompt-tokens` (ServerSettings.max_prompt_tokens), checked in its front end first."""
    max_waiting: int = 1024
    """Bound of the waiting queue; add() beyond it raises QueueFullError."""
    gpu_memory_utilization: float = 0.9
    """Fraction of device memory the worker may use (weights + activations + KV)."""
    enforce_eager: bool = False
    """Skip CUDA-graph capture."""
    cuda_graph_max_batch: int | None = None
    """Largest decode batch captured as a CUDA graph (None: max_num_seqs); larger batches run eagerly."""
    mtp_replicas: int = 1
    """Code-predictor replica groups (`mtp:K`): the decode batch is split into K groups by crc32(request id),
    each running on its own stream with its own CUDA graphs, so groups overlap on the device."""
    code_predictor_stack: bool = False
    """Run each one-row code-predictor pass (5 layers, final norm, head) as one persistent launch
    (`layers/decoder_stack.py`; CUDA, bf16/fp16, one replica group). On an H100 (2026-12-07) it made a batch-1
    frame 1.05x faster for the 0.6B (3.43 -> 3.26 ms) and the 1.7B (4.60 -> 4.36); bigger batches keep the
    unfused layers. Its logits differ from the unfused bf16 path's by ~1.3-1.5e-2 (relative), so greedy codes may
    too; against fp32 math on the same weights both paths are as far (1 row: 1.58e-2 and 1.60e-2). Opt-in: its
    grid barrier needs all its programs resident at once, which processes sharing the GPU's SMs (MPS co-tenants,
    another engine's stack on another stream) can prevent; a pass whose barrier then gives up (its programs
    could not all run at once) fails its step's requests."""
    batch_invariant: bool = False
    """Make a request's codes independent of what runs beside it, on any device: every decode step runs in
    chunks of exactly `invariant_rows` rows (padded), prefill chunks are cut at fixed sizes, and the first
    token of each prompt is sampled alone. GPU kernels pick tilings and reduction splits by batch shape, so
    without this a seeded request's codes on a GPU can depend on the load and the topology (they never do
    on the CPU). Costs latency at low load (a step is never smaller than `invariant_rows` rows) and
    throughput above it (bigger batches run as several chunks)."""
    fair_prefill: bool = True
    """Share each step's prefill budget among the prompts being prefilled (water-filling), so one long
    prompt cannot hold the whole budget for many steps while short prompts behind it wait. Applies with
    chunked prefill outside `batch_invariant` (whose chunks are cut at fixed sizes); off: the earliest
    admitted prompt takes what it can first."""
    prefill_interval: int = 1
    """Waiting prompts join the running batch at most every this many steps (1: every step). Served requests
    arrive one by one, so at high load nearly every step carries a small prefill, and each prefill costs the host
    about as much whatever its size (its graph launch, copies and first-token sampling); with k > 1 they are
    taken together. A request waits up to k - 1 more steps for its first frame; an engine with no decodes
    running admits at once, so a lone request never waits. Handoffs (MpNd decode engines) are never held."""
    invariant_rows: int = 32
    """The fixed decode chunk of `batch_invariant`; engines compared for identical codes must agree on it."""
    first_chunk_frames: int = 1
    """Frames in the first streamed codec chunk (time to first audio)."""
    chunk_frames: int = 25
    """Frames in each later streamed codec chunk (the largest, once the ramp reaches it)."""
    async_scheduling: bool = True
    """Launch step t before reading step t - 1's results, so the host's work (scheduling, inputs, codec
    calls, outputs) overlaps the device's. Stop decisions then come one step late: the frame decoded past a
    request's end is dropped, never emitted. Off: every step is read back before the next is launched."""
    codec_window_frames: int | None = 300
    """Streamed audio follows the reference's windowed decode: windows of this many frames (reference frames
    of an in-context clone included), each decoded with `codec_window_context` frames of left context. None:
    full-context streaming (the whole-utterance forward), which differs from the reference past 300 frames."""
    codec_window_context: int = 25
    voice_cache_size: int = 256
    """Reference clips whose voice features (speaker embedding, reference codes) are kept, so a clip sent
    again is not encoded again; 0 turns the cache off."""
    chunk_ramp: bool = True
    """Between the first chunk and `chunk_frames`, make each chunk as long as the audio already sent (1, 1, 2,
    4, 8, 16, 25, ...), so a real-time player never runs dry; off: straight to `chunk_frames` after the first.
    On by default since measured on the H200 (docs/benchmarks.md): continuity 1.00 instead of 0 up to
    concurrency 8, for 10 ms of TTFP at concurrency 1; the extra chunks replay CUDA graphs."""
    codec_decode_every_step: bool = True
    """Decode each step's new frames of every stream in one codec call and hold the PCM until the stream's
    next chunk is complete (the client sees the same chunks); off: decode each chunk when it is due, one call
    per chunk size. On by default since measured on the H200 (docs/benchmarks.md)."""
    max_text_tokens: int = 2048
    """Most text tokens one request may trail into its decode steps (sizes a per-slot device buffer)."""
    frames_per_text_token: float | None = 8.0
    """The frame cap: a request that is not given an exact length (`ignore_eos` with `max_frames`) stops at
    `frames_per_text_token * (target text tokens) + frame_cap_margin` frames at most, finishing `length`.
    Speech runs at about 3-4 frames (80 ms each) per text token, so 8 is twice a slow speaker; the cap is
    what stops a checkpoint that never samples EOS (a known failure of this model family, and every
    random-weight model) from running to `max_new_tokens`. None: no cap."""
    frame_cap_margin: int = 50
    """Frames added to the text-derived cap, so that very short inputs ("Hi.") keep room for a pause."""
    device: str = "cuda"
    dtype: str = "bfloat16"
    codec_dtype: str = "auto"
    """The streaming codec decoder's dtype: "auto" is bfloat16 on CUDA (docs/benchmarks.md has its fidelity
    against fp32) and float32 on the CPU; "float32" is the exact path (the reference runs the codec in fp32)."""
    emit_audio: bool = True
    """Decode audio in this engine. False: a talker-only engine (`split`) that never runs the codec decoder
    and streams each step's codes with empty audio; a codec worker turns them into PCM."""
    prefill_only: bool = False
    """An MpNd prefill engine: it takes only requests that hand their prefill on (`handoff_only`), so it builds
    no codec decoder and captures no decode graphs (their memory goes to its KV blocks, and its start is
    shorter), and it warms up with such requests."""

    def __post_init__(self) -> None:
        if self.cuda_graph_max_batch is not None and not _is_positive_int(self.cuda_graph_max_batch):
            raise ValueError(f"EngineConfig.cuda_graph_max_batch must be a positive int or None, "
                             f"got {self.cuda_graph_max_batch!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "max_model_len", "max_waiting",
                     "first_chunk_frames", "chunk_frames", "max_text_tokens",
                     "invariant_rows", "prefill_interval"):
            value = getattr(self, name)
            if not _is_positive_int(value):
                raise ValueError(f"EngineConfig.{name} must be a positive int, got {value!r}")
        if self.block_size & (self.block_size - 1):
            # The paged-attention kernel tiles one block at a time with power-of-two shapes.
            raise ValueError(f"EngineConfig.block_size must be a power of two, got {self.block_size}")
        if self.max_prompt_tokens is not None and not _is_positive_int(self.max_prompt_tokens):
            raise ValueError(f"EngineConfig.max_prompt_tokens must be a positive int or None, "
                             f"got {self.max_prompt_tokens!r}")
        if self.num_kv_blocks is not None and not _is_positive_int(self.num_kv_blocks):
            raise ValueError(f"EngineConfig.num_kv_blocks must be a positive int or None, got {self.num_kv_blocks!r}")
        if not _is_positive_int(self.mtp_replicas):
            raise ValueError(f"EngineConfig.mtp_replicas must be a positive int, got {self.mtp_replicas!r}")
        if self.mtp_replicas > self.max_num_seqs:
            raise ValueError(f"EngineConfig.mtp_replicas ({self.mtp_replicas}) must be <= max_num_seqs "
                             f"({self.max_num_seqs}): a replica group without a request to run is pure overhead")
        if self.max_num_batched_tokens < self.max_num_seqs:
            # Every running request decodes every step; the budget must cover a full decode batch.
            raise ValueError(f"EngineConfig.max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                             f"max_num_seqs ({self.max_num_seqs}) so every running request can decode each step")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("EngineConfig.gpu_memory_utilization must be in (0, 1], "
                             f"got {self.gpu_memory_utilization}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"EngineConfig.dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.codec_dtype not in _CODEC_DTYPES:  # float16 has no fidelity report: not offered
            raise ValueError(f"EngineConfig.codec_dtype must be one of {_CODEC_DTYPES}, got {self.codec_dtype!r}")
        if not isinstance(self.code_predictor_stack, bool):
            raise ValueError(f"EngineConfig.code_predictor_stack must be a bool, got {self.code_predictor_stack!r}")
        if self.code_predictor_stack and not (str(self.device).startswith("cuda") and self.dtype != "float32"
                                              and self.mtp_replicas == 1):
            raise ValueError("EngineConfig.code_predictor_stack needs a CUDA device, a half-precision dtype and "
                             f"mtp_replicas 1, got device {self.device!r}, dtype {self.dtype!r}, "
                             f"mtp_replicas {self.mtp_replicas}")
        if not isinstance(self.batch_invariant, bool):
            raise ValueError(f"EngineConfig.batch_invariant must be a bool, got {self.batch_invariant!r}")
        if self.batch_invariant and self.max_num_batched_tokens <= self.max_num_seqs:
            raise ValueError("EngineConfig.batch_invariant needs max_num_batched_tokens > max_num_seqs: prefill "
                             "chunks are cut at max_num_batched_tokens - max_num_seqs tokens")
        if self.codec_window_frames is not None and not (
                _is_positive_int(self.codec_window_frames) and isinstance(self.codec_window_context, int)
                and 0 <= self.codec_window_context < self.codec_window_frames):
            raise ValueError("EngineConfig.codec_window_frames must be None or a positive int above "
                             f"codec_window_context >= 0, got {self.codec_window_frames!r} and "
                             f"{self.codec_window_context!r}")
        if not isinstance(self.voice_cache_size, int) or isinstance(self.voice_cache_size, bool) \
                or self.voice_cache_size < 0:
            raise ValueError(f"EngineConfig.voice_cache_size must be an int >= 0, got {self.voice_cache_size!r}")
        if not isinstance(self.fair_prefill, bool):
            raise ValueError(f"EngineConfig.fair_prefill must be a bool, got {self.fair_prefill!r}")
        if not isinstance(self.codec_decode_every_step, bool):
            raise ValueError("EngineConfig.codec_decode_every_step must be a bool, got "
                             f"{self.codec_decode_every_step!r}")
        if not isinstance(self.chunk_ramp, bool):
            raise ValueError(f"EngineConfig.chunk_ramp must be a bool, got {self.chunk_ramp!r}")
        if not isinstance(self.async_scheduling, bool):
            raise ValueError(f"EngineConfig.async_scheduling must be a bool, got {self.async_scheduling!r}")
        if not isinstance(self.emit_audio, bool):
            raise ValueError(f"EngineConfig.emit_audio must be a bool, got {self.emit_audio!r}")
        if not isinstance(self.prefill_only, bool):
            raise ValueError(f"EngineConfig.prefill_only must be a bool, got {self.prefill_only!r}")
        per_token = self.frames_per_text_token
        if per_token is not None and not (isinstance(per_token, (int, float)) and not isinstance(per_token, bool)
                                          and 0 < per_token < float("inf")):
            raise ValueError("EngineConfig.frames_per_text_token must be a positive number or None, "
                             f"got {self.frames_per_text_token!r}")
        if not isinstance(self.frame_cap_margin, int) or isinstance(self.frame_cap_margin, bool) \
                or self.frame_cap_margin < 0:
            raise ValueError(f"EngineConfig.frame_cap_margin must be an int >= 0, got {self.frame_cap_margin!r}")
        if not isinstance(self.device, str) or not self.device:
            raise ValueError(f"EngineConfig.device must be a non-empty string, got {self.device!r}")

    def frame_cap_for(self, text_tokens: int) -> int | None:
        """The frame cap of a text of `text_tokens` tokens (`frames_per_text_token`), or None when off. One
        formula for the engine, which holds requests to it, and the server, which reports which cap cut one."""
        if self.frames_per_text_token is None:
            return None
        return max(1, math.ceil(self.frames_per_text_token * text_tokens) + self.frame_cap_margin)


def codec_dtype_name(codec_dtype: str, device: str) -> str:
    """The codec decoder's dtype for a device: "auto" is bfloat16 on CUDA and float32 elsewhere."""
    if codec_dtype != "auto":
        return codec_dtype
    return "bfloat16" if str(device).startswith("cuda") else "float32"
