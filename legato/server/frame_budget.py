"""How many frames a request may run, and which limit decided it.

A request that does not ask for an exact length runs until EOS or the first of its caps:
- the length it asked for (`max_new_tokens`, or `num_frames` without `ignore_eos`), held to
  `--max-new-tokens-limit` by the speech service; or, when it asked for none, `--default-max-new-tokens` if
  the operator set one;
- its text's frame cap (`--frames-per-text-token` x its text tokens + `--frame-cap-margin`), the engine's rule;
- the positions its prompt leaves under `--max-model-len`.
The server works this out before the engine sees the request, with the engine's own formulas and the prompt
count of `PromptLimit`, passes the smallest on as the request's frame limit, and names it when the request
ends `length` (the log line, `X-Length-Cap` on a file, the SSE done event). There is no fixed default below
the text's cap: a default of 2048 tokens cut a 4,096-character input at 2,047 frames while its text allowed
more, and said nothing about why.
"""

from __future__ import annotations

from dataclasses import dataclass

from legato.engine.config import EngineConfig
from legato.server.errors import ApiError

# Each cap's name (X-Length-Cap, the log's `length_cap`) -> what it is, for messages.
CAPS = {
    "num_frames": "the request's num_frames",
    "max_new_tokens": "the request's max_new_tokens",
    "default_max_new_tokens": "--default-max-new-tokens",
    "frame_cap": "the text's frame cap (--frames-per-text-token, --frame-cap-margin)",
    "max_model_len": "the positions the prompt leaves under --max-model-len",
}


@dataclass(frozen=True, slots=True)
class FrameBudget:
    """The most frames a request runs, and the cap (a key of CAPS) that set it; `exact`: it runs exactly
    that many (`ignore_eos` with `num_frames`), so ending `length` is what it asked for."""

    frames: int
    cap: str
    exact: bool = False

    def describe(self) -> str:
        return f"{self.frames} frames, {CAPS[self.cap]}"


@dataclass(frozen=True, slots=True)
class LengthAsk:
    """What a request said about its length: `frames` under the name of the field that said it (None: it
    said nothing), or the server's default when it said nothing."""

    frames: int | None = None
    field: str = "max_new_tokens"
    exact: bool = False
    default_frames: int | None = None


def frame_budget(engine: EngineConfig, prompt_tokens: int, text_tokens: int, ask: LengthAsk) -> FrameBudget:
    """The request's frame limit under `engine`'s caps. An exact length is the caller's to choose (the
    engine refuses one that does not fit its positions); otherwise the smallest cap wins, the request's own
    on a tie. ApiError (400) when the prompt leaves no position for a frame."""
    if ask.exact and ask.frames is not None:
        return FrameBudget(ask.frames, ask.field, exact=True)
    candidates: list[tuple[int, str]] = []
    if ask.frames is not None:
        candidates.append((ask.frames, ask.field))
    elif ask.default_frames is not None:
        candidates.append((ask.default_frames, "default_max_new_tokens"))
    text_cap = engine.frame_cap_for(text_tokens)
    if text_cap is not None:
        candidates.append((text_cap, "frame_cap"))
    room = engine.max_model_len - prompt_tokens
    candidates.append((room, "max_model_len"))
    frames, cap = min(candidates, key=lambda c: c[0])  # min keeps the first of equals
    if frames < 1:
        raise ApiError(400, f"prompt is {prompt_tokens} tokens, which leaves no frame under --max-model-len "
                            f"{engine.max_model_len}", "prompt_too_long", "input")
    return FrameBudget(frames, cap)
