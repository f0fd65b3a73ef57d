"""The unit moved from a prefill worker to a decode worker: the prompt's KV plus the talker's side state.

`Handoff.kv` layout (contiguous, one tensor for every layer):

    [num_layers, 2, num_blocks, block_size, kv_heads, head_dim]     index 0 of dim 1 is K, 1 is V

i.e. the request's blocks in block-table order, so token t sits at [:, :, t // block_size, t % block_size].
It stays block-shaped because both ends are paged caches: packing and unpacking are one gather / scatter
per cache, never a per-token loop. Positions past `num_tokens` in the last block are zero, so the payload
never carries whatever the previous owner of that block left behind.

The wire form (`encode_handoff` / `write_handoff` / `read_handoff`) is pickle-free:

    b"VXHF" | u32 format version | u64 header length | JSON header | zero pad | tensor bytes ...

The JSON header holds every scalar field, the layout, the sampling parameters (dataclasses.asdict) and,
per tensor, its dtype, shape, offset and size. Tensor regions start on 64-byte boundaries so a receiver
can map them without realigning.
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from legato.models.qwen3_tts.sampling import SamplingParams

HANDOFF_VERSION = 2  # 2: text_open and text_tokens (a request whose text is still arriving)
_MAGIC = b"VXHF"
_PREAMBLE = struct.Struct("<4sIQ")
_ALIGN = 64

# Per-layer list of [num_blocks, block_size, kv_heads, head_dim], or the stacked
# [num_layers, num_blocks, block_size, kv_heads, head_dim] of `PagedKVCache.k` / `.v`.
CacheTensors = torch.Tensor | Sequence[torch.Tensor]


class LayoutMismatch(ValueError):
    """Two ends disagree on the KV layout. `fields` maps each differing field to (ours, theirs)."""

    def __init__(self, fields: dict[str, tuple[object, object]]) -> None:
        self.fields = fields
        detail = ", ".join(f"{name}: {a!r} != {b!r}" for name, (a, b) in fields.items())
        super().__init__(f"KV layout mismatch ({detail})")


class HandoffFormatError(ValueError):
    """Bytes that are not a handoff this code can read (bad magic, unknown version, truncated, bad fields)."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown torch dtype name {name!r}")
    return dtype


@dataclass(frozen=True)
class KVLayout:
    """What both ends must agree on before any KV moves: checked at handshake, never silently adapted."""

    dtype: str  # torch dtype name, e.g. "bfloat16"
    block_size: int
    num_layers: int
    kv_heads: int
    head_dim: int
    model_hash: str  # identifies the weights: KV from another checkpoint is garbage even if shapes agree

    def __post_init__(self) -> None:
        dtype_from_name(self.dtype)
        for name in ("block_size", "num_layers", "kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"KVLayout.{name} must be a positive int, got {value!r}")
        if not isinstance(self.model_hash, str):
            raise ValueError(f"KVLayout.model_hash must be a str, got {self.model_hash!r}")

    @classmethod
    def of_cache(cls, k_cache: CacheTensors, model_hash: str) -> KVLayout:
        """The layout of a stacked [layers, blocks, block_size, kv_heads, head_dim] cache or a per-layer list."""
        layers = len(k_cache)
        _, block_size, kv_heads, head_dim = k_cache[0].shape
        return cls(dtype_name(k_cache[0].dtype), block_size, layers, kv_heads, head_dim, model_hash)

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype)

    def to_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, object]) -> KVLayout:
        return cls(**d)

    def check_compatible(self, other: KVLayout) -> None:
        """Raise LayoutMismatch naming every field that differs; return None when the layouts agree."""
        diffs = {f.name: (getattr(self, f.name), getattr(other, f.name))
                 for f in dataclasses.fields(self) if getattr(self, f.name) != getattr(other, f.name)}
        if diffs:
            raise LayoutMismatch(diffs)


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


