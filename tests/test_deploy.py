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
    apply_deploy(args, load_deploy(path, args.serve_defaults, args.serve_checks), args.serve_defaults)
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
        apply_deploy(args, load_deploy(path, args.serve_defaults, args.serve_checks), args.serve_defaults)
        assert args.mps == want


@pytest.mark.parametrize("text, message", [
    ("topology: [1, 2]", "topology must be a single value"),
    ("port: abc", "port must be a number"),
    ("max_connections: abc", "max_connections must be a number"),
    ("max_num_seqs: 2.5", "max_num_seqs must be a whole number"),
    ("enforce_eager: maybe", "enforce_eager must be true or false"),
    ("workers: bogus", "workers must be one of auto, thread, process"),
    ("mps: 1", "mps must be one of auto, on, off"),
    ("api_key: {a: b}", "api_key must be a list of values"),
    ("port:", "port must be a single value"),
])
def test_a_deploy_value_the_command_line_would_refuse_is_one_line_naming_it(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text + "\n")
    args = parse([])
    with pytest.raises(DeployError, match=message):
        load_deploy(path, args.serve_defaults, args.serve_checks)


def test_deploy_values_are_taken_as_the_command_line_takes_them(tmp_path):
    path = tmp_path / "ok.yaml"
    path.write_text("port: '8011'\nmax_num_seqs: 32.0\ngpu_memory_utilization: 1\napi_key: secret\n"
                    "enforce_eager: true\nhost: 127.0.0.2\n")
    args = parse([])
    apply_deploy(args, load_deploy(path, args.serve_defaults, args.serve_checks), args.serve_defaults)
    assert (args.port, args.max_num_seqs, args.gpu_memory_utilization) == (8011, 32, 1.0)
    assert args.api_key == ["secret"] and args.enforce_eager is True and args.host == "127.0.0.2"


def test_an_option_typed_with_its_default_value_still_wins_over_the_file(tmp_path):
    from legato.server.cli import typed_serve_options

    path = tmp_path / "s.yaml"
    path.write_text("max_num_seqs: 8\ntopology: replicas:2\nenforce_eager: true\n")
    argv = ["--deploy", str(path), "--max-num-seqs", "64", "--topology=single"]
    args = parse(argv)
    given = typed_serve_options(["serve", *argv])
    apply_deploy(args, load_deploy(path, args.serve_defaults, args.serve_checks), args.serve_defaults, given)
    assert (args.max_num_seqs, args.topology, args.enforce_eager) == (64, "single", True)


def test_a_deploy_file_cannot_name_another(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("deploy: other.yaml\n")
    args = parse([])
    with pytest.raises(DeployError, match="cannot name another deploy file"):
        load_deploy(path, args.serve_defaults, args.serve_checks)
