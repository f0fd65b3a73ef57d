"""Deploy files (`deploy/*.yaml`): a topology with its devices, memory budgets and limits, in one place.

A deploy file holds `legato serve` options by their long names (dashes or underscores), plus
`worker_memory`: one `gpu_memory_utilization` share per worker (prefill engines first, then decode). Options
given on the command line win over the file, and `--device` wins over the file's `devices:` (every worker on
that device: `--deploy deploy/1p1d.yaml --device cpu` runs the CUDA file's topology on the CPU, as the error
for a CUDA file on a CPU machine suggests).

    topology: 1p1d
    devices: [cuda:0, cuda:0]
    worker_memory: [0.25, 0.6]
    max_num_seqs: 64
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

DEPLOY_ONLY_KEYS = {"worker_memory"}


class DeployError(ValueError):
    """A deploy file that cannot be read or names an unknown option."""


def load_deploy(path: str | Path, known: dict[str, Any], checks: dict[str, tuple[Any, Any]] | None = None
                ) -> dict[str, Any]:
    """The options of a deploy file, checked against `known` (option name -> default value) and, where `checks`
    names an option (name -> the command line's (type, choices)), given the type and choices the command line
    would (one line naming the file and the option, rather than a traceback later at start-up)."""
    import yaml

    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as e:
        raise DeployError(f"cannot read deploy file {path}: {e}") from e
    if not isinstance(data, dict):
        raise DeployError(f"{path}: a deploy file is a mapping of serve options")
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in known and name not in DEPLOY_ONLY_KEYS:
            raise DeployError(f"{path}: unknown option {key!r}")
        if name == "deploy":
            raise DeployError(f"{path}: a deploy file cannot name another deploy file")
        if name == "devices" and isinstance(value, list):
            value = ",".join(str(v) for v in value)
        if checks is not None and name in checks:
            value = _as_option(path, key, value, known[name], *checks[name])
        if name == "worker_memory":
            if not isinstance(value, list) or not all(isinstance(v, (int, float)) and 0 < v <= 1 for v in value):
                raise DeployError(f"{path}: worker_memory must be a list of fractions in (0, 1]")
            value = [float(v) for v in value]
        out[name] = value
    return out


def _as_option(path: Path, key: str, value: Any, default: Any, kind: Any, choices: Any) -> Any:
    """`value` as the command line would have taken it for option `key` (its default, type and choices)."""
    def refuse(what: str) -> DeployError:
        return DeployError(f"{path}: {key} must be {what}, got {value!r}")

    if isinstance(default, list):  # an option given several times on the command line: a list here
        items = value if isinstance(value, list) else [value]
        if not all(isinstance(v, (str, int, float)) and not isinstance(v, bool) for v in items):
            raise refuse("a list of values")
        return [str(v) for v in items]
    if isinstance(default, bool):  # a flag
        if not isinstance(value, bool):
            raise refuse("true or false")
        return value
    if isinstance(value, bool) and choices is not None and {"on", "off"} <= set(choices):
        value = "on" if value else "off"  # YAML reads a bare on/off as a boolean
    if value is None and default is None:  # null: the option's default, which is none
        return None
    if value is None or isinstance(value, (bool, list, dict)):
        raise refuse("a single value")
    if kind is int and (isinstance(value, float) and not value.is_integer()):
        raise refuse("a whole number")
    if kind is not None:
        try:
            value = kind(int(value) if kind is int and isinstance(value, float) else value)
        except (TypeError, ValueError):
            raise refuse("a number" if kind in (int, float) else "a valid value") from None
    elif not isinstance(value, str):
        value = str(value)
    if choices is not None and value not in choices:
        raise refuse(f"one of {', '.join(map(str, choices))}")
    return value


def apply_deploy(args: Any, options: dict[str, Any], defaults: dict[str, Any],
                 given: list[str] | None = None) -> str | None:
    """Sets every option of the file that the command line did not give: `given` names the options typed there
    (None: those whose value differs from its default). `--device` given on the command line (without
    `--devices`) puts every worker of the file's `devices:` on that device; the returned line says so (None when
    nothing was overridden that way)."""
    def typed(name: str) -> bool:
        return name in given if given is not None else getattr(args, name, None) != defaults.get(name)

    device_given, devices_given = typed("device"), typed("devices")
    for name, value in options.items():
        if name in DEPLOY_ONLY_KEYS or not typed(name):
            setattr(args, name, value)
    if not (device_given and not devices_given and options.get("devices")):
        return None
    listed = str(options["devices"]).split(",")
    args.devices = ",".join([args.device] * len(listed))
    return f"--device {args.device} overrides the deploy file's devices ({options['devices']}): {args.devices}"
