"""The code predictor ("MTP" / sub-talker): a small Qwen3 decoder that turns the talker's hidden state
and codebook 0 of a frame into codebooks 1..15, one per pass, with positions restarting at 0 each frame.

State-dict keys (under `talker.code_predictor.`) equal the official ones: `model.layers.N.*`,
`model.norm`, `model.codec_embedding.{0..14}`, `lm_head.{0..14}`, `small_to_mtp_projection`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from legato.layers.norm import RMSNorm
from legato.layers.rotary import RotaryEmbedding

from .config import CodePredictorConfig
from .decoder_layer import ContiguousKVCache, KVCache, build_layers, run_layers

# (logits [B, V] fp32, codebook index g in 1..15) -> codes [B]; batched, so an engine can plug a
# counter-based sampler without a per-request loop.
CodeSampler = Callable[[torch.Tensor, int], torch.Tensor]


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

    @property
    def num_residual_groups(self) -> int:
        return self.config.num_code_groups - 1

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """embeds [B, S, talker_hidden] -> final-normed hidden states [B, S, hidden]."""
        cos, sin = self.model.rotary(positions)
        x = self.small_to_mtp_projection(embeds)
        return self.model.norm(run_layers(self.model.layers, x, cos, sin, cache))

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
    ) -> torch.Tensor:
        """Codebooks 1..15 of a batch of frames.

        past_hidden [B, talker_hidden]: the talker's final hidden state that produced codebook 0;
        first_embed [B, talker_hidden]: the talker codec embedding of that codebook-0 code.
        Returns codes [B, num_code_groups - 1] (int64). A 2-token prefill gives codebook 1, then one
        single-token pass per further codebook, each row of the batch in lock-step.
        """
        b = past_hidden.shape[0]
        if cache is None:
            cache = self.new_cache(b, past_hidden.dtype, past_hidden.device)
        else:
            cache.reset()
        positions = torch.arange(2, device=past_hidden.device).expand(b, 2)
        hidden = self(torch.stack((past_hidden, first_embed), dim=1), positions, cache)
        cache.advance(2)
        code = sample(self.lm_head[0](hidden[:, -1]).float(), 1)
        codes = [code]
        for g in range(1, self.num_residual_groups):
            embed = self.model.codec_embedding[g - 1](code).unsqueeze(1)
            positions = torch.full((b, 1), g + 1, device=past_hidden.device, dtype=torch.long)
            hidden = self(embed, positions, cache)
            cache.advance(1)
            code = sample(self.lm_head[g](hidden[:, -1]).float(), g + 1)
            codes.append(code)
        return torch.stack(codes, dim=1)
