"""`legato probe`: a topology's codes against `single` for seeded requests, and the CLI's exit status."""

from __future__ import annotations

import json

import pytest

from legato.cli import main
from legato.eval.probe import probe


@pytest.mark.parametrize(("topology", "workers", "mtp"), [
    ("replicas:2", "thread", 1), ("replicas:2", "process", 1), ("1p1d", "thread", 1), ("2p1d", "thread", 1),
    ("split", "thread", 1), ("split", "process", 1), ("single", "thread", 2), ("1p1d", "process", 2),
])
def test_probe_finds_identical_codes(tiny_checkpoint, topology, workers, mtp):
    # Batch-invariant: without it a row's floats may follow the batch it lands in, which follows arrival
    # timing on a loaded box; the guarantee under test is the invariant mode's.
    report = probe(topology, str(tiny_checkpoint), "cpu", n=8, concurrencies=[1, 8], frames=6, greedy=False,
                   workers=workers, mtp_replicas=mtp, batch_invariant=True, invariant_rows=8)
    assert report["codes_identical"] and [r["concurrency"] for r in report["runs"]] == [1, 8]
    for run in report["runs"]:
        assert all(run["identical_per_request"]) and run["finish_reasons"] == ["length"]
        assert run["ttfp_ratio"] > 0 and run["frames_per_s_topology"] > 0


def test_probe_cli(tiny_checkpoint, capsys, tmp_path):
    out_file = tmp_path / "probe.json"
    rc = main(["probe", "--topology", "1p2d", "--model", str(tiny_checkpoint), "--device", "cpu",
               "--requests", "3", "--concurrency", "3", "--frames", "5", "--greedy", "--out", str(out_file)])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["codes_identical"] and out["topology"] == "1p2d"
    assert json.loads(out_file.read_text()) == out
    assert main(["probe", "--topology", "mtp:2", "--model", str(tiny_checkpoint), "--device", "cpu"]) == 2
