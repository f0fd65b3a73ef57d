"""Results on disk and on screen: the per-run JSON and check WAV, text tables, the sweep's SUMMARY.md,
summary.json and PNG plots, and the side-by-side comparison of two runs."""

from __future__ import annotations

import json
import math
from pathlib import Path

from legato.models.qwen3_tts.audio import wav_header

from . import MissingExtraError
from .client import RunOutput
from .metrics import SloSpec, aggregate, flatten

PLOT_EXTRA_HINT = "plots need matplotlib: pip install 'legato[bench]'"


def sanitize(obj):
    """JSON-safe copy: NaN → null, ±inf → "inf"/"-inf" (strict JSON has neither)."""
    if isinstance(obj, float):
        if math.isnan(obj):
            return None
        if math.isinf(obj):
            return "inf" if obj > 0 else "-inf"
        return obj
    if isinstance(obj, dict):
        return {k: sanitize(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [sanitize(v) for v in obj]
    return obj


def run_stem(label: str, topology: str, concurrency: int | None) -> str:
    """`<label>-<topology>-c<conc>`, the name of everything one run writes (`replicas:2` → `replicas2`)."""
    topo = topology.replace(":", "").replace("/", "_")
    return f"{label}-{topo}-c{concurrency if concurrency else 'inf'}"


def build_result(config: dict, out: RunOutput, slo: SloSpec, num_gpus: int | None) -> dict:
    return {
        "config": config,
        "started_at": out.started_at,
        "aggregates": aggregate(out.records, out.duration_s, slo, num_gpus),
        "check_audio_utt_id": out.check_utt_id,
        "requests": [r.to_json() for r in out.records],
        "warmups": [r.to_json() for r in out.warmups],
        "warnings": out.warnings,
    }


def save_run(result: dict, out: RunOutput, result_dir: Path, stem: str, sample_rate: int) -> dict[str, Path]:
    """Write `<stem>.json` and, when a request completed, `<stem>-check.wav`."""
    result_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": result_dir / f"{stem}.json"}
    if out.check_pcm:
        pcm = out.check_pcm[: len(out.check_pcm) // 2 * 2]
        paths["wav"] = result_dir / f"{stem}-check.wav"
        paths["wav"].write_bytes(wav_header(sample_rate, len(pcm)) + pcm)
        result["check_wav"] = paths["wav"].name
    paths["json"].write_text(json.dumps(sanitize(result), indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return paths


def load_result(path: str | Path) -> dict:
    """A run's result JSON (`bench serve`'s `<stem>.json`); ValueError naming the file when it is not one."""
    try:
        result = json.loads(Path(path).read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a bench result (not JSON: {e})") from None
    if not isinstance(result, dict) or not {"config", "aggregates", "requests"} <= result.keys():
        raise ValueError(f"{path}: not a bench result (a run's JSON has config, aggregates and requests; a sweep's "
                         "cells are its run files)")
    return result


def _slo_text(slo: dict) -> str:
    """The SLOs a run was judged by, as `key<=limit` items ("no SLO" when none was given)."""
    items = {**slo.get("per_request", {}), **slo.get("run", {})}
    if not items:
        return "no SLO given (every completed request is good)"
    return "SLO " + ", ".join(f"{k}<={v:g}" for k, v in items.items())


def _num(value, fmt: str = ".1f") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, str):
        return value
    return format(value, fmt)


def run_table(result: dict) -> str:
    """A short human-readable report of one run."""
    a = result["aggregates"]
    g = a["goodput"]
    lines = [
        f"requests: {a['completed']}/{a['num_requests']} completed, {a['failed']} failed {a['failures'] or ''}",
        f"duration: {_num(a['duration_s'], '.2f')} s   request throughput: {_num(a['request_throughput'], '.3f')}"
        f" req/s   audio throughput: {_num(a['audio_throughput'], '.3f')} audio s/s",
        f"{'metric':<16}{'mean':>10}{'median':>10}{'p90':>10}{'p99':>10}",
    ]
    for key, fmt in (("ttfp_ms", ".1f"), ("e2el_ms", ".1f"), ("rtf", ".3f"), ("audio_s", ".2f"),
                     ("underrun_s", ".3f"), ("underrun_events", ".2f")):
        d = a[key]
        lines.append(f"{key:<16}" + "".join(f"{_num(d[s], fmt):>10}" for s in ("mean", "median", "p90", "p99")))
    lines.append(f"continuity rate: {_num(a['continuity_rate'], '.3f')} (requests whose audio never ran dry)")
    run_checks = ", ".join(f"{c['key']}={_num(c['measured'], '.3g')} (limit {c['limit']:g})"
                           for c in g["run_checks"])
    lines.append(f"goodput: {_num(g['request_goodput'], '.3f')} req/s, {_num(g['audio_goodput'], '.3f')} audio s/s;"
                 f" good {g['good_requests']}/{a['num_requests']}; " + _slo_text(g['slo'])
                 + (f"; run SLOs {'met' if g['run_slo_met'] else 'MISSED'}: {run_checks}" if run_checks else ""))
    if "request_goodput_per_gpu" in g:
        lines.append(f"per GPU ({a['num_gpus']}): goodput {_num(g['request_goodput_per_gpu'], '.3f')} req/s, "
                     f"{_num(g['audio_goodput_per_gpu'], '.3f')} audio s/s")
    fixed = result["config"].get("request", {}).get("fixed_length")
    if fixed:
        lines.append(f"fixed length: {fixed['rule']}")
    lines += first_failures(result.get("requests", []))
    return "\n".join(lines)


def first_failures(requests: list[dict]) -> list[str]:
    """The first failed request's error of each kind, cut to a line: what the counts alone leave to the JSON."""
    seen: dict[str, str] = {}
    for r in requests:
        kind = r.get("error_kind")
        if kind is not None and kind not in seen:
            seen[kind] = " ".join(str(r.get("error") or "").split())[:200]
    return [f"first {kind} failure: {message or '(no message)'}" for kind, message in seen.items()]


def compare_table(a: dict, b: dict, name_a: str = "A", name_b: str = "B") -> str:
    """Every numeric aggregate of two runs side by side, with B/A."""
    fa, fb = flatten(a["aggregates"]), flatten(b["aggregates"])
    keys = [k for k in fa if k in fb] + [k for k in fb if k not in fa]
    width = max(len(k) for k in keys) + 2
    lines = [f"{'metric':<{width}}{name_a:>14}{name_b:>14}{'B/A':>10}"]
    for k in keys:
        va, vb = fa.get(k), fb.get(k)
        if va is not None and vb is not None and va != 0 and math.isfinite(va) and math.isfinite(vb):
            ratio = f"{vb / va:.3f}"
        else:
            ratio = "-"
        lines.append(f"{k:<{width}}{_num(va, '.4g'):>14}{_num(vb, '.4g'):>14}{ratio:>10}")
    return "\n".join(lines)


# --- sweep summary -------------------------------------------------------------------------------------------

_COLUMNS = (
    ("req/s", "request_throughput", ".3f"), ("audio s/s", "audio_throughput", ".3f"),
    ("TTFP p50 ms", "ttfp_ms.median", ".1f"), ("TTFP p99 ms", "ttfp_ms.p99", ".1f"),
    ("E2EL p50 ms", "e2el_ms.median", ".1f"), ("RTF p50", "rtf.median", ".3f"),
    ("underrun p99 s", "underrun_s.p99", ".3f"), ("continuity", "continuity_rate", ".2f"),
    ("goodput req/s", "goodput.request_goodput", ".3f"), ("goodput/GPU", "goodput.request_goodput_per_gpu", ".3f"),
)


def summary_markdown(cells: list[dict], meta: dict) -> str:
    """SUMMARY.md: the sweep's settings, fairness notes and one row per (topology, concurrency)."""
    lines = [f"# {meta.get('title', 'legato bench sweep')}", ""]
    for key in ("model", "dataset", "mode", "fixed_length", "max_num_seqs", "max_new_tokens", "server_args",
                "request_rate", "slo", "topology_args", "control", "environment"):
        if meta.get(key) not in (None, "", [], {}):
            lines.append(f"- **{key}**: `{meta[key]}`")
    lines.append("")
    for note in meta.get("fairness_notes", []):
        lines.append(f"> **{note}**")
    if meta.get("fairness_notes"):
        lines.append("")
    head = ["topology", "GPUs", "conc", "ok/total", *(c[0] for c in _COLUMNS), "audio s/s vs control"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    control = {(c["gpus"], c["concurrency"]): c for c in cells if c["topology"] == c.get("control")}
    for c in cells:
        row = [c["topology"], "cpu" if meta.get("cpu_only") else str(c["gpus"]), str(c["concurrency"])]
        agg = c.get("aggregates")
        if agg is None:
            row += ["0/0", f"failed: {c.get('error', '?')}"] + [""] * len(_COLUMNS)
            lines.append("| " + " | ".join(row) + " |")
            continue
        flat = flatten(agg)
        row.append(f"{agg['completed']}/{agg['num_requests']}")
        row += [_num(flat.get(key), fmt) for _, key, fmt in _COLUMNS]
        ctrl = control.get((c["gpus"], c["concurrency"]))
        base = flatten(ctrl["aggregates"]).get("audio_throughput") if ctrl and ctrl.get("aggregates") else None
        row.append(f"{flat['audio_throughput'] / base:.3f}" if base else "-")
        lines.append("| " + " | ".join(row) + " |")
    failures = [(c["topology"], c["concurrency"], c["aggregates"]["failures"]) for c in cells
                if c.get("aggregates") and c["aggregates"]["failed"]]
    if failures:
        lines += ["", "Failed requests: " + "; ".join(f"{t} c{n}: {f}" for t, n, f in failures)]
    lines += ["", meta.get("runs_note", "Per-run JSON (every request, aggregates, exact config) and check WAVs are in "
                                        "`runs/`."), ""]
    return "\n".join(lines)


def _series(cells: list[dict], key: str) -> dict[str, tuple[list[int], list[float]]]:
    out: dict[str, tuple[list[int], list[float]]] = {}
    for c in cells:
        value = flatten(c["aggregates"]).get(key) if c.get("aggregates") else None
        if value is None or not math.isfinite(value):
            continue
        xs, ys = out.setdefault(c["topology"], ([], []))
        xs.append(c["concurrency"])
        ys.append(value)
    return out


def plot_caption(meta: dict) -> str:
    """What every plot says about its run: the model, the hardware, the prompts and the commit."""
    env = meta.get("environment") or {}
    if meta.get("cpu_only"):
        hardware = f"CPU only, {env.get('cpus') or '?'} cores"
    else:
        hardware = ", ".join(env.get("gpus") or []) or "GPUs not recorded"
    prompts = Path(str(meta.get("dataset") or "?")).name
    if meta.get("mode"):
        prompts += f" ({meta['mode']})"
    return (f"model {meta.get('model_path') or meta.get('model') or '?'} | {hardware} | prompts {prompts} | "
            f"commit {env.get('commit') or '?'}")


def plot_sweep(cells: list[dict], out_dir: Path, meta: dict | None = None) -> list[Path]:
    """Throughput, TTFP (p50 solid, p99 dashed) and, when an SLO was given, goodput per GPU against
    concurrency, one line per topology; every axis starts at zero, and a caption names the run."""
    meta = meta or {}
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise MissingExtraError(PLOT_EXTRA_HINT) from e
    specs = [
        ("throughput_vs_concurrency.png", "throughput", [("request_throughput", "req/s", "-")],
         [("audio_throughput", "audio s/s", "-")]),
        ("ttfp_vs_concurrency.png", "TTFP (ms)", [("ttfp_ms.median", "p50", "-"), ("ttfp_ms.p99", "p99", "--")], []),
        ("goodput_per_gpu.png", "goodput per GPU",
         [("goodput.request_goodput_per_gpu", "req/s/GPU", "-")],
         [("goodput.audio_goodput_per_gpu", "audio s/s/GPU", "-")]),
    ]
    slo = meta.get("slo") or {}
    if not (slo.get("per_request") or slo.get("run")) or meta.get("cpu_only"):
        # goodput without an SLO is only throughput again, and per GPU it needs GPUs
        specs = specs[:2]
    caption = plot_caption(meta)
    topologies = list(dict.fromkeys(c["topology"] for c in cells))
    colors = {t: f"C{i}" for i, t in enumerate(topologies)}  # one colour per topology in every plot
    concs = sorted({c["concurrency"] for c in cells})
    paths = []
    for name, title, left, right in specs:
        fig, axes = plt.subplots(1, 2 if right else 1, figsize=(11 if right else 6, 4), squeeze=False)
        for ax, series in zip(axes[0], [left, right] if right else [left], strict=True):
            for key, what, style in series:
                for topo, (xs, ys) in _series(cells, key).items():
                    ax.plot(xs, ys, style, color=colors[topo], marker="o", label=f"{topo} {what}")
            ax.set_xlabel("max concurrency")
            ax.set_ylabel(", ".join(s[1] for s in series))
            ax.set_xscale("log", base=2)
            ax.set_xticks(concs, [str(c) for c in concs])
            ax.minorticks_off()
            ax.set_ylim(bottom=0)
            ax.grid(True, alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=8)
        fig.suptitle(title)
        fig.text(0.5, 0.01, caption, ha="center", va="bottom", fontsize=7, color="0.3")
        fig.tight_layout(rect=(0, 0.05, 1, 1))
        paths.append(out_dir / name)
        fig.savefig(paths[-1], dpi=100)
        plt.close(fig)
    return paths


def write_sweep(cells: list[dict], meta: dict, out_dir: Path) -> list[Path]:
    """SUMMARY.md, summary.json and the plots; returns the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    md, js = out_dir / "SUMMARY.md", out_dir / "summary.json"
    md.write_text(summary_markdown(cells, meta), encoding="utf-8")
    js.write_text(json.dumps(sanitize({"meta": meta, "cells": cells}), indent=1, ensure_ascii=False) + "\n",
                  encoding="utf-8")
    return [md, js, *plot_sweep(cells, out_dir, meta)]