@dataclass(repr=False)
class Handoff:
    """Everything a decode worker needs to continue a request prefilled elsewhere.

    Fields mirror the engine's per-request state; tensors are CPU or device tensors, the wire form is
    always CPU. `ref_code` ([T, 16] int64) is only set for in-context voice clones (the codec decoder
    conditions on it); `first_chunk_frames` None means the decode worker's configured default.
    """

    request_id: str
    layout: KVLayout
    num_tokens: int  # prompt positions whose KV is in `kv`
    kv: torch.Tensor  # [num_layers, 2, blocks_for(num_tokens), block_size, kv_heads, head_dim]
    last_hidden: torch.Tensor  # [H] the talker's hidden state at the last prompt position
    first_token: int  # codebook-0 token sampled at prefill
    trailing_text: torch.Tensor  # [n, H] text embeddings still to be fed during decode (n may be 0)
    sampling: SamplingParams
    seed: int
    max_frames: int
    ignore_eos: bool = False
    first_chunk_frames: int | None = None
    ref_code: torch.Tensor | None = None  # [T, 16] int64
    # Streaming text: the request's text is still arriving (the decode side waits for more once the trailing
    # text is used up, and takes appends); `text_tokens` counts the target-text tokens so far, for the frame
    # cap its close sets.
    text_open: bool = False
    text_tokens: int = 0
    version: int = HANDOFF_VERSION

    def __repr__(self) -> str:
        ref = "None" if self.ref_code is None else f"[{self.ref_code.shape[0]}, 16]"
        return (f"Handoff({self.request_id!r}, v{self.version}, tokens={self.num_tokens}, kv={list(self.kv.shape)} "
                f"{self.kv.dtype}, first_token={self.first_token}, trailing={self.trailing_text.shape[0]}, "
                f"seed={self.seed}, max_frames={self.max_frames}, ref_code={ref})")

    def validate(self) -> None:
        """Raise ValueError if the fields are inconsistent with each other or with the layout."""
        lay = self.layout
        if not isinstance(self.num_tokens, int) or self.num_tokens < 1:
            raise ValueError(f"handoff {self.request_id!r}: num_tokens must be >= 1, got {self.num_tokens!r}")
        nb = blocks_for(self.num_tokens, lay.block_size)
        want = (lay.num_layers, 2, nb, lay.block_size, lay.kv_heads, lay.head_dim)
        if tuple(self.kv.shape) != want:
            raise ValueError(f"handoff {self.request_id!r}: kv shape {tuple(self.kv.shape)} != {want}")
        if self.kv.dtype != lay.torch_dtype:
            raise ValueError(f"handoff {self.request_id!r}: kv dtype {self.kv.dtype} != layout {lay.dtype}")
        if self.last_hidden.dim() != 1:
            raise ValueError(f"handoff {self.request_id!r}: last_hidden must be [H], "
                             f"got {tuple(self.last_hidden.shape)}")
        hidden = self.last_hidden.shape[0]
        if self.trailing_text.dim() != 2 or self.trailing_text.shape[1] != hidden:
            raise ValueError(f"handoff {self.request_id!r}: trailing_text must be [n, {hidden}], "
                             f"got {tuple(self.trailing_text.shape)}")
        if self.ref_code is not None and (self.ref_code.dim() != 2 or self.ref_code.shape[1] != 16
                                          or self.ref_code.dtype != torch.int64):
            raise ValueError(f"handoff {self.request_id!r}: ref_code must be [T, 16] int64, "
                             f"got {tuple(self.ref_code.shape)} {self.ref_code.dtype}")
        if self.max_frames < 1:
            raise ValueError(f"handoff {self.request_id!r}: max_frames must be >= 1, got {self.max_frames}")
        if not isinstance(self.text_open, bool) or not isinstance(self.text_tokens, int) or self.text_tokens < 0:
            raise ValueError(f"handoff {self.request_id!r}: text_open must be a bool and text_tokens an int >= 0, "
                             f"got {self.text_open!r}, {self.text_tokens!r}")


# ---------------------------------------------------------------------------------------------------------------
# Packing the paged cache


def _block_index(block_ids: Sequence[int], device: torch.device) -> torch.Tensor:
    ids = [int(b) for b in block_ids]
    if len(set(ids)) != len(ids):
        raise ValueError(f"block ids repeat: {ids}")
    return torch.tensor(ids, dtype=torch.long, device=device)


def gather_blocks(k_cache: CacheTensors, v_cache: CacheTensors, block_ids: Sequence[int],
                  num_tokens: int) -> torch.Tensor:
    """Copy the first `num_tokens` positions of a request's blocks out of the cache, in the Handoff.kv
    layout (on the cache's device). `block_ids` may list more blocks than needed; only the leading
    ceil(num_tokens / block_size) are read."""
    block_size = k_cache[0].shape[1]
    nb = blocks_for(num_tokens, block_size)
    if num_tokens < 1 or len(block_ids) < nb:
        raise ValueError(f"{num_tokens} tokens need {nb} blocks of {block_size}, got {len(block_ids)} block ids")
    idx = _block_index(block_ids[:nb], k_cache[0].device)
    if isinstance(k_cache, torch.Tensor):
        kv = torch.stack([k_cache.index_select(1, idx), v_cache.index_select(1, idx)], dim=1)
    else:
        kv = torch.stack([torch.stack([k.index_select(0, idx), v.index_select(0, idx)])
                          for k, v in zip(k_cache, v_cache, strict=True)])
    tail = nb * block_size - num_tokens
    if tail:
        kv[:, :, -1, block_size - tail:] = 0
    return kv


