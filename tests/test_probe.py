"""`voxserve probe`: a topology's codes against `single` for seeded requests, and the CLI's exit status."""

from __future__ import annotations

import json

import pytest

from voxserve.cli import main
from voxserve.eval.probe import probe


@pytest.mark.parametrize("topology", ["replicas:2", "1p1d", "2p1d"])
def test_probe_finds_identical_codes(tiny_checkpoint, topology):
    report = probe(topology, str(tiny_checkpoint), "cpu", n=4, concurrency=2, frames=6, greedy=False)
    assert report["codes_identical"] and all(report["identical_per_request"])
    assert report["finish_reasons"] == ["length"] * 4
    assert report["ttfp_ratio"] > 0


def test_probe_cli(tiny_checkpoint, capsys):
    rc = main(["probe", "--topology", "1p2d", "--model", str(tiny_checkpoint), "--device", "cpu",
               "--requests", "3", "--concurrency", "3", "--frames", "5", "--greedy"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["codes_identical"] and out["topology"] == "1p2d"
    assert main(["probe", "--topology", "split", "--model", str(tiny_checkpoint), "--device", "cpu"]) == 2
