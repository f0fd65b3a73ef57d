"""`legato bench serve|sweep|summarize|compare|soak`. Heavy imports happen inside the handlers, so
`legato --help` stays fast."""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from legato.cli_help import DefaultsFormatter

from .served import api_key, concurrency_of_server, mode_of_model, served_model, server_card, unreachable

if TYPE_CHECKING:
    from .datasets import BenchRequest


def _rate(value: str) -> float:
    rate = float(value)
    if not rate > 0:
        raise argparse.ArgumentTypeError(f"must be a rate > 0 a second, or inf, got {value!r}")  # arrivals or tokens
    return rate


def _positive(value: str) -> float:
    """A finite number > 0 (seconds, frames a character). NaN compares false with everything, so it slipped past
    `<= 0` checks (`--timeout nan` failed every request "within nan s"), and inf overflowed where a count is
    worked out from it (`bench soak --duration inf`, a traceback)."""
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if not 0 < number < math.inf:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {value!r}")
    return number


def _positive_int(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value!r}")
    return number


def _server_url(value: str) -> str:
    """A server's root URL, without a trailing slash: the bench appends its routes (`/v1/models`, ...) to it, and
    `http://host:8000/` read `//v1/models`, a 404 reported as "give --mode". The OpenAI SDK's base URL (ending in
    `/v1`) is refused by name: its routes would be `/v1/v1/...`."""
    url = value.strip().rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(f"must be the server's http:// or https:// URL, got {value!r}")
    if parts.path.endswith("/v1"):
        raise argparse.ArgumentTypeError(f"must be the server's root URL, not the OpenAI SDK's base URL: drop the /v1 "
                                         f"({url[:-3]}), got {value!r}")
    return url


def _ints(value: str) -> list[int]:
    return [int(v) for v in value.split(",") if v.strip()]


def _pairs(items: list[str] | None, what: str, key_name: str = "TOPOLOGY") -> dict[str, str]:
    """`KEY=VALUE` items (a topology key may itself contain ':')."""
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"legato bench: {what} {item!r}: expected {key_name}=VALUE")
        out[key] = value
    return out