def scatter_blocks(k_cache: CacheTensors, v_cache: CacheTensors, block_ids: Sequence[int],
                   kv: torch.Tensor) -> None:
    """Write a Handoff.kv tensor into this cache's blocks `block_ids` (the leading kv.shape[2] of them),
    whole blocks at a time: the destination blocks belong to the receiving request, so the zero tail of
    the last block is harmless and is overwritten by decode."""
    nb = kv.shape[2]
    per_layer_shape = tuple(k_cache[0].shape[1:])
    if kv.dim() != 6 or kv.shape[0] != len(k_cache) or kv.shape[1] != 2 or tuple(kv.shape[3:]) != per_layer_shape:
        raise ValueError(f"kv shape {tuple(kv.shape)} does not fit a cache of {len(k_cache)} layers x "
                         f"[blocks, {', '.join(map(str, per_layer_shape))}]")
    if kv.dtype != k_cache[0].dtype:
        raise ValueError(f"kv dtype {kv.dtype} != cache dtype {k_cache[0].dtype}")
    if len(block_ids) < nb:
        raise ValueError(f"kv holds {nb} blocks, got only {len(block_ids)} destination block ids")
    device = k_cache[0].device
    idx = _block_index(block_ids[:nb], device)
    kv = kv.to(device, non_blocking=True)
    if isinstance(k_cache, torch.Tensor):
        k_cache.index_copy_(1, idx, kv[:, 0])
        v_cache.index_copy_(1, idx, kv[:, 1])
    else:
        for layer, (k, v) in enumerate(zip(k_cache, v_cache, strict=True)):
            k.index_copy_(0, idx, kv[layer, 0])
            v.index_copy_(0, idx, kv[layer, 1])


# ---------------------------------------------------------------------------------------------------------------
# Wire form


def handoff_tensors(h: Handoff) -> dict[str, torch.Tensor]:
    """The handoff's tensors by field name (`ref_code` only when set)."""
    out = {"kv": h.kv, "last_hidden": h.last_hidden, "trailing_text": h.trailing_text}
    if h.ref_code is not None:
        out["ref_code"] = h.ref_code
    return out


def handoff_header(h: Handoff) -> dict:
    """Every field of `h` but its tensors, as JSON values (`handoff_from_parts` inverts it)."""
    return {
        "version": h.version,
        "request_id": h.request_id,
        "layout": h.layout.to_dict(),
        "num_tokens": h.num_tokens,
        "first_token": int(h.first_token),
        "sampling": dataclasses.asdict(h.sampling),
        "seed": int(h.seed),
        "max_frames": int(h.max_frames),
        "ignore_eos": bool(h.ignore_eos),
        "first_chunk_frames": h.first_chunk_frames,
        "text_open": bool(h.text_open),
        "text_tokens": int(h.text_tokens),
    }


def handoff_from_parts(header: dict, tensors: dict[str, torch.Tensor]) -> Handoff:
    """The validated Handoff of a `handoff_header` and its `handoff_tensors`, from a peer: raises
    HandoffFormatError for anything missing, mistyped or inconsistent."""
    try:
        h = Handoff(
            request_id=header["request_id"],
            layout=KVLayout.from_dict(header["layout"]),
            num_tokens=header["num_tokens"],
            kv=tensors["kv"],
            last_hidden=tensors["last_hidden"],
            first_token=header["first_token"],
            trailing_text=tensors["trailing_text"],
            sampling=SamplingParams(**header["sampling"]),
            seed=header["seed"],
            max_frames=header["max_frames"],
            ignore_eos=header["ignore_eos"],
            first_chunk_frames=header["first_chunk_frames"],
            ref_code=tensors.get("ref_code"),
            text_open=header["text_open"],
            text_tokens=header["text_tokens"],
            version=header["version"],
        )
        h.validate()
    except (KeyError, TypeError, ValueError) as e:
        raise HandoffFormatError(f"malformed handoff: {e}") from e
    return h


def tensor_spec(t: torch.Tensor) -> dict:
    """dtype, shape and size of `t` as JSON values; `offset` is where a packer puts it."""
    return {"dtype": dtype_name(t.dtype), "shape": list(t.shape), "nbytes": t.numel() * t.element_size(), "offset": 0}


