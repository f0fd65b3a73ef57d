"""What `legato bench` learns of the server it runs against: the model its requests must fit (mode, preset
voice), and how many requests the server decodes at once (`bench serve`'s default concurrency)."""

from __future__ import annotations

import argparse
import os
import shlex
import sys

_MODE_OF_TYPE = {"base": "clone", "custom_voice": "voice", "voice_design": "design"}
_TYPE_OF_TASK = {"Base": "base", "CustomVoice": "custom_voice", "VoiceDesign": "voice_design"}


def served_model(server_args: str) -> str | None:
    """The model `legato serve SERVER_ARGS` loads (None: the embedded default)."""
    from legato.cli import build_parser

    try:
        served = build_parser().parse_args(["serve", *shlex.split(server_args)])
    except SystemExit as e:
        raise ValueError(f"--server-args {server_args!r} are not `legato serve` arguments") from e
    return served.model or served.model_arg


def mode_of_model(args: argparse.Namespace) -> tuple[str, str | None]:
    """(mode, preset voice) that fit the model the bench runs against: a running server's `/v1/models` for
    `bench serve`; for `bench sweep` the config files of the model its servers will load."""
    if hasattr(args, "base_url"):
        card = server_card(args)
        if isinstance(card, Exception):
            raise ValueError(unreachable(card, args.base_url, api_key(args))
                             or f"cannot read the server's model from {args.base_url}/v1/models ({card}); give --mode")
        model_type, voices = _TYPE_OF_TASK.get(card.get("task_type"), "base"), card.get("voices") or []
    else:
        from legato.models.qwen3_tts.default import default_model_dir
        from legato.pipeline.process_client import model_info

        info = model_info(served_model(args.server_args) or default_model_dir(), "bench")
        model_type, voices = info.model_type, info.speakers
    mode = _MODE_OF_TYPE.get(model_type, "clone")
    voice = None
    if mode == "voice":
        if not voices:
            raise ValueError("the server's CustomVoice model lists no voices; give --voice")
        voice = "ryan" if "ryan" in [v.lower() for v in voices] else voices[0]
    print(f"legato bench: the model is a {model_type} model: mode {mode}" + (f", voice {voice}" if voice else ""),
          file=sys.stderr)
    return mode, voice


def server_card(args: argparse.Namespace) -> dict | Exception:
    """The running server's `/v1/models` card (read once per command), or why it could not be read."""
    if not hasattr(args, "server_card"):
        import httpx

        headers = {"Authorization": f"Bearer {key}"} if (key := api_key(args)) else None
        try:
            args.server_card = httpx.get(f"{args.base_url}/v1/models", timeout=10.0, headers=headers) \
                .raise_for_status().json()["data"][0]
        except (httpx.HTTPError, KeyError, IndexError, ValueError, TypeError) as e:
            args.server_card = e
    return args.server_card


def unreachable(error: Exception, base_url: str, key: str | None) -> str | None:
    """Why no request of the bench could succeed, from the error of reading `/v1/models` (None: some other
    failure, e.g. a server without that route, which the bench can still drive given --mode)."""
    import httpx

    if isinstance(error, httpx.HTTPStatusError):
        return access_problem(error.response.status_code, base_url, key)
    if isinstance(error, (httpx.ConnectError, httpx.ConnectTimeout)):
        return f"no server answers at {base_url} ({error}): start one (`legato serve`) or give --base-url"
    return None


def access_problem(status: int, base_url: str, key: str | None) -> str | None:
    """What a 401 (legato's answer to a missing or wrong key) or 403 means for the bench (None for any other
    status)."""
    if status == 403:
        return f"the server at {base_url} refuses this client (HTTP 403: its Host or Origin checks)"
    if status != 401:
        return None
    if key:
        return f"the server at {base_url} refused the API key given (HTTP 401)"
    return f"the server at {base_url} wants an API key (HTTP 401): give --api-key KEY or set $LEGATO_API_KEY"


def api_key(args: argparse.Namespace) -> str | None:
    return getattr(args, "api_key", None) or os.environ.get("LEGATO_API_KEY")


def concurrency_of_server(args: argparse.Namespace) -> int | None:
    """The default --max-concurrency: the requests the server decodes at once (legato's /v1/models says). More
    would only queue in the server, where a request's wait counts against its latency and its timeout."""
    card = server_card(args)
    slots = card.get("decode_slots") if isinstance(card, dict) else None
    if isinstance(slots, int) and not isinstance(slots, bool) and slots >= 1:
        print(f"legato bench: --max-concurrency {slots}: the requests the server decodes at once (/v1/models "
              "decode_slots)", file=sys.stderr)
        return slots
    print("legato bench: the server does not say how many requests it decodes at once: no concurrency cap "
          "(give --max-concurrency)", file=sys.stderr)
    return None