def _add_workload_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("prompts")
    g.add_argument("--dataset-path", default=None,
                   help="a meta.lst file, or a folder holding <locale>/meta.lst (Seed-TTS-eval layout) or meta.lst "
                        "(default: the 48 prompts and 8 voices shipped with legato, legato/bench/data)")
    g.add_argument("--locale", default="en", help="locale folder of the dataset")
    g.add_argument("--meta-name", default="meta.lst", help="list file name inside the locale folder")
    g.add_argument("--num-prompts", type=_positive_int, default=None, help="prompts to sample (default: 100, or all of "
                   "the default set's 48)")
    g.add_argument("--seed", type=int, default=0, help="sampling (shuffle) seed; also seeds the arrival process")
    g.add_argument("--mode", choices=["clone", "xvec", "voice", "design"], default=None,
                   help="voice clone (ref audio + text), x-vector only, a preset voice, or a VoiceDesign description "
                        "(default: what the server's model takes: voice for CustomVoice, clone for Base, design "
                        "for VoiceDesign; voice when --voice is given)")
    g.add_argument("--voice", default=None,
                   help="preset voice name, or the description of design mode (default: ryan where the model has it, "
                        "else its first preset)")
    g.add_argument("--language", default=None, help="language sent with each request (default: from the locale)")
    g.add_argument("--fixed-length", action="store_true",
                   help="ask the server to ignore EOS and produce a length derived from the text (random weights)")
    g.add_argument("--frames-per-char", type=_positive, default=0.8, help="fixed length: frames per text character")
    g.add_argument("--min-frames", type=int, default=4, help="fixed length: fewest frames")
    g.add_argument("--max-frames", type=int, default=250, help="fixed length: most frames")
    g.add_argument("--max-new-tokens", type=int, default=None, help="max_new_tokens sent with each request "
                   "(default: the server's)")
    g.add_argument("--request-seed", type=int, default=None, help="request i sends seed REQUEST_SEED + i")
    g.add_argument("--extra-body", default=None, help="JSON object merged into every request body")
    c = p.add_argument_group("load")
    c.add_argument("--model", default=None, help="`model` field sent with each request")
    c.add_argument("--endpoint", default="/v1/audio/speech", help="the speech route")
    c.add_argument("--request-rate", type=_rate, default=float("inf"),
                   help="Poisson arrivals per second; inf: all at once")
    c.add_argument("--num-warmups", type=int, default=2, help="requests sent (and not counted) before the run")
    c.add_argument("--timeout", type=_positive, default=300.0, help="per-request deadline in seconds")
    c.add_argument("--sample-rate", type=_positive_int, default=24000,
                   help="sample rate of the PCM stream: a response whose X-Sample-Rate differs fails (its audio "
                        "seconds would be wrong)")
    c.add_argument("--no-progress", action="store_true", help="no progress bar")
    m = p.add_argument_group("metrics and output")
    m.add_argument("--slo", action="append", default=[], metavar="KEY=VALUE",
                   help="per request: ttfp_ms, e2el_ms, rtf, underrun_s; run percentiles: ttfp_p50_ms, "
                        "e2el_p99_ms, rtf_p90, underrun_p99_s, ... (see legato.bench.metrics)")
    m.add_argument("--label", default="bench", help="names the outputs: <label>-<topology>-c<conc>")


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `bench` and its subcommands on the top-level `legato` parser."""
    bench = sub.add_parser("bench", help="benchmark a streaming speech server", formatter_class=DefaultsFormatter)
    bsub = bench.add_subparsers(dest="bench_command", required=True)

    p = bsub.add_parser("serve", help="benchmark one running server", formatter_class=DefaultsFormatter)
    _add_workload_args(p)
    p.add_argument("--base-url", type=_server_url, default="http://127.0.0.1:8000",
                   help="the server's root URL (without the /v1 of an OpenAI base URL)")
    p.add_argument("--api-key", default=None,
                   help="bearer token of a server run with --api-key (default: $LEGATO_API_KEY when set)")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="most requests in flight (default: the requests the server decodes at once, from its "
                        "/v1/models, and a run at that default stops as soon as its pace shows its requests cannot "
                        "finish within --timeout; unbounded when the server does not say)")
    p.add_argument("--client-procs", type=int, default=1,
                   help="run the client in this many processes (requests and the concurrency cap split between "
                        "them, results merged exactly): for loads one process cannot read in time")
    p.add_argument("--result-dir", default="bench-results", help="where the run's JSON and check WAV go")
    t = p.add_argument_group("streaming text (the /v1/audio/speech/stream WebSocket, legato/bench/stream_text.py)")
    t.add_argument("--stream-text", action="store_true",
                   help="send each prompt over the streaming-text WebSocket, token by token, as an LLM writes it; "
                        "TTFP counts from the first text; reports text stalls apart from engine underruns")
    # None: not given (--stream-text then takes TextFeed's defaults; an HTTP run refuses what it would ignore)
    t.add_argument("--text-rate", type=_rate, default=None, metavar="TOKENS_PER_S",
                   help="tokens a second the text arrives at (inf: all at once) (default: 50)")
    t.add_argument("--token-chars", type=int, default=None,
                   help="characters per token (LLM tokens average ~4) (default: 4)")
    t.add_argument("--cancel-after", type=float, default=None, metavar="SECONDS",
                   help="cancel each context once this much audio has arrived (barge-in): reports cancel latency")
    p.add_argument("--topology", default="server", help="recorded in the result (and the file names)")
    p.add_argument("--num-gpus", type=int, default=None, help="GPUs the server uses: enables per-GPU figures")
    p.add_argument("--max-num-seqs", type=int, default=None, help="the server's limit, recorded for comparisons")
    p.set_defaults(func=_run(_serve))

    p = bsub.add_parser("sweep", help="start `legato serve` per topology and concurrency, run, summarise",
                        formatter_class=DefaultsFormatter)
    _add_workload_args(p)
    p.add_argument("--topologies", default="single", help="comma list, e.g. single,replicas:2")
    p.add_argument("--concurrency", type=_ints, default=[1, 4], help="comma list of max concurrencies")
    p.add_argument("--out-dir", default="bench-sweep", help="where SUMMARY.md, summary.json, plots and runs go")
    p.add_argument("--server-args", default="", help="arguments for every server, e.g. '--max-num-seqs 4'")
    p.add_argument("--topology-args", action="append", metavar="T=ARGS",
                   help="extra arguments of one topology (default: none)")
    p.add_argument("--gpus", action="append", metavar="T=N",
                   help="GPU count of a topology kind the bench can't infer (default: none)")
    p.add_argument("--devices", default=None, help="comma list of GPU ids; a topology with N GPUs gets the first N")
    p.add_argument("--server-cmd", default=None,
                   help="server command (default: the installed `legato serve` beside this Python)")
    p.add_argument("--host", default="127.0.0.1", help="address the servers listen on")
    p.add_argument("--port", type=int, default=None, help="port of the servers (default: a free port)")
    p.add_argument("--startup-timeout", type=_positive, default=300.0, help="seconds a server may take to be ready")
    p.add_argument("--stop-grace", type=_positive, default=15.0, help="seconds a server gets to stop before SIGKILL")
    p.add_argument("--allow-unfair", action="store_true",
                   help="run/compare topologies with different GPU counts or limits (flagged in the summary)")
    p.set_defaults(func=_run(_sweep))

    p = bsub.add_parser("summarize", help="SUMMARY.md, summary.json and plots from run JSONs (a sweep cut "
                                          "short, or cells of several sweeps)", formatter_class=DefaultsFormatter)
    p.add_argument("runs", nargs="+", help="result JSONs written by `bench serve` or `bench sweep`")
    p.add_argument("--out-dir", required=True, help="where SUMMARY.md, summary.json and the plots go")
    p.add_argument("--env", action="append", metavar="KEY=VALUE",
                   help="recorded under environment, e.g. commit (default: none)")
    p.set_defaults(func=_run(_summarize))

    p = bsub.add_parser("compare", help="two result JSONs side by side, with B/A for every aggregate",
                        formatter_class=DefaultsFormatter)
    p.add_argument("a", help="run A's JSON")
    p.add_argument("b", help="run B's JSON")
    p.add_argument("--allow-unfair", action="store_true", help="show runs whose limits differ, flagged")
    p.set_defaults(func=_run(_compare))

    p = bsub.add_parser("standin", help="a server stand-in streaming pre-made audio at a set pace (no model): "
                                        "what the bench client alone can sustain", formatter_class=DefaultsFormatter)
    from .standin import add_arguments as standin_arguments

    standin_arguments(p)
    p.set_defaults(func=_run(_standin))

    p = bsub.add_parser(
        "soak", help="long mixed load with random disconnects: latency, RSS and KV leaks over time",
        formatter_class=DefaultsFormatter,
        description="Drive a running server with mixed formats (pcm/wav/mp3 as streams, files and SSE) and "
                    "random mid-stream disconnects; report per-window e2e p99, server RSS and KV usage, first vs "
                    "last window, and leaked KV blocks after the drain. The operators' run is ten minutes: "
                    "legato bench soak --duration 600 --pid <server pid> --out soak.json. Exit 1 on any bad "
                    "response or leaked block.")
    p.add_argument("--url", type=_server_url, default="http://127.0.0.1:8000",
                   help="the server's root URL (without the /v1 of an OpenAI base URL)")
    p.add_argument("--duration", type=_positive, default=600.0, help="seconds of load (600: the operators' soak)")
    p.add_argument("--concurrency", type=int, default=8, help="clients, each looping requests")
    p.add_argument("--disconnect-rate", type=float, default=0.1, help="share of requests the client leaves early")
    p.add_argument("--windows", type=int, default=None, help="windows the run is cut into (default: one a minute, "
                   "at least 2)")
    p.add_argument("--pid", type=int, default=None, help="the server's process id, for its RSS from /proc "
                   "(default: the server's process_resident_memory_bytes gauge, if it exports one)")
    p.add_argument("--seed", type=int, default=0, help="seeds formats, lengths and who leaves when")
    p.add_argument("--min-frames", type=int, default=8, help="fewest frames of a request (ignore_eos)")
    p.add_argument("--max-frames", type=int, default=40, help="most frames of a request")
    p.add_argument("--voice", default="ryan", help="voice sent with each request ('' for none)")
    p.add_argument("--extra-body", default=None, help="JSON object merged into every request body")
    p.add_argument("--timeout", type=_positive, default=120.0, help="per-request deadline in seconds (past it: a hang)")
    p.add_argument("--drain-timeout", type=_positive, default=60.0, help="seconds the engine gets to drain after")
    p.add_argument("--no-warmup", action="store_true", help="no warm-up request of every kind before the clock")
    p.add_argument("--out", default=None, help="write the report JSON here (default: none)")
    p.add_argument("--api-key", default=None,
                   help="bearer token of a server run with --api-key (default: $LEGATO_API_KEY when set)")
    p.set_defaults(func=_run(_soak))


def _run(handler):
    """Input errors (bad list, SLO, settings) end the command with a message and exit code 2."""

    def wrapped(args: argparse.Namespace) -> int:
        import logging

        from . import MissingExtraError
        from .datasets import DatasetError
        from .metrics import SloError

        for noisy in ("httpx", "matplotlib"):  # one line per request / font cache notes drown the report
            logging.getLogger(noisy).setLevel(logging.WARNING)
        try:
            return handler(args)
        except (DatasetError, SloError, MissingExtraError, ValueError, OSError) as e:
            print(f"legato bench {args.bench_command}: error: {e}", file=sys.stderr)
            return 2

    return wrapped


def _prepare(args: argparse.Namespace):
    """Prompts → request bodies, client config, SLOs and the config recorded in every result."""
    import legato

    from .client import ClientConfig
    from .datasets import DEFAULT_DATASET, FixedLength, RequestSpec, build_requests, load_prompts
    from .metrics import parse_slos

    fixed = FixedLength(args.frames_per_char, args.min_frames, args.max_frames) if args.fixed_length else None
    extra = json.loads(args.extra_body) if args.extra_body else {}
    if not isinstance(extra, dict):
        raise ValueError("--extra-body must be a JSON object")
    if fixed is not None and args.max_new_tokens is not None:
        # each request's num_frames is its length: a second length is the server's 400 conflicting_length
        raise ValueError("--max-new-tokens and --fixed-length both set the length: give one")
    mode, voice = args.mode, args.voice
    if mode is None:
        mode, voice = ("voice", voice) if voice else mode_of_model(args)
    elif mode == "voice" and voice is None:
        voice = mode_of_model(args)[1]
    spec = RequestSpec(mode, voice, args.language, fixed, args.max_new_tokens, args.request_seed, extra)
    dataset = args.dataset_path or DEFAULT_DATASET
    num_prompts = args.num_prompts if args.num_prompts is not None else (100 if args.dataset_path else None)
    ds = load_prompts(dataset, args.locale, num_prompts, args.seed, args.meta_name, flag="--num-prompts",
                      by_default=args.num_prompts is None)
    for w in ds.warnings:
        print(f"legato bench: warning: {w}", file=sys.stderr)
    requests = build_requests(ds, spec)
    slo = parse_slos(args.slo)
    ccfg = ClientConfig(base_url=getattr(args, "base_url", "http://127.0.0.1:8000"), endpoint=args.endpoint,
                        model=args.model, max_concurrency=getattr(args, "max_concurrency", None),
                        request_rate=args.request_rate, num_warmups=args.num_warmups, timeout_s=args.timeout,
                        seed=args.seed, sample_rate=args.sample_rate, progress=not args.no_progress,
                        api_key=api_key(args), stop_on_pace=getattr(args, "concurrency_from_server", False))
    request_cfg = {k: v for k, v in asdict(spec).items() if k != "fixed_length"}
    request_cfg["fixed_length"] = {**asdict(fixed), "rule": fixed.describe()} if fixed else None
    config = {
        "label": args.label,
        "client": {k: v for k, v in asdict(ccfg).items() if k != "progress"},
        "dataset": {"path": str(ds.path), "locale": ds.locale, "num_prompts": len(ds.rows), "seed": args.seed,
                    "warnings": ds.warnings},
        "request": request_cfg,
        "slo": slo.to_json(),
        "argv": sys.argv,
        "legato_version": legato.__version__,
    }
    prompts = f"{len(requests)} prompt{'s' if len(requests) != 1 else ''}"
    print(f"legato bench: {prompts} from {ds.path} (seed {args.seed}), mode {mode}"
          + (f"; fixed length: {fixed.describe()}" if fixed else ""), file=sys.stderr)
    return requests, ccfg, slo, config


def _serve(args: argparse.Namespace) -> int:
    from .multiproc import run_processes
    from .report import build_result, run_stem, run_table, save_run

    check_stream_text_args(args)  # before the server is asked anything
    card = server_card(args)
    problem = unreachable(card, args.base_url, api_key(args)) if isinstance(card, Exception) else None
    if problem is not None:  # every request would fail the same way: say why once, before any is sent
        raise ValueError(problem)
    if args.max_concurrency is None:
        args.max_concurrency = concurrency_of_server(args)
        # A concurrency the bench chose is given up, not sat through, when its requests cannot meet --timeout.
        args.concurrency_from_server = args.max_concurrency is not None
    served_seqs = card.get("max_num_seqs") if isinstance(card, dict) else None
    requests, ccfg, slo, config = _prepare(args)
    config.update(topology=args.topology, num_gpus=args.num_gpus, max_num_seqs=args.max_num_seqs or served_seqs,
                  server_args=None, client_procs=args.client_procs)
    if args.stream_text:
        check_session_size(requests, ccfg.model, card)
        return _serve_stream_text(args, requests, ccfg, slo, config)
    out = run_processes(ccfg, requests, args.client_procs)
    result = build_result(config, out, slo, args.num_gpus)
    paths = save_run(result, out, Path(args.result_dir), run_stem(args.label, args.topology, ccfg.max_concurrency),
                     ccfg.sample_rate)
    print(run_table(result))
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    stopped = next((r.error for r in out.records if r.error_kind == "stopped"), None)
    if stopped is not None:  # the run did not go to its end: say so last, where the eye lands
        print(f"legato bench: {stopped}", file=sys.stderr)
        return 1
    return 0 if result["aggregates"]["completed"] else 1


def check_stream_text_args(args: argparse.Namespace) -> None:
    """ValueError for `bench serve` options that --stream-text cannot honour, and for its own options given
    without it: an HTTP run has no text to pace and no context to cancel, and would drop them unsaid."""
    if not args.stream_text:
        if args.cancel_after is not None:  # an HTTP run has no contexts to cancel: it would measure no barge-in
            raise ValueError("--cancel-after cancels streaming-text contexts: add --stream-text")
        given = [flag for flag, value in (("--text-rate", args.text_rate), ("--token-chars", args.token_chars))
                 if value is not None]
        if given:  # an HTTP request sends its whole text at once: there is nothing to pace or cut
            raise ValueError(f"{' and '.join(given)} {'applies' if len(given) == 1 else 'apply'} to streaming text "
                             "only: add --stream-text")
        return
    if args.client_procs != 1:
        raise ValueError("--stream-text runs in one client process (--client-procs 1)")


def check_session_size(requests: list[BenchRequest], model: str | None, card: dict | Exception) -> None:
    """ValueError, before any request, when a session message would exceed the server's WebSocket message cap
    (/v1/models `ws_max_message_bytes`): every request would fail (a Base model's shipped clips, ~200 KB inline,
    against the default 64 KiB)."""
    from .stream_text import largest_session_message

    cap = card.get("ws_max_message_bytes") if isinstance(card, dict) else None
    size = largest_session_message(model, requests)
    if isinstance(cap, int) and size > cap:
        raise ValueError(f"--stream-text sends each request's session (its fields, a reference clip inline among "
                         f"them) in one message, of up to {size} bytes here, and the server takes at most {cap} "
                         "(--ws-max-message-bytes): for a clip, save the voice (docs/voices.md) and give --voice "
                         "NAME, or start the server with a larger --ws-max-message-bytes")


def _serve_stream_text(args: argparse.Namespace, requests, ccfg, slo, config: dict) -> int:
    import asyncio

    from .report import build_result, run_stem, run_table, save_run
    from .stream_text import TextFeed, run_stream_text, stream_text_summary, summary_line

    given = {"tokens_per_s": args.text_rate, "token_chars": args.token_chars, "cancel_after_s": args.cancel_after}
    feed = TextFeed(**{k: v for k, v in given.items() if v is not None})
    config["stream_text"] = {"tokens_per_s": feed.tokens_per_s, "token_chars": feed.token_chars,
                             "cancel_after_s": feed.cancel_after_s}
    out, extras = asyncio.run(run_stream_text(ccfg, feed, requests))
    result = build_result(config, out, slo, args.num_gpus)
    result["stream_text"] = stream_text_summary(feed, out.records, extras)
    paths = save_run(result, out, Path(args.result_dir),
                     run_stem(args.label + "-stream-text", args.topology, ccfg.max_concurrency), ccfg.sample_rate)
    print(run_table(result))
    print(summary_line(result["stream_text"]))
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0 if result["aggregates"]["completed"] else 1


def _sweep(args: argparse.Namespace) -> int:
    from .environment import environment, gpus
    from .sweep import SweepConfig, SweepError, parse_flag, run_sweep

    requests, ccfg, slo, config = _prepare(args)
    scfg = SweepConfig(
        topologies=[t.strip() for t in args.topologies.split(",") if t.strip()],
        concurrencies=args.concurrency,
        out_dir=Path(args.out_dir),
        label=args.label,
        server_args=shlex.split(args.server_args),
        topology_args={k: shlex.split(v) for k, v in _pairs(args.topology_args, "--topology-args").items()},
        gpus={k: int(v) for k, v in _pairs(args.gpus, "--gpus").items()},
        devices=args.devices.split(",") if args.devices else None,
        host=args.host,
        port=args.port,
        startup_timeout_s=args.startup_timeout,
        stop_grace_s=args.stop_grace,
        allow_unfair=args.allow_unfair,
        cpu_only=not gpus() and args.devices is None,
    )
    if args.server_cmd:
        scfg.server_cmd = shlex.split(args.server_cmd)
    fixed = config["request"]["fixed_length"]
    meta = {"model": args.model or "(server default)", "model_path": served_model(args.server_args)
            or "embedded tiny default (random weights)", "dataset": config["dataset"]["path"],
            "mode": config["request"]["mode"], "fixed_length": fixed["rule"] if fixed else None,
            "max_num_seqs": parse_flag(scfg.server_args, "--max-num-seqs"), "max_new_tokens": args.max_new_tokens,
            "request_rate": args.request_rate,
            "slo": config["slo"], "environment": environment()}
    try:
        cells, paths = run_sweep(scfg, requests, ccfg, config, slo, meta)
    except SweepError as e:
        print(f"legato bench sweep: error: {e}", file=sys.stderr)
        return 2
    print((Path(args.out_dir) / "SUMMARY.md").read_text(encoding="utf-8"))
    print("wrote " + ", ".join(str(p) for p in paths))
    bad = [c for c in cells if c["aggregates"] is None or not c["aggregates"]["completed"]]
    return 1 if bad else 0


def _summarize(args: argparse.Namespace) -> int:
    from .report import load_result, write_sweep
    from .sweep import control_for, parse_flag

    out_dir = Path(args.out_dir)
    cells = []
    for path in args.runs:
        r = load_result(path)
        cfg = r["config"]
        gpus = cfg.get("num_gpus") or 1
        # An uncapped run (`bench serve` without a cap from the flag or the server) had every request in flight.
        concurrency = cfg["client"]["max_concurrency"] or len(r["requests"])
        # A streaming-text run is another kind of load than HTTP requests: its rows say so.
        kind = cfg.get("topology") or "server"
        if cfg.get("stream_text"):
            kind += " (stream-text" + (", cancels" if cfg["stream_text"].get("cancel_after_s") else "") + ")"
        cells.append({"topology": kind, "gpus": gpus,
                      "concurrency": concurrency, "control": control_for(gpus),
                      "aggregates": r["aggregates"], "error": None, "result": str(Path(path))})
    first = load_result(args.runs[0])["config"]
    fixed = first["request"].get("fixed_length")
    # `bench serve` records `server_args: null`: it ran against a server it did not start.
    meta = {"model": parse_flag(first.get("server_args") or [], "--model") or "(server default)",
            "dataset": first["dataset"]["path"], "mode": first["request"]["mode"],
            "fixed_length": fixed["rule"] if fixed else None, "max_num_seqs": first.get("max_num_seqs"),
            "server_args": first.get("server_args"), "slo": first.get("slo"),
            "environment": _pairs(args.env, "--env", "KEY"), "control": sorted({c["control"] for c in cells}),
            "title": "legato bench summary",
            "runs_note": "The rows' runs (each request, aggregates, exact config): "
                         + ", ".join(f"`{c['result']}`" for c in cells) + "."}
    cells.sort(key=lambda c: (c["topology"] != c["control"], c["topology"], c["concurrency"]))
    paths = write_sweep(cells, meta, out_dir)
    print((out_dir / "SUMMARY.md").read_text(encoding="utf-8"))
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


def _compare(args: argparse.Namespace) -> int:
    from .report import compare_table, load_result
    from .sweep import fairness_problems

    a, b = load_result(args.a), load_result(args.b)
    problems, warnings = fairness_problems({"A": a["config"], "B": b["config"]})
    for w in warnings:
        print(f"warning: {w}", file=sys.stderr)
    if problems and not args.allow_unfair:
        print("legato bench compare: refusing an unfair comparison (--allow-unfair to show it anyway): "
              + "; ".join(problems), file=sys.stderr)
        return 2
    for p in problems:
        print(f"UNFAIR: {p}")
    print(f"A = {args.a} ({a['config'].get('topology')})\nB = {args.b} ({b['config'].get('topology')})")
    print(compare_table(a, b))
    return 0


def _soak(args: argparse.Namespace) -> int:
    from .soak import SoakConfig, passed, rss_bytes, run_soak, summary, write_result

    if args.pid is not None and rss_bytes(args.pid) is None:  # else the RSS check is skipped, saying "give --pid"
        raise ValueError(f"--pid {args.pid}: no such process here (its RSS is read from /proc/{args.pid}/status)")
    extra = json.loads(args.extra_body) if args.extra_body else {}
    if not isinstance(extra, dict):
        raise ValueError("--extra-body must be a JSON object")
    cfg = SoakConfig(url=args.url, duration_s=args.duration, concurrency=args.concurrency,
                     disconnect_rate=args.disconnect_rate, windows=args.windows, seed=args.seed,
                     min_frames=args.min_frames, max_frames=args.max_frames, voice=args.voice or None,
                     pid=args.pid, timeout_s=args.timeout, drain_timeout_s=args.drain_timeout,
                     warmup=not args.no_warmup, extra=extra, api_key=api_key(args))
    import httpx

    try:
        result = run_soak(cfg)
    except httpx.HTTPError as e:  # the server is not there, or its /health is not legato's
        print(f"legato bench soak: error: {args.url}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    print(summary(result))
    if args.out:
        print(f"wrote {write_result(result, args.out)}")
    return 0 if passed(result) else 1


def _standin(args: argparse.Namespace) -> int:
    import asyncio

    from .standin import config_from_args, serve_forever

    asyncio.run(serve_forever(config_from_args(args)))
    return 0
