"""`legato` command line: `synth` (one utterance to a WAV file), `serve`, `bench`, `probe`."""

from __future__ import annotations

import argparse
import logging
import sys


def _synth(args: argparse.Namespace) -> int:
    import torch

    from legato.api import TTS
    from legato.models.qwen3_tts.audio import AudioError, encode_wav, read_audio_file
    from legato.models.qwen3_tts.config import ConfigError
    from legato.models.qwen3_tts.inputs import SpeechInput
    from legato.models.qwen3_tts.prompt import PromptError
    from legato.models.qwen3_tts.sampling import SamplingParamsError

    try:
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
        tts = TTS.load(args.model, device=args.device, dtype=dtype)
        ref_audio, ref_sr = (None, 24000)
        if args.ref_audio:
            ref_audio, ref_sr = read_audio_file(args.ref_audio)
        inp = SpeechInput(
            text=args.text,
            language=args.language,
            speaker=args.voice,
            instructions=args.instructions,
            ref_audio=ref_audio,
            ref_sample_rate=ref_sr,
            ref_text=args.ref_text,
            x_vector_only=args.x_vector_only,
        )
        sampling = tts.default_sampling()
        sampling.max_new_tokens = args.max_new_tokens
        sampling.seed = args.seed
        if args.greedy:
            sampling.do_sample = sampling.subtalker_do_sample = False
        sampling.validate()
        result = tts.generate(inp, sampling=sampling)
    except (ConfigError, PromptError, AudioError, SamplingParamsError) as e:
        print(f"legato synth: error: {e}", file=sys.stderr)
        return 2
    with open(args.out, "wb") as f:
        f.write(encode_wav(result.audio, result.sample_rate))
    logging.getLogger("legato").info(
        "wrote %s: %d frames, %.2f s of audio at %d Hz", args.out, result.codes.shape[0], result.duration,
        result.sample_rate,
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="legato", description="Qwen3-TTS serving engine")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("synth", help="synthesise one utterance to a WAV file (offline)")
    p.add_argument("--text", required=True)
    p.add_argument("--out", required=True, help="output WAV path")
    p.add_argument("--model", default=None, help="model directory or hub id (default: embedded tiny random model)")
    p.add_argument("--voice", default=None, help="CustomVoice speaker name")
    p.add_argument("--language", default="auto")
    p.add_argument("--instructions", default=None, help="VoiceDesign description / CustomVoice style (1.7B)")
    p.add_argument("--ref-audio", default=None, help="reference clip for Base voice cloning")
    p.add_argument("--ref-text", default=None, help="transcript of --ref-audio (in-context cloning)")
    p.add_argument("--x-vector-only", action="store_true", help="clone from the speaker embedding alone")
    p.add_argument("--max-new-tokens", type=int, default=2048)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--greedy", action="store_true")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
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
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
