"""deploy/*.yaml: every file is a valid topology with fitting devices and budgets; the command line wins."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from legato.pipeline.deploy import DeployError, apply_deploy, load_deploy
from legato.pipeline.topology import parse_topology
from legato.server.cli import add_serve_parser

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"


def serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    return parser


def parse(argv: list[str]) -> argparse.Namespace:
    return serve_parser().parse_args(["serve", *argv])


@pytest.mark.parametrize("path", sorted(DEPLOY.glob("*.yaml")), ids=lambda p: p.stem)
def test_every_deploy_file_is_valid(path):
    args = parse([])
    apply_deploy(args, load_deploy(path, args.serve_defaults), args.serve_defaults)
    topology = parse_topology(args.topology)
    devices = args.devices.split(",")
    assert len(devices) in (1, topology.num_workers)
    if getattr(args, "worker_memory", None):
        assert len(args.worker_memory) == topology.num_workers
        # Workers that share a device must not ask for more than all of it.
        per_device: dict[str, float] = {}
        for dev, share in zip(devices, args.worker_memory, strict=True):
            per_device[dev] = per_device.get(dev, 0.0) + share
        assert all(total <= 1.0 for total in per_device.values()), per_device


def test_expected_files_exist():
    assert {p.stem for p in DEPLOY.glob("*.yaml")} >= {"single", "replicas", "1p1d", "1p3d", "1p6d", "3p1d"}


def test_command_line_wins_and_unknown_keys_are_refused(tmp_path):
    args = parse(["--max-num-seqs", "8"])
    apply_deploy(args, load_deploy(DEPLOY / "1p1d.yaml", args.serve_defaults), args.serve_defaults)
    assert args.max_num_seqs == 8 and args.topology == "1p1d" and args.worker_memory == [0.25, 0.65]
    bad = tmp_path / "bad.yaml"
    bad.write_text("topology: single\nwarp_drive: true\n")
    with pytest.raises(DeployError, match="warp_drive"):
        load_deploy(bad, args.serve_defaults)
    bad.write_text("worker_memory: [0.5, 2]\n")
    with pytest.raises(DeployError, match="fractions"):
        load_deploy(bad, args.serve_defaults)
    bad.write_text("- not a mapping\n")
    with pytest.raises(DeployError, match="mapping"):
        load_deploy(bad, args.serve_defaults)


@pytest.mark.parametrize("name", ["replicas", "1p1d"])
def test_kuberay_manifests_carry_the_ray_deploy_files(tmp_path, name):
    """The ConfigMap of each KubeRay manifest is deploy/ray/<name>.yaml with its per-node pins set, and the
    worker groups offer exactly the custom resources those pins name."""
    import yaml

    docs = list(yaml.safe_load_all((DEPLOY / "ray" / "kuberay" / f"raycluster-{name}.yaml").read_text()))
    assert [d["kind"] for d in docs] == ["ConfigMap", "RayCluster", "Service"]
    inner = tmp_path / "deploy.yaml"
    inner.write_text(docs[0]["data"]["deploy.yaml"])
    args = parse([])
    defaults = args.serve_defaults
    options = load_deploy(inner, defaults)
    plain = load_deploy(DEPLOY / "ray" / f"{name}.yaml", defaults)
    pins = options.pop("ray_node_resource")
    plain.pop("ray_node_resource", None)
    plain.pop("ray_address", None)
    assert options == plain and options["launcher"] == "ray"
    groups = docs[1]["spec"]["workerGroupSpecs"]
    offered = {yaml.safe_load(g["rayStartParams"]["resources"]).strip('"') for g in groups}
    assert {pin.split("=")[1] for pin in pins} == {next(iter(yaml.safe_load(o))) for o in offered}
    apply_deploy(args, load_deploy(inner, defaults), defaults)
    assert parse_topology(args.topology).num_workers == len(groups)


def test_device_on_the_command_line_puts_every_worker_of_the_file_on_it():
    # `--deploy deploy/1p1d.yaml --device cpu`: the file's `devices: [cuda:0, cuda:0]` used to win, so the fix
    # the CUDA error suggested did nothing. The command line wins, as for every other option.
    args = parse(["--device", "cpu"])
    note = apply_deploy(args, load_deploy(DEPLOY / "1p1d.yaml", args.serve_defaults), args.serve_defaults)
    assert args.devices == "cpu,cpu" and args.topology == "1p1d"
    assert note == "--device cpu overrides the deploy file's devices (cuda:0,cuda:0): cpu,cpu"
    args = parse(["--device", "cpu", "--devices", "cuda:1,cuda:2"])  # explicit devices stay as given
    assert apply_deploy(args, load_deploy(DEPLOY / "1p1d.yaml", args.serve_defaults), args.serve_defaults) is None
    assert args.devices == "cuda:1,cuda:2"
    args = parse([])  # no --device: the file's devices
    assert apply_deploy(args, load_deploy(DEPLOY / "1p1d.yaml", args.serve_defaults), args.serve_defaults) is None
    assert args.devices == "cuda:0,cuda:0"


def test_a_deploy_files_bare_mps_on_or_off_is_the_mode_not_a_boolean(tmp_path):
    path = tmp_path / "mps.yaml"
    for text, want in (("mps: on\n", "on"), ("mps: off\n", "off"), ("mps: auto\n", "auto")):
        path.write_text("topology: replicas:2\n" + text)
        args = parse([])
        apply_deploy(args, load_deploy(path, args.serve_defaults), args.serve_defaults)
        assert args.mps == want
