"""Prompt lists in the Seed-TTS-eval format: parsing, deterministic sampling, request bodies."""

from __future__ import annotations

import base64
import random
from pathlib import Path

import pytest
from bench_helpers import DATA, write_prompt_dir

from legato.bench.datasets import (
    DatasetError,
    FixedLength,
    RequestSpec,
    build_requests,
    load_prompts,
    parse_meta_lst,
    resolve_list,
    sample,
)

SHARED_PROMPTS = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "prompts"


def test_parse_skips_comments_blanks_and_bad_rows(tmp_path):
    lst = tmp_path / "en" / "meta.lst"
    lst.parent.mkdir()
    lst.write_text(
        "# a comment\n"
        "\n"
        "a1|Prompt one.|prompt-wavs/v1.wav|Target one.\n"
        "a2|too few fields|x.wav\n"
        "a3|Prompt three.|prompt-wavs/v3.wav|   \n"
        "a4|Prompt four.|sub/v4.wav|Target four.|gt/a4.wav\n",
        encoding="utf-8",
    )
    ds = parse_meta_lst(lst)
    assert [r.utt_id for r in ds.rows] == ["a1", "a4"]
    assert ds.rows[0].prompt_text == "Prompt one." and ds.rows[0].text == "Target one."
    assert ds.rows[1].prompt_wav == lst.parent / "sub" / "v4.wav"  # relative to the list's folder
    assert ds.locale == "en"
    assert len(ds.warnings) == 2 and "3 fields" in ds.warnings[0] and "empty target" in ds.warnings[1]


def test_resolve_list_accepts_a_file_a_locale_root_or_a_folder(tmp_path):
    root = write_prompt_dir(tmp_path / "root", n=3)
    lst = root / "en" / "meta.lst"
    assert resolve_list(lst) == lst
    assert resolve_list(root, "en") == lst
    assert resolve_list(root / "en", "zh") == lst  # the folder itself holds meta.lst
    with pytest.raises(DatasetError, match="no prompt list"):
        resolve_list(root, "zh")


def test_sampling_is_the_shuffle_then_head_recipe(tmp_path):
    root = write_prompt_dir(tmp_path, n=30)
    lines = [x for x in (root / "en" / "meta.lst").read_text().splitlines() if x.strip()]
    random.Random(7).shuffle(lines)  # the recipe, applied by hand to the raw lines
    expected = [x.split("|")[0] for x in lines[:10]]
    ds = load_prompts(root, "en", num_prompts=10, seed=7)
    assert [r.utt_id for r in ds.rows] == expected
    assert [r.utt_id for r in load_prompts(root, "en", 10, seed=7).rows] == expected  # deterministic
    assert [r.utt_id for r in load_prompts(root, "en", 10, seed=8).rows] != expected
    assert len(load_prompts(root, "en", None, seed=7).rows) == 30
    with pytest.raises(DatasetError, match="asked for 31"):
        sample(list(range(30)), 31, 0)


@pytest.mark.skipif(not (SHARED_PROMPTS / "en" / "meta.lst").is_file(),
                    reason=f"the shared prompt corpus is not at {SHARED_PROMPTS}")
def test_sampling_reproduces_the_corpus_meta_100_subset():
    for locale in ("en", "zh"):
        ds = load_prompts(SHARED_PROMPTS, locale, num_prompts=100, seed=0)
        subset = parse_meta_lst(SHARED_PROMPTS / locale / "meta_100.lst")
        assert [r.utt_id for r in ds.rows] == [r.utt_id for r in subset.rows]


def test_clone_xvec_and_voice_bodies(tmp_path):
    ds = load_prompts(write_prompt_dir(tmp_path, n=4), "en", num_prompts=4, seed=0)
    clone = build_requests(ds, RequestSpec("clone", extra_body={"temperature": 0.5}))
    body = clone[0].body
    assert body["input"] == ds.rows[0].text and body["language"] == "English"
    assert body["ref_text"] == ds.rows[0].prompt_text
    prefix = "data:audio/wav;base64,"
    assert body["ref_audio"].startswith(prefix)
    assert base64.b64decode(body["ref_audio"][len(prefix):]) == (DATA / "voice01.wav").read_bytes()
    assert body["temperature"] == 0.5 and "ignore_eos" not in body and "voice" not in body
    xvec = build_requests(ds, RequestSpec("xvec", language="Auto")).pop().body
    assert xvec["x_vector_only_mode"] is True and "ref_text" not in xvec and xvec["language"] == "Auto"
    voice = build_requests(ds, RequestSpec("voice", voice="ryan", seed=100, max_new_tokens=64))
    assert [r.body["seed"] for r in voice] == [100, 101, 102, 103]
    assert voice[1].body["voice"] == "ryan" and voice[1].body["max_new_tokens"] == 64
    assert "ref_audio" not in voice[1].body
    assert [r.utt_id for r in voice] == [r.utt_id for r in ds.rows]


