"""The code predictor ("MTP" / sub-talker): a small Qwen3 decoder that turns the talker's hidden state
and codebook 0 of a frame into codebooks 1..15, one per pass, with positions restarting at 0 each frame.

State-dict keys (under `talker.code_predictor.`) equal the official ones: `model.layers.N.*`,
`model.norm`, `model.codec_embedding.{0..14}`, `lm_head.{0..14}`, `small_to_mtp_projection`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from legato.layers import decoder_stack, lookup_norm
from legato.layers.matmuls import linear
from legato.layers.norm import RMSNorm
from legato.layers.rotary import RotaryEmbedding

from .config import CodePredictorConfig
from .decoder_layer import ContiguousKVCache, KVCache, build_layers, run_layers

# (logits [B, V], codebook index g in 1..15) -> codes [B]; batched, so an engine can plug a counter-based sampler
# without a per-request loop. The logits come in the head's dtype (fp32 from the one-launch pass, else the model's):
# a sampler widens them as it needs, so a bf16 model's draw kernel needs no cast kernel before it.
CodeSampler = Callable[[torch.Tensor, int], torch.Tensor]


# A codebook's embedding row looked up by the stack's launch (`decoder_stack.run(code=...)`) rather than gathered
# before it. Off: with the activation rows spread over the weight layout, the looked-up launch spilled more
# (208 bytes of stack a thread against 120) and took 130.0 us against 126.1 for the gather and the launch
# (H100, 2026-12-06, stack_phases.py); before the spread form it won, 139.7 against 145.4. With o inside the
# attention's phase it wins the pass again, 121.1 against 124.3 (H100, 2026-12-06 (6)), but no frame has been timed
# with it alone: the one frame run with it on also had a slower draw (docs/benchmarks.md).
STACK_LOOKUP = False
# Where a projection sits between the talker's width and this model's (the 1.7B), a pass's input row can come from
# the projected tables (`project_tables`, 63 MB for the 1.7B in bf16) through `lookup_norm`, as the 0.6B's comes
# from its embedding tables: one kernel instead of a gather, the projection and the first norm before each of a
# frame's 14 single-token passes. The table's rows come from one product over the whole table rather than one a
# pass, so they may round differently (CUDA only: the CPU never takes the kernel). On: the 1.7B's frame took 4.530 ms
# against 4.636 at batch 1 and 4.619 against 4.821 at batch 8, the same codes (H100, 2026-12-07 (5);
# `offline.py --no-projected-lookup` runs without). The engine builds the tables when it is on.
PROJECTED_LOOKUP = True

class CodePredictorModel(nn.Module):
    def __init__(self, cfg: CodePredictorConfig, talker_hidden: int) -> None:
        super().__init__()
        self.layers = build_layers(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # Embeddings live at the *talker* width: they feed the talker's frame sum as well.
        self.codec_embedding = nn.ModuleList(
            nn.Embedding(cfg.vocab_size, talker_hidden) for _ in range(cfg.num_code_groups - 1)
        )
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta)


class CodePredictor(nn.Module):
    def __init__(self, cfg: CodePredictorConfig, talker_hidden: int) -> None:
        super().__init__()
        self.config = cfg
        self.model = CodePredictorModel(cfg, talker_hidden)
        self.lm_head = nn.ModuleList(
            nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False) for _ in range(cfg.num_code_groups - 1)
        )
        if cfg.hidden_size != talker_hidden:
            self.small_to_mtp_projection: nn.Module = nn.Linear(talker_hidden, cfg.hidden_size, bias=True)
        else:
            self.small_to_mtp_projection = nn.Identity()
        # The serving layout's stacked weights for the one-launch pass (`layers/decoder_stack.py`), made by
        # `pack_stack` on CUDA when an engine runs it (`EngineConfig.code_predictor_stack`). Callers ask for it per
        # call (`predict_residuals(stack=True)`): engines sharing these weights may differ, and several replica
        # groups running passes on concurrent streams must not take it (its barrier needs all programs resident).
        self.stack: decoder_stack.StackWeights | None = None
        # With the stack, where a projection sits between the talker's width and this model's (the 1.7B): each
        # codebook's embedding table already projected [V, hidden], so a pass gathers its input row instead of
        # gathering and projecting it (one kernel instead of two or three before each of a frame's 14 launches).
        self.projected_tables: list[torch.Tensor] | None = None

    def pack_stack(self) -> None:
        """Stacks the layers' weights for `decoder_stack` (CUDA half precision, shapes it takes; idempotent).
        Call it after `pack_projections`: the stack views the packed q/k/v and gate/up copies."""
        c = self.config
        weight = self.model.layers[0].self_attn.o_proj.weight
        if (self.stack is not None or decoder_stack.triton is None or not weight.is_cuda
                or weight.dtype == torch.float32
                or not decoder_stack.supported(c.num_attention_heads, c.num_key_value_heads, c.head_dim)):
            return
        self.stack = decoder_stack.stack(self.model.layers, self.model.norm)
        self.project_tables()

    def project_tables(self) -> None:
        """The stack's inputs for codebooks 1..14 where a projection sits between the talker's width and this
        model's: each embedding table through it once ([V, hidden] each; 63 MB for the 1.7B in bf16)."""
        if not isinstance(self.small_to_mtp_projection, nn.Identity):
            with torch.no_grad():
                self.projected_tables = [self.small_to_mtp_projection(table.weight).contiguous()
                                         for table in self.model.codec_embedding]

    def prepare_lookup(self) -> None:
        """The projected tables, where the unfused passes would read them: `PROJECTED_LOOKUP` on, a projection
        between the widths and the lookup-and-norm kernel there to take them (an engine calls this at load, before
        it sizes its KV cache; `pack_stack` builds them for the stack)."""
        if PROJECTED_LOOKUP and lookup_norm.available(self.model.codec_embedding[0].weight):
            self.project_tables()

    @property
    def num_residual_groups(self) -> int:
        return self.config.num_code_groups - 1

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """embeds [B, S, talker_hidden] -> final-normed hidden states [B, S, hidden]. `rope`: the (cos, sin) of
        `positions` when the caller has them already."""
        cos, sin = rope if rope is not None else self.model.rotary(positions)
        x = self.small_to_mtp_projection(embeds)
        return run_layers(self.model.layers, x, cos, sin, cache, self.model.norm)

    def new_cache(self, batch: int, dtype: torch.dtype, device: torch.device) -> ContiguousKVCache:
        """A static per-frame cache: [talker hidden, codebook 0] plus codebooks 1..14 are fed, so
        `num_code_groups` slots suffice."""
        c = self.config
        return ContiguousKVCache(
            c.num_hidden_layers, batch, c.num_key_value_heads, c.head_dim, c.num_code_groups, dtype, device
        )

    def predict_residuals(
        self,
        past_hidden: torch.Tensor,
        first_embed: torch.Tensor,
        sample: CodeSampler,
        cache: ContiguousKVCache | None = None,
        stack: bool = False,
    ) -> torch.Tensor:
        """Codebooks 1..15 of a batch of frames.

        past_hidden [B, talker_hidden]: the talker's final hidden state that produced codebook 0;
        first_embed [B, talker_hidden]: the talker codec embedding of that codebook-0 code.
        Returns codes [B, num_code_groups - 1] (int64). A 2-token prefill gives codebook 1, then one
        single-token pass per further codebook, each row of the batch in lock-step. `stack`: passes the one-launch
        kernel takes (`pack_stack` built, one row) run as one launch each.
        """
        b = past_hidden.shape[0]
        if cache is None:
            cache = self.new_cache(b, past_hidden.dtype, past_hidden.device)
        else:
            cache.reset()
        if stack and self.stack is not None and decoder_stack.takes(past_hidden):
            return self._predict_in_stack_launches(past_hidden, first_embed, sample, cache)
        # Every row is at the same position in every pass: the rotary table of a frame's positions is computed
        # once, and each pass takes a broadcast view of its rows (the same values, elementwise).
        positions = torch.arange(self.config.num_code_groups, device=past_hidden.device)
        cos, sin = self.model.rotary(positions)
        rope = (cos[:2].expand(b, 2, -1), sin[:2].expand(b, 2, -1))
        hidden = self(torch.stack((past_hidden, first_embed), dim=1), positions[:2].expand(b, 2), cache, rope)
        cache.advance(2)
        # The head's logits in its dtype: the sampler widens them to float32 (`CodeSampler`).
        code = sample(linear(hidden[:, -1], self.lm_head[0].weight), 1)
        codes = [code]
        first_norm = self.model.layers[0].input_layernorm
        tables = self._lookup_tables()
        for g in range(1, self.num_residual_groups):
            rope = (cos[g + 1 : g + 2].expand(b, 1, -1), sin[g + 1 : g + 2].expand(b, 1, -1))
            if tables is not None:
                x, h = lookup_norm.lookup_rms_norm(tables[g - 1], code, first_norm.weight, first_norm.eps)
                hidden = run_layers(self.model.layers, x.unsqueeze(1), *rope, cache, self.model.norm,
                                    normed=h.unsqueeze(1))
            else:
                embed = self.model.codec_embedding[g - 1](code).unsqueeze(1)
                hidden = self(embed, positions[g + 1 : g + 2].expand(b, 1), cache, rope)
            cache.advance(1)
            code = sample(linear(hidden[:, -1], self.lm_head[g].weight), g + 1)
            codes.append(code)
        return torch.stack(codes, dim=1)

    def _lookup_tables(self) -> list[torch.Tensor] | None:
        """Each codebook's rows as the layers take them, where a pass's lookup and its first norm are one kernel on
        CUDA (`lookup_norm`): the embedding tables with no projection between, else the projected tables when
        asked for (`PROJECTED_LOOKUP`) and built; None: the gather, projection and norm run apart."""
        if not lookup_norm.available(self.model.codec_embedding[0].weight):
            return None
        if isinstance(self.small_to_mtp_projection, nn.Identity):
            return [table.weight for table in self.model.codec_embedding]
        return self.projected_tables if PROJECTED_LOOKUP else None

    def _predict_in_stack_launches(self, past_hidden: torch.Tensor, first_embed: torch.Tensor, sample: CodeSampler,
                                   cache: ContiguousKVCache) -> torch.Tensor:
        # `predict_residuals` with each pass through the layers, final norm and head as one launch. The two prompt
        # tokens share one launch (its weights read once for both). Where the talker's width is the code
        # predictor's (no projection between), a codebook's embedding lookup can be the launch's first load
        # (`STACK_LOOKUP`); where a projection sits between, a pass gathers from the projected tables.
        positions = torch.arange(self.config.num_code_groups, device=past_hidden.device)
        cos, sin = self.model.rotary(positions)
        same_width = isinstance(self.small_to_mtp_projection, nn.Identity)  # table rows are the layers' input

        def logits(x: torch.Tensor, pos: int, head: nn.Linear, code: torch.Tensor | None = None) -> torch.Tensor:
            tokens = 1 if code is not None else x.shape[0] // past_hidden.shape[0]
            return decoder_stack.run(self.stack, x, cache.k, cache.v, pos, cos[pos : pos + tokens],
                                     sin[pos : pos + tokens], head.weight, code=code)

        prompt = self.small_to_mtp_projection(torch.stack((past_hidden, first_embed), dim=1))
        code = sample(logits(prompt.flatten(0, 1).contiguous(), 0, self.lm_head[0]), 1)
        codes = [code]
        for g in range(1, self.num_residual_groups):
            table = self.model.codec_embedding[g - 1]
            rows = self.projected_tables[g - 1] if self.projected_tables is not None else table.weight
            if not same_width and self.projected_tables is None:  # no tables (a stack built by hand)
                scores = logits(self.small_to_mtp_projection(table(code)).contiguous(), g + 1, self.lm_head[g])
            elif STACK_LOOKUP:
                scores = logits(rows, g + 1, self.lm_head[g], code=code)
            else:  # index_select: at one row, half the device time of `rows[code]`'s indexing kernel (H100 profile)
                scores = logits(rows.index_select(0, code), g + 1, self.lm_head[g])
            code = sample(scores, g + 1)
            codes.append(code)
        cache.advance(self.config.num_code_groups)
        return torch.stack(codes, dim=1)
