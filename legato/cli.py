"""`legato` command line: `synth` (one utterance to an audio file), `serve`, `bench`, `probe`."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np


def _synth(args: argparse.Namespace) -> int:
    import torch

    from legato.api import TTS
    from legato.models.qwen3_tts.audio import AudioError
    from legato.models.qwen3_tts.config import ConfigError
    from legato.models.qwen3_tts.inputs import SpeechInput
    from legato.models.qwen3_tts.prompt import PromptError
    from legato.models.qwen3_tts.sampling import SamplingParamsError
    from legato.server.encoding import encode_file

    problem = _synth_args_problem(args)
    if problem is not None:  # before the model loads, not after the work
        print(f"legato synth: error: {problem}", file=sys.stderr)
        return 2
    try:
        dtype = None if args.dtype == "auto" else getattr(torch, args.dtype)
        tts = TTS.load(args.model, device=args.device, dtype=dtype)
        problem = _voice_args_problem(args, tts.loaded.config.tts_model_type, tts.loaded.config.tts_model_size)
        if problem is not None:
            print(f"legato synth: error: {problem}", file=sys.stderr)
            return 2
        model_type = tts.loaded.config.tts_model_type
        # On VoiceDesign the instructions are the voice: an OpenAI voice name beside them is left out, as over HTTP
        voice = None if model_type == "voice_design" else _preset_of(args.voice, tts.loaded.config.talker_config.spk_id,
                                                                      model_type)
        ref_audio, ref_sr = (None, 24000)
        if args.ref_audio:
            ref_audio, ref_sr = _reference_clip(args.ref_audio)
        inp = SpeechInput(
            text=args.text,
            language=args.language,
            speaker=voice,
            instructions=args.instructions,
            ref_audio=ref_audio,
            ref_sample_rate=ref_sr,
            ref_text=args.ref_text,
            x_vector_only=args.x_vector_only,
        )
        sampling = tts.default_sampling()
        sampling.max_new_tokens = args.max_new_tokens
        sampling.seed = args.seed
        sampling.validate()
        result = tts.generate(inp, sampling=sampling, greedy=args.greedy)
    # ValueError: what the engine refuses in a request (too long a prompt, no frames allowed) says why in words
    except (ConfigError, PromptError, AudioError, SamplingParamsError, ValueError) as e:
        print(f"legato synth: error: {e}", file=sys.stderr)
        return 2
    with open(args.out, "wb") as f:
        f.write(encode_file(result.audio, result.sample_rate, _out_format(args.out)))
    logging.getLogger("legato").info(
        "wrote %s: %d frames, %.2f s of audio at %d Hz (finish reason: %s)", args.out, result.codes.shape[0],
        result.duration, result.sample_rate, result.finish_reason,
    )
    return 0


def _preset_of(voice: str | None, speakers: dict | None, model_type: str) -> str | None:
    """`--voice` as the model's preset: an OpenAI voice name maps to the most alike preset, as the server's
    requests do (`alloy` -> serena, ...); any other name is passed on for the engine to check."""
    from legato.server.aliases import OPENAI_VOICE_ALIASES, preset_of

    if voice is None or model_type != "custom_voice":
        return voice
    preset = preset_of(voice, OPENAI_VOICE_ALIASES, speakers or {})
    if preset is not None and preset.lower() != voice.lower():
        logging.getLogger("legato").info("voice %r: OpenAI's name, spoken by the preset %r", voice, preset)
    return preset or voice


def _reference_clip(path: str) -> tuple[np.ndarray, int]:
    """--ref-audio's samples and rate, read and checked as the server checks a clip's content (readable, its rate
    and range, not silent, no NaN, long enough), in the same words. The server's size and length caps, there for
    what clients send, are not applied to a local file (the server's own flags raise them)."""
    import asyncio
    from pathlib import Path

    from legato.models.qwen3_tts.audio import AudioError
    from legato.server.media import MediaError, MediaPolicy, decode_ref_audio

    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise AudioError(f"cannot read audio file {path}: {e}") from e
    try:
        return asyncio.run(decode_ref_audio(data, MediaPolicy(max_bytes=max(len(data), 1), max_seconds=86_400.0)))
    except MediaError as e:
        raise AudioError(f"--ref-audio {path}: {e.message}") from e


def _voice_args_problem(args: argparse.Namespace, model_type: str, model_size: str = "") -> str | None:
    """What the voice options cannot mean for this kind of model, in the command's own flags (the engine's
    messages name the request fields of the HTTP API)."""
    from legato.models.qwen3_tts.prompt import takes_instructions

    if args.instructions and model_type == "custom_voice" and not takes_instructions(model_type, model_size):
        return ("the 0.6B CustomVoice model takes no instructions (--instructions): the 1.7B CustomVoice and the "
                "VoiceDesign models do")
    if model_type == "voice_design":
        from legato.server.aliases import is_openai_voice

        if not (args.instructions or "").strip():
            return "a VoiceDesign model needs --instructions describing the voice"
        if args.voice is not None and not is_openai_voice(args.voice):  # one of OpenAI's is left out, as over HTTP
            return "a VoiceDesign model has no preset voices (--voice): describe the voice in --instructions"
    if model_type != "base":
        if args.ref_audio or args.ref_text or args.x_vector_only:
            return (f"--ref-audio, --ref-text and --x-vector-only clone a voice, which a Base model does; this is a "
                    f"{model_type} model")
        return None
    if args.voice is not None:
        return ("a Base model has no preset voices (--voice): clone one with --ref-audio CLIP and --ref-text "
                "TRANSCRIPT, or --x-vector-only")
    if not args.ref_audio:
        return "a Base model clones a voice: give --ref-audio CLIP with --ref-text TRANSCRIPT (or --x-vector-only)"
    if not args.ref_text and not args.x_vector_only:
        return "--ref-audio needs --ref-text (its transcript, for an in-context clone) or --x-vector-only"
    return None


OUT_SUFFIXES = {".wav": "wav", ".mp3": "mp3", ".flac": "flac", ".opus": "opus", ".ogg": "opus", ".pcm": "pcm"}


def _out_format(path: str) -> str | None:
    """The audio format `legato synth` writes to `path`, by its suffix (None: none it writes)."""
    return OUT_SUFFIXES.get(os.path.splitext(path)[1].lower())


def _synth_args_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with `legato synth`'s arguments before anything loads: the output path, the device, the text."""
    from pathlib import Path

    from legato.server.cli import check_devices

    out = Path(args.out)
    parent = out.parent if str(out.parent) else Path(".")
    if out.is_dir():
        return f"--out {args.out} is a directory: give a file path"
    if not parent.is_dir():
        return f"--out {args.out}: the directory {parent} does not exist"
    if not os.access(parent, os.W_OK):
        return f"--out {args.out}: the directory {parent} is not writable"
    if _out_format(args.out) is None:
        return (f"--out {args.out}: the file name says no audio format; end it in "
                f"{', '.join(OUT_SUFFIXES)}")
    if args.device is not None:  # None: cuda when there is one
        try:
            check_devices([args.device], hint="use --device cpu")
        except ValueError as e:
            return str(e)
    try:
        args.text.encode("utf-8")
    except UnicodeEncodeError:
        return "--text is not valid Unicode (it holds a lone surrogate)"
    return None


def build_parser() -> argparse.ArgumentParser:
    from legato import __version__
    from legato.cli_help import DefaultsFormatter

    parser = argparse.ArgumentParser(prog="legato", description="Qwen3-TTS serving engine",
                                     formatter_class=DefaultsFormatter)
    parser.add_argument("--version", action="version", version=f"legato {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("synth", help="synthesise one utterance to an audio file (offline)",
                       description="Synthesise one utterance to an audio file (its --out suffix names the "
                                   "format: .wav, .mp3, .flac, .opus/.ogg, .pcm), offline.",
                       formatter_class=DefaultsFormatter)
    p.add_argument("--text", required=True, help="what to say")
    p.add_argument("--out", required=True,
                   help="output file; its suffix sets the format: .wav, .mp3, .flac, .opus (or .ogg), .pcm (16-bit)")
    p.add_argument("--model", default=None, help="model directory or hub id (default: embedded tiny random model)")
    p.add_argument("--voice", default=None, help="CustomVoice preset, or an OpenAI voice name (its most alike preset); "
                   "a Base model clones with --ref-audio instead (default: the embedded model's ryan)")
    p.add_argument("--language", default="auto", help="'auto' or a language of the model")
    p.add_argument("--instructions", default=None, help="VoiceDesign description / CustomVoice style (1.7B)")
    p.add_argument("--ref-audio", default=None, help="reference clip for Base voice cloning")
    p.add_argument("--ref-text", default=None, help="transcript of --ref-audio (in-context cloning)")
    p.add_argument("--x-vector-only", action="store_true", help="clone from the speaker embedding alone")
    p.add_argument("--max-new-tokens", type=int, default=2048,
                   help="most codec tokens (frames + 1); the text-derived frame cap usually ends a request first")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: a random one)")
    p.add_argument("--greedy", action="store_true", help="argmax decoding instead of sampling")
    p.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda when available)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="talker dtype (auto: bfloat16 on CUDA, float32 on CPU)")
    p.set_defaults(func=_synth)
    from legato.bench.cli import add_parser as add_bench_parser
    from legato.eval.probe import add_probe_parser
    from legato.server.cli import add_serve_parser

    add_serve_parser(sub)
    add_bench_parser(sub)
    add_probe_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    if args.command == "serve" and args.deploy:
        from legato.server.cli import typed_serve_options

        args.serve_given = typed_serve_options(sys.argv[1:] if argv is None else argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        if args.command == "serve":  # the server drains on its own signal handlers: leave its exit to them
            raise
        # Ctrl-C is how a user stops a bench run or a synthesis: one line, not a traceback. Exiting at once also
        # skips the interpreter's teardown, where an engine's native threads still running would abort the
        # process with a C++ message.
        print(f"legato {args.command}: interrupted", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130)


if __name__ == "__main__":
    sys.exit(main())