def test_missing_reference_clip_is_an_error_only_when_sent(tmp_path):
    root = write_prompt_dir(tmp_path, n=2)
    (root / "en" / "prompt-wavs" / "voice01.wav").unlink()
    ds = load_prompts(root, "en", 2, 0)
    with pytest.raises(DatasetError, match="missing"):
        build_requests(ds, RequestSpec("clone"))
    assert len(build_requests(ds, RequestSpec("voice", voice="serena"))) == 2
    with pytest.raises(DatasetError, match="--voice"):
        RequestSpec("voice")


def test_fixed_length_frames_from_text_length(tmp_path):
    fixed = FixedLength(frames_per_char=0.25, min_frames=4, max_frames=12)
    assert fixed.frames("x" * 10) == 4  # round(2.5) = 2 → clamped up to 4
    assert fixed.frames("x" * 30) == 8  # round(7.5) = 8
    assert fixed.frames("x" * 100) == 12  # clamped down
    assert "clamp(round(len(text) * 0.25), 4, 12)" in fixed.describe()
    ds = load_prompts(write_prompt_dir(tmp_path, n=5), "en", 5, 0)
    reqs = build_requests(ds, RequestSpec("voice", voice="ryan", fixed_length=fixed))
    for r, p in zip(reqs, ds.rows, strict=True):
        assert r.body["ignore_eos"] is True and r.body["num_frames"] == r.num_frames == fixed.frames(p.text)
        assert r.text_chars == len(p.text)
    with pytest.raises(DatasetError):
        FixedLength(0.5, min_frames=10, max_frames=4)


def test_the_default_set_ships_with_the_package():
    """48 prompts and the 8 reference clips they clone, in the package (a fresh clone needs no data folder)."""
    from legato.bench.datasets import DEFAULT_DATASET

    ds = load_prompts(DEFAULT_DATASET)
    assert len(ds.rows) == 48 and ds.locale == "en"
    clips = {r.prompt_wav for r in ds.rows}
    assert len(clips) == 8 and all(c.is_file() and c.stat().st_size > 100_000 for c in clips)
    assert all(r.text and r.prompt_text for r in ds.rows)
    assert len(build_requests(ds, RequestSpec("clone"))) == 48


def test_the_bench_mode_follows_the_model(tmp_path, monkeypatch):
    """`bench sweep` with no --mode: the embedded default (CustomVoice) gets preset-voice requests, a Base
    model clone requests; `bench serve` asks the running server (`/v1/models`)."""
    import argparse

    from legato.bench.served import mode_of_model
    from legato.models.qwen3_tts.testing import write_checkpoint
    from legato.models.qwen3_tts.tiny import tiny_config

    monkeypatch.setenv("LEGATO_CACHE", str(tmp_path / "cache"))
    assert mode_of_model(argparse.Namespace(server_args="--max-num-seqs 4")) == ("voice", "ryan")
    base = write_checkpoint(tmp_path / "base", tiny_config("base"))
    assert mode_of_model(argparse.Namespace(server_args=f"--model {base}")) == ("clone", None)
    assert mode_of_model(argparse.Namespace(server_args=str(base))) == ("clone", None)  # positional model
    design = write_checkpoint(tmp_path / "design", tiny_config("voice_design"))
    assert mode_of_model(argparse.Namespace(server_args=str(design))) == ("design", None)
    with pytest.raises(ValueError, match="no server answers at"):
        mode_of_model(argparse.Namespace(base_url="http://127.0.0.1:9"))


def test_fixed_length_with_max_new_tokens_is_refused_before_any_request():
    """Each fixed-length request's num_frames is its length; a --max-new-tokens beside it once went along
    ignored, and the server now refuses two lengths (400 conflicting_length) for every request."""
    import argparse

    from legato.bench.cli import _prepare

    args = argparse.Namespace(fixed_length=True, frames_per_char=0.8, min_frames=4, max_frames=250,
                              max_new_tokens=64, extra_body=None)
    with pytest.raises(ValueError, match="--max-new-tokens and --fixed-length"):
        _prepare(args)
