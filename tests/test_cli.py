"""The `legato` command line: `synth` on the embedded default, `--version`, help that names every flag's
default, the model as a positional argument, and devices this machine lacks refused before anything loads."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch

from legato.cli import build_parser, main

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"


def test_synth_writes_a_wav_on_the_embedded_default(tmp_path):
    out = tmp_path / "out.wav"
    env_cache = tmp_path / "cache"
    proc = subprocess.run(
        [sys.executable, "-m", "legato.cli", "synth", "--text", "Hello there.", "--out", str(out),
         "--max-new-tokens", "12", "--seed", "3"],
        capture_output=True, text=True, timeout=300,
        env={**__import__("os").environ, "LEGATO_CACHE": str(env_cache)},
    )
    assert proc.returncode == 0, proc.stderr
    assert "RANDOM weights" in proc.stderr
    audio, sr = sf.read(out)
    assert sr == 24000
    assert 0 < len(audio) <= 11 * 1920 and len(audio) % 1920 == 0
    assert abs(audio).max() <= 1.0


def test_synth_rejects_bad_input_with_a_message(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "legato.cli", "synth", "--text", "Hi", "--out", str(tmp_path / "x.wav"),
         "--voice", "nobody", "--max-new-tokens", "4"],
        capture_output=True, text=True, timeout=300,
        env={**__import__("os").environ, "LEGATO_CACHE": str(tmp_path / "cache")},
    )
    assert proc.returncode == 2
    assert "unknown speaker" in proc.stderr
    assert not (tmp_path / "x.wav").exists()


def test_synth_speaks_an_openai_voice_name_in_the_most_alike_preset(tmp_path):
    """As the server does: `--voice alloy` on a CustomVoice model is its stand-in preset, not an unknown speaker."""
    out = tmp_path / "alloy.wav"
    assert main(["synth", "--text", "Hi.", "--voice", "alloy", "--out", str(out), "--max-new-tokens", "4",
                 "--seed", "1"]) == 0
    assert out.stat().st_size > 44


def test_synth_refuses_in_one_line_what_an_outside_probe_saw_as_tracebacks(tmp_path, capsys, tiny_checkpoint):
    """A bad --out (found only after the work), a device torch does not know or this machine lacks, a lone
    surrogate, a request the engine refuses, bytes that are not audio (whose error named a BytesIO repr)."""
    junk = tmp_path / "junk.wav"
    junk.write_bytes(os.urandom(2000))
    from legato.models.qwen3_tts.testing import write_checkpoint
    from legato.models.qwen3_tts.tiny import tiny_config

    design = write_checkpoint(tmp_path / "design", tiny_config("voice_design"))
    silent, nan = tmp_path / "silent.wav", tmp_path / "nan.wav"
    sf.write(silent, np.zeros(24000, np.float32), 24000)
    clip = (0.1 * np.sin(np.arange(24000) / 10)).astype(np.float32)
    clip[100] = np.nan
    sf.write(nan, clip, 24000, subtype="FLOAT")
    long_clip = tmp_path / "long.wav"  # 70 s: past the server's default 60 s cap
    sf.write(long_clip, (0.1 * np.sin(np.arange(70 * 8000) / 7)).astype(np.float32), 8000)
    out = str(tmp_path / "x.wav")
    cases = [
        (["--out", str(tmp_path / "missing" / "x.wav")], "does not exist"),
        (["--out", str(tmp_path)], "is a directory"),
        (["--out", out, "--device", "tpu"], "not a device torch knows"),
        (["--out", out, "--max-new-tokens", "1"], "allows no frames"),
        (["--out", out, "--model", str(tiny_checkpoint), "--ref-audio", str(junk), "--ref-text", "Hi."],
         "cannot be decoded: it is not a readable audio file"),
        # the voice flags in the command's own words (a newcomer's walkthrough: --voice on a Base model was
        # ignored, and the errors named the HTTP API's fields)
        (["--out", out, "--model", str(tiny_checkpoint), "--voice", "v1"], "has no preset voices (--voice)"),
        (["--out", out, "--model", str(tiny_checkpoint)], "give --ref-audio CLIP with --ref-text"),
        (["--out", out, "--model", str(tiny_checkpoint), "--ref-audio", str(junk)], "needs --ref-text"),
        (["--out", out, "--x-vector-only"], "which a Base model does; this is a custom_voice model"),
        # what the server refuses, synth refuses (an outside probe: --instructions was dropped without a word on
        # the 0.6B CustomVoice model, and clips the server refuses were used)
        (["--out", out, "--instructions", "Speak very angrily."], "the 0.6B CustomVoice model takes no instructions"),
        (["--out", out, "--model", str(design)], "a VoiceDesign model needs --instructions"),
        (["--out", out, "--model", str(design), "--instructions", "Calm.", "--voice", "ryan"],
         "a VoiceDesign model has no preset voices (--voice)"),
        # an OpenAI voice name is left out, as over HTTP: the request goes on (to the engine's own refusal here)
        (["--out", out, "--model", str(design), "--instructions", "Calm.", "--voice", "alloy", "--max-new-tokens",
          "1"], "allows no frames"),
        (["--out", out, "--model", str(tiny_checkpoint), "--ref-audio", str(silent), "--x-vector-only"],
         "is silent"),
        (["--out", out, "--model", str(tiny_checkpoint), "--ref-audio", str(nan), "--x-vector-only"],
         "NaN or infinite samples"),
        # ...but not the server's size and length caps, which are there for what clients send
        (["--out", out, "--model", str(tiny_checkpoint), "--ref-audio", str(long_clip), "--x-vector-only",
          "--max-new-tokens", "1"], "allows no frames"),
    ]
    if not torch.cuda.is_available():
        cases.append((["--out", out, "--device", "cuda"], "no CUDA device (use --device cpu)"))
    env = {"LEGATO_CACHE": str(tmp_path / "cache")}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        for flags, needle in cases:
            assert main(["synth", "--text", "Hello there.", *flags]) == 2, flags
            err = capsys.readouterr().err.strip().splitlines()
            assert needle in err[-1] and err[-1].startswith("legato synth: error: "), (flags, err)
            assert "object at 0x" not in err[-1]
        assert main(["synth", "--text", "\ud800", "--out", out]) == 2
        assert "not valid Unicode" in capsys.readouterr().err
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    assert not Path(out).exists()


def test_synth_of_the_readme_example_on_the_default_ends_by_itself(tmp_path):
    """`legato synth --text "Hello there." --out out.wav`, verbatim: the embedded default stops on its own
    (finish reason `stop`) after a few seconds of audio, far below max_new_tokens and the frame cap."""
    out = tmp_path / "out.wav"
    proc = subprocess.run(
        [sys.executable, "-m", "legato.cli", "synth", "--text", "Hello there.", "--out", str(out)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "LEGATO_CACHE": str(tmp_path / "cache")},
    )
    assert proc.returncode == 0, proc.stderr
    m = re.search(r"wrote .*: (\d+) frames, .* \(finish reason: (\w+)\)", proc.stderr)
    assert m, proc.stderr
    frames, reason = int(m.group(1)), m.group(2)
    assert reason == "stop" and 10 <= frames <= 50
    audio, sr = sf.read(out)
    assert sr == 24000 and len(audio) == frames * 1920


def test_version(capsys):
    from legato import __version__

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"legato {__version__}"


def _parsers(parser: argparse.ArgumentParser, name: str = "legato"):
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _parsers(sub, f"{name} {sub_name}")


def test_every_flag_has_help_that_shows_its_default():
    parsers = dict(_parsers(build_parser()))
    assert {"legato serve", "legato synth", "legato probe", "legato bench serve", "legato bench sweep"} <= set(parsers)
    for name, parser in parsers.items():
        formatter = parser._get_formatter()
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)):
                continue
            assert action.help, f"{name} {action.option_strings or action.dest}: no help"
            if action.option_strings and not action.required:
                shown = formatter._expand_help(action)  # the line `--help` prints for this flag
                assert "default" in shown.lower(), f"{name} {action.option_strings[-1]}: default not shown"
        parser.format_help()  # and the whole page renders


def test_serve_takes_the_model_as_a_positional_argument(capsys):
    args = build_parser().parse_args(["serve", "/models/Qwen3-TTS-12Hz-0.6B-Base", "--port", "9"])
    assert args.model_arg == "/models/Qwen3-TTS-12Hz-0.6B-Base" and args.model is None
    assert main(["serve", "/a", "--model", "/b"]) == 2
    assert "the model is given twice" in capsys.readouterr().err


def test_devices_this_machine_lacks_are_refused_in_one_line(monkeypatch):
    from legato.server.cli import check_devices

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    check_devices(["cpu"])
    with pytest.raises(ValueError, match="device 'cuda:0' is a CUDA device, and this machine has no CUDA device"):
        check_devices(["cpu", "cuda:0"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    check_devices(["cuda", "cuda:0"])
    with pytest.raises(ValueError, match="device 'cuda:3' does not exist: this machine has 1 CUDA device"):
        check_devices(["cuda:3"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_a_cuda_deploy_file_fails_on_a_cpu_machine_before_anything_starts(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "legato.cli", "serve", "--deploy", str(DEPLOY / "1p1d.yaml"), "--port", "9"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "LEGATO_CACHE": str(tmp_path / "cache")},
    )
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert errors == ["legato serve: error: device 'cuda:0' is a CUDA device, and this machine has no CUDA device "
                      "(use --device cpu, which also puts every worker of a deploy file on the CPU)"]
    assert "listening" not in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "cache").exists()  # nothing was loaded or written


def test_workers_auto_runs_cuda_engines_in_processes_and_cpu_engines_on_threads():
    from legato.server.cli import resolve_workers

    args = build_parser().parse_args(["serve"])
    assert args.workers == "auto"
    assert resolve_workers("auto", ["cpu"]) == "thread"
    assert resolve_workers("auto", ["cuda:0"]) == resolve_workers("auto", ["cpu", "cuda:1"]) == "process"
    assert resolve_workers("thread", ["cuda:0"]) == "thread" and resolve_workers("process", ["cpu"]) == "process"


def test_synth_writes_the_format_its_out_suffix_names_and_refuses_one_it_does_not_write(tmp_path, capsys,
                                                                                       monkeypatch):
    from legato.cli import main

    monkeypatch.setenv("LEGATO_CACHE", str(tmp_path / "cache"))
    args = ["synth", "--text", "Hello there.", "--max-new-tokens", "6", "--seed", "3"]
    assert main([*args, "--out", str(tmp_path / "x.aac")]) == 2
    assert "end it in .wav, .mp3, .flac" in capsys.readouterr().err
    assert main([*args, "--out", str(tmp_path / "x.flac")]) == 0
    assert sf.info(str(tmp_path / "x.flac")).format == "FLAC"