def pack_offsets(specs: dict[str, dict], start: int) -> int:
    """Sets each spec's `offset`, from `start`, every region on an aligned boundary; returns the end."""
    end = start
    for spec in specs.values():
        spec["offset"] = end
        end = _align(end + spec["nbytes"])
    return end


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _plan(h: Handoff) -> tuple[bytes, dict[str, torch.Tensor], dict[str, dict], int]:
    """(header JSON, tensors, their specs, total size)."""
    tensors = handoff_tensors(h)
    specs = {name: tensor_spec(t) for name, t in tensors.items()}
    header = {**handoff_header(h), "tensors": specs}
    # The offsets depend on the header's length, which depends on the offsets' digits: settle in a few passes.
    data_start = end = -1
    while True:
        blob = json.dumps(header).encode()
        start = _align(_PREAMBLE.size + len(blob))
        if start == data_start:
            return blob, tensors, specs, end
        data_start = start
        end = pack_offsets(specs, start)


def handoff_nbytes(h: Handoff) -> int:
    """Size of the wire form of `h`."""
    return _plan(h)[3]


def write_handoff(h: Handoff, buf: memoryview | bytearray) -> int:
    """Serialise `h` into the writable buffer `buf` (at least handoff_nbytes(h) long); returns the size
    used. Device tensors are copied straight into `buf`."""
    h.validate()
    blob, tensors, specs, total = _plan(h)
    view = memoryview(buf).cast("B")
    if len(view) < total:
        raise ValueError(f"buffer of {len(view)} bytes is smaller than the {total}-byte handoff")
    view[:_PREAMBLE.size] = _PREAMBLE.pack(_MAGIC, h.version, len(blob))
    view[_PREAMBLE.size:_PREAMBLE.size + len(blob)] = blob
    copy_regions(torch.frombuffer(view, dtype=torch.uint8, count=total), tensors, specs)
    return total


def copy_regions(dst: torch.Tensor, tensors: dict[str, torch.Tensor], specs: dict[str, dict]) -> None:
    """Copies each tensor's bytes into the uint8 buffer `dst` (host or device) at its spec's offset."""
    for name, t in tensors.items():
        spec = specs[name]
        if spec["nbytes"]:
            region = dst[spec["offset"]: spec["offset"] + spec["nbytes"]]
            region.copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))


def encode_handoff(h: Handoff) -> bytes:
    """`h` as one bytes object (for transports that want a single message)."""
    buf = bytearray(handoff_nbytes(h))
    write_handoff(h, buf)
    return bytes(buf)


def tensor_region(spec: dict, limit: int) -> tuple[torch.dtype, list[int], int, int]:
    """(dtype, shape, nbytes, offset) of a peer's tensor spec, checked against a `limit`-byte buffer:
    raises HandoffFormatError for a size that does not match its shape or a region outside the buffer."""
    dtype = dtype_from_name(spec["dtype"])
    shape = [int(s) for s in spec["shape"]]
    nbytes, offset = int(spec["nbytes"]), int(spec["offset"])
    if min(shape, default=0) < 0 or nbytes != math.prod(shape) * torch.empty((), dtype=dtype).element_size():
        raise HandoffFormatError(f"tensor size {nbytes} does not match {spec['dtype']}{shape}")
    if offset < 0 or offset + nbytes > limit:
        raise HandoffFormatError(f"tensor region [{offset}, {offset + nbytes}) outside the {limit}-byte buffer")
    return dtype, shape, nbytes, offset


def _read_tensor(view: memoryview, spec: dict, limit: int) -> torch.Tensor:
    dtype, shape, nbytes, offset = tensor_region(spec, limit)
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    # One copy out of the (possibly read-only, possibly shared) buffer into memory we own.
    raw = np.frombuffer(view, dtype=np.uint8, count=nbytes, offset=offset).copy()
    return torch.from_numpy(raw).view(dtype).reshape(shape)


def read_handoff(buf: bytes | bytearray | memoryview) -> Handoff:
    """Parse the wire form; the returned tensors are CPU copies that do not alias `buf`."""
    view = memoryview(buf).cast("B")
    if len(view) < _PREAMBLE.size:
        raise HandoffFormatError(f"{len(view)} bytes is too short for a handoff")
    magic, version, header_len = _PREAMBLE.unpack_from(view, 0)
    if magic != _MAGIC:
        raise HandoffFormatError(f"bad magic {bytes(magic)!r}")
    if version != HANDOFF_VERSION:
        raise HandoffFormatError(f"handoff format version {version}, this build reads {HANDOFF_VERSION}")
    if _PREAMBLE.size + header_len > len(view):
        raise HandoffFormatError("truncated header")
    try:
        header = json.loads(bytes(view[_PREAMBLE.size:_PREAMBLE.size + header_len]))
        specs = header["tensors"]
        tensors = {name: _read_tensor(view, spec, len(view)) for name, spec in specs.items()}
    except HandoffFormatError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise HandoffFormatError(f"malformed handoff: {e}") from e
    return handoff_from_parts(header, tensors)
