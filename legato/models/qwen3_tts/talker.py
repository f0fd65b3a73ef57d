"""The talker: a Qwen3 decoder LM over summed text-track and codec-track embeddings that predicts
codebook 0 of each 12.5 Hz frame, plus the code predictor that fills in codebooks 1..15.

State-dict keys (inside the top-level model, under `talker.`) equal the official ones:
`model.layers.N.*`, `model.norm`, `model.codec_embedding`, `model.text_embedding`,
`text_projection.linear_fc{1,2}`, `codec_head`, `code_predictor.*`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from legato.layers.matmuls import linear
from legato.layers.norm import RMSNorm
from legato.layers.rotary import RotaryEmbedding

from .code_predictor import CodePredictor
from .config import TalkerConfig
from .decoder_layer import KVCache, build_layers, run_layers


class TextProjection(nn.Module):
    """`fc2(silu(fc1(x)))` with biases: maps the text embedding width onto the talker width."""

    def __init__(self, text_hidden: int, hidden: int) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(text_hidden, text_hidden, bias=True)
        self.linear_fc2 = nn.Linear(text_hidden, hidden, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.silu(self.linear_fc1(x)))


class TalkerModel(nn.Module):
    def __init__(self, cfg: TalkerConfig) -> None:
        super().__init__()
        self.layers = build_layers(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.codec_embedding = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.text_embedding = nn.Embedding(cfg.text_vocab_size, cfg.text_hidden_size)
        # The nominal 3-D mrope feeds one position to all sections, which is exactly 1-D RoPE.
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta)


class Talker(nn.Module):
    def __init__(self, cfg: TalkerConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = TalkerModel(cfg)
        self.text_projection = TextProjection(cfg.text_hidden_size, cfg.hidden_size)
        self.codec_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.code_predictor = CodePredictor(cfg.code_predictor_config, cfg.hidden_size)
        # The 16 codebooks' embedding tables as one (`pack_frame_table`): a frame's embedding is then one gather
        # instead of sixteen. Each table's weight is a view of its rows, so the tables are held once.
        self.frame_table: torch.Tensor | None = None
        self.frame_offsets: torch.Tensor | None = None  # int64 [16]: codebook g's first row in frame_table
        self._frame_pointers: list[int] = []

    @property
    def num_code_groups(self) -> int:
        return self.config.num_code_groups

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """embeds [B, S, H], positions [B, S] -> final-normed hidden states [B, S, H].

        Keys/values of the S tokens are written through `cache`; the caller advances it."""
        cos, sin = self.model.rotary(positions)
        return run_layers(self.model.layers, embeds, cos, sin, cache, self.model.norm)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Codebook-0 (plus control-token) logits [..., vocab_size] from final hidden states."""
        return linear(hidden, self.codec_head.weight)

    # Embedding helpers: the talker input at every position is text-track + codec-track.

    def embed_text(self, ids: torch.Tensor) -> torch.Tensor:
        """Text-track embedding T(ids) = text_projection(text_embedding(ids)): [...] -> [..., H]."""
        return self.text_projection(self.model.text_embedding(ids))

    def embed_codec(self, ids: torch.Tensor) -> torch.Tensor:
        """Codec-track embedding of codebook-0 codes or control ids: [...] -> [..., H]."""
        return self.model.codec_embedding(ids)

    def embed_frame(self, codes: torch.Tensor) -> torch.Tensor:
        """Sum of the 16 codebook embeddings of whole frames: codes [..., G] -> [..., H].

        Codebook 0 uses the talker's codec embedding, codebook g >= 1 the code predictor's table g-1.
        The per-codebook vectors are stacked and reduced in one `sum`, as the reference does, so prompt
        and decode inputs match it bit for bit. With the packed table the stack is one gather's output, the
        same [..., G, H] values (a frame's 16 embedding kernels and the stack's copy became one kernel)."""
        if self._frame_table_current():
            rows = (codes + self.frame_offsets).reshape(-1)
            parts = self.frame_table.index_select(0, rows).view(*codes.shape, -1)
            return parts.sum(dim=-2)
        tables = self._frame_tables()
        parts = [table(codes[..., g]) for g, table in enumerate(tables)]
        return torch.stack(parts, dim=-2).sum(dim=-2)

    def _frame_tables(self) -> list[nn.Embedding]:
        return [self.model.codec_embedding, *self.code_predictor.model.codec_embedding]

    def _frame_table_current(self) -> bool:
        # The tables still view `frame_table` (a move or dtype change of the module gives each weight its own
        # copy, which the packed table would not follow).
        if self.frame_table is None:
            return False
        return [t.weight.data_ptr() for t in self._frame_tables()] == self._frame_pointers

    def pack_frame_table(self) -> None:
        """Concatenates the 16 codebook tables into `frame_table` and makes each table's weight a view of its rows
        (idempotent; call it once the weights are on their device: moving the module copies each weight apart
        again, and `embed_frame` then takes the tables one by one)."""
        if self.frame_table is not None:
            return
        tables = self._frame_tables()
        with torch.no_grad():
            packed = torch.cat([t.weight for t in tables])
        offsets, start = [], 0
        for t in tables:
            rows = t.weight.shape[0]
            t.weight = nn.Parameter(packed[start:start + rows], requires_grad=t.weight.requires_grad)
            offsets.append(start)
            start += rows
        self.frame_table = packed
        self.frame_offsets = torch.tensor(offsets, dtype=torch.int64, device=packed.device)
        self._frame_pointers = [t.weight.data_ptr() for t in tables]
