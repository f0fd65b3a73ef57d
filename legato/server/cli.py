"""`legato serve`: load a model, start the engine thread, serve the HTTP API with uvicorn.

    legato serve                                   # the embedded tiny default (random weights: noise)
    legato serve Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice --port 8000

SIGINT/SIGTERM shut down gracefully (server/lifecycle.py): new speech/voice requests and /health answer
503 at once, in-flight requests run for up to --shutdown-grace seconds, then the engine ends the rest
with their format's error ending (503, an SSE error event, a truncated raw stream) and the process exits
0. A second signal exits at once (128 + the signal number).
"""

from __future__ import annotations

import argparse
import logging
from typing import TYPE_CHECKING

from legato.cli_help import DefaultsFormatter
from legato.server.aliases import OPENAI_VOICE_ALIASES
from legato.server.ws_protocol import WS_DEFAULTS

if TYPE_CHECKING:
    from legato.pipeline.topology import Topology

log = logging.getLogger("legato.serve")


def add_serve_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("serve", help="serve the OpenAI-compatible speech API over HTTP",
                       description="Serve the OpenAI-compatible speech API (/v1/audio/speech) over HTTP.",
                       formatter_class=DefaultsFormatter)
    m = p.add_argument_group("model")
    m.add_argument("model_arg", nargs="?", metavar="MODEL", default=None,
                   help="model directory or hub id, as --model (default: the embedded tiny model, random weights)")
    m.add_argument("--model", default=None,
                   help="model directory or hub id (default: the embedded tiny model, random weights)")
    m.add_argument("--served-model-name", default=None,
                   help="name in /v1/models and requests' `model` (default: the model directory's name or hub id)")
    m.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda when available)")
    m.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                   help="talker dtype (auto: bfloat16 on CUDA, float32 on CPU)")
    m.add_argument("--codec-dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                   help="codec decoder dtype (auto: bfloat16 on CUDA, whose fidelity against float32 is in "
                        "docs/benchmarks.md, and float32 on CPU; float32 is the exact path)")
    h = p.add_argument_group("http")
    h.add_argument("--host", default="127.0.0.1", help="address to listen on")
    h.add_argument("--port", type=int, default=8000, help="port to listen on")
    h.add_argument("--log-format", default="text", choices=["text", "json"], help="log line format")
    h.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"], help="log level")
    h.add_argument("--fronts", type=int, default=1, metavar="N",
                   help="HTTP front processes sharing the port (Linux, engine worker processes, single or replicas "
                        "topology): one front costs ~1 ms of CPU per streamed request, so past a few hundred streams "
                        "its event loop delays every first audio; --max-connections and the slow-client share are "
                        "split between the fronts")
    h.add_argument("--http", default="httptools", choices=["httptools", "h11"],
                   help="HTTP/1.1 parser: httptools (C, less CPU per request) or h11 (pure Python); both guarded alike")
    # slow clients (connections.py)
    h.add_argument("--timeout-header", type=float, default=10.0,
                   help="seconds a connection may take to send a request's line and headers; then it is closed")
    h.add_argument("--timeout-body", type=float, default=30.0,
                   help="seconds a request body may pause between two chunks, and how far behind --min-body-rate "
                        "it may fall; then 408")
    h.add_argument("--timeout-send", type=float, default=30.0,
                   help="seconds a response may wait on a client that takes none of it (its send buffers full); "
                        "then the connection is closed and the request aborted")
    h.add_argument("--min-body-rate", type=float, default=16384.0, metavar="BYTES_PER_S",
                   help="a request body must arrive at this many bytes a second on average: its deadline is "
                        "--timeout-body seconds plus one second per BYTES_PER_S bytes received; then 408")
    h.add_argument("--max-connections", type=int, default=1024,
                   help="most concurrent connections; a request on one more gets 503")
    h.add_argument("--max-slow-connections-per-client", type=int, default=None, metavar="N",
                   help="connections one client address may hold while they are still sending their request "
                        "after a second (slow heads and bodies); one more gets 429 and is closed (default: "
                        "--max-connections / 16, at least 4)")
    w = p.add_argument_group("streaming-text WebSocket (/v1/audio/speech/stream, docs/streaming-text.md)")
    w.add_argument("--ws-max-message-bytes", type=int, default=WS_DEFAULTS.max_message_bytes, metavar="BYTES",
                   help="largest client message; a larger one gets an error event")
    w.add_argument("--ws-max-contexts", type=int, default=WS_DEFAULTS.max_contexts, metavar="N",
                   help="contexts one socket may run at once; one more gets an error event")
    w.add_argument("--ws-idle-timeout", type=float, default=WS_DEFAULTS.idle_timeout_s, metavar="SECONDS",
                   help="a socket with no message and no context running this long is closed")
    w.add_argument("--ws-send-queue", type=int, default=WS_DEFAULTS.send_queue, metavar="N",
                   help="outgoing messages buffered for a client that reads slowly; then its producers wait")
    w.add_argument("--ws-send-timeout", type=float, default=WS_DEFAULTS.send_timeout_s, metavar="SECONDS",
                   help="a full send buffer that does not drain this long: the client is gone, the socket closed")
    w.add_argument("--ws-per-message-deflate", action="store_true",
                   help="offer permessage-deflate compression to clients that ask (default: off; PCM and coded "
                        "audio barely compress, and deflating every frame cost the server more CPU than the rest "
                        "of a socket's work)")
    a = p.add_argument_group("access")
    a.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help="require Authorization: Bearer KEY on every route but /health and /metrics (repeatable; "
                        "also $LEGATO_API_KEY); a missing or wrong key gets 401")
    a.add_argument("--protect-metrics", action="store_true",
                   help="require the API key on /metrics too (by default it stays open with --api-key, as vLLM's "
                        "does, so Prometheus scrapers need no key)")
    a.add_argument("--api-key-file", default=None, metavar="PATH",
                   help="a file of API keys, one per line (# comments), on top of --api-key")
    a.add_argument("--allowed-origins", default="", metavar="ORIGINS",
                   help="comma-separated web origins (https://app.example.com, or *) whose pages may call the "
                        "server (CORS); requests from other origins get 403 (default: none)")
    a.add_argument("--allowed-hosts", default=None, metavar="HOSTS",
                   help="comma-separated Host header names served, or * (default: the loopback names when --host "
                        "is loopback, otherwise any)")
    t = p.add_argument_group("topology")
    t.add_argument("--topology", default="single",
                   help="single | split (talker worker + codec worker) | replicas:N (N engines behind a router) | "
                        "MpNd (M prefill, N decode engines)")
    t.add_argument("--deploy", default=None, help="a deploy/*.yaml file of options (the command line wins)")
    t.add_argument("--devices", default=None,
                   help="comma-separated devices for the workers, in order (default: --device for all)")
    t.add_argument("--workers", default="auto", choices=["auto", "thread", "process"],
                   help="run each engine on a thread of the server process or in its own worker process (auto: "
                        "a worker process on CUDA, where the engine then holds a GIL of its own, a thread on the "
                        "CPU)")
    t.add_argument("--kv-transfer", default="auto", choices=["shm", "cuda_ipc", "mooncake", "auto"],
                   help="how process MpNd moves each handoff between its prefill and decode workers (cuda_ipc: GPU "
                        "to GPU on one host, through CUDA IPC handles; auto, per link: cuda_ipc between two GPU "
                        "workers on one host, shm for other pairs on one host, mooncake between nodes; under "
                        "--launcher ray shm within a node)")
    t.add_argument("--mps", default="off", choices=["auto", "on", "off"],
                   help="where worker processes share a GPU (replicas, MpNd or split on one device), run them under "
                        "a CUDA MPS daemon of this server's own, so their kernels run side by side instead of "
                        "taking turns; elsewhere it does nothing (on: fail if it cannot start; auto: start it when "
                        "nvidia-cuda-mps-control exists)")
    t.add_argument("--pd-pairing", default="least_loaded", choices=["least_loaded", "round_robin"],
                   help="MpNd: how each request's decode engine is picked (least loaded, ties round robin; or round "
                        "robin)")
    t.add_argument("--kv-failure-policy", default="fail", choices=["fail", "recompute"],
                   help="process MpNd: a request whose handoff did not cross (prefill worker died, transfer "
                        "deadline) fails with the reason, or is run again whole on a live decode engine")
    t.add_argument("--code-predictor-stack", action="store_true",
                   help="each one-row code-predictor pass as one persistent launch (CUDA, half precision, "
                        "--mtp-replicas 1; not under MPS co-tenants): a batch-1 frame ~1.05x faster on an H100, logits "
                        "within ~1.5e-2 of the default path's")
    t.add_argument("--mtp-replicas", type=int, default=1,
                   help="code-predictor replicas in each decode engine (own CUDA stream and graph pool each; "
                        "requests pinned by crc32(request id) %% K)")
    g = p.add_argument_group("launcher (docs/ray.md)")
    g.add_argument("--launcher", default="local", choices=["local", "ray"],
                   help="start worker processes as children of the server, or as Ray actors placed through one "
                        "placement group (needs the ray extra; implies --workers process)")
    g.add_argument("--ray-address", default=None,
                   help="join this Ray cluster (host:port of its head); default: start a local one on 127.0.0.1")
    g.add_argument("--ray-placement", default="pack", choices=["pack", "spread"],
                   help="the placement group's strategy: workers packed on as few nodes as fit, or spread over nodes")
    g.add_argument("--ray-node-resource", action="append", default=[], metavar="WORKER=RESOURCE",
                   help="pin a role (replica, prefill, decode, talker, codec, engine) or one worker (e.g. decode0) "
                        "to the nodes that have this custom Ray resource (repeatable)")
    g.add_argument("--ray-cpus-per-worker", type=float, default=1.0, help="CPUs of each worker's Ray bundle")
    e = p.add_argument_group("engine (per worker)")
    e.add_argument("--max-num-seqs", type=int, default=64, help="most requests decoding at once")
    e.add_argument("--max-num-batched-tokens", type=int, default=4096,
                   help="token budget of one engine step (decodes count 1, prefill chunks their length)")
    e.add_argument("--prefill-interval", type=int, default=1,
                   help="waiting prompts join the running batch at most every this many steps (1: every step): "
                        "fewer, larger prefills at high load, up to N - 1 steps more before a request's first "
                        "frame; an engine with nothing decoding admits at once")
    e.add_argument("--max-waiting", type=int, default=1024, help="waiting-queue bound; beyond it: 429")
    e.add_argument("--max-model-len", type=int, default=32768, help="most positions of one request (prompt + frames)")
    e.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="share of the device each engine may use (weights, activations, KV cache)")
    e.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    e.add_argument("--batch-invariant", action="store_true",
                   help="a seeded request's codes never depend on the load or topology, on GPUs too (decode steps "
                        "run in fixed chunks of --invariant-rows rows; costs latency at low load)")
    e.add_argument("--invariant-rows", type=int, default=32, help="decode chunk of --batch-invariant")
    e.add_argument("--first-chunk-frames", type=int, default=1, help="frames in the first audio chunk")
    e.add_argument("--chunk-frames", type=int, default=25, help="frames in each later audio chunk")
    e.add_argument("--voice-cache-size", type=int, default=256,
                   help="reference clips whose voice features are kept (a clip sent again is not re-encoded); 0: off")
    e.add_argument("--chunk-ramp", action=argparse.BooleanOptionalAction, default=True,
                   help="after the first chunk, make each chunk as long as the audio already sent, up to "
                        "--chunk-frames, so real-time playback never runs dry (--no-chunk-ramp: straight to "
                        "--chunk-frames)")
    e.add_argument("--codec-decode-every-step", action=argparse.BooleanOptionalAction, default=True,
                   help="decode every stream's new frames each step in one codec call, holding the audio until "
                        "its chunk is complete (--no-codec-decode-every-step: one call per chunk when due)")
    e.add_argument("--frames-per-text-token", type=float, default=8.0,
                   help="frame cap: a request stops (finish reason `length`) after this many frames per text "
                        "token plus --frame-cap-margin, unless it asks for an exact length; 0: no cap")
    e.add_argument("--frame-cap-margin", type=int, default=50, help="frames added to the frame cap")
    e.add_argument("--codec-full-context", action="store_true",
                   help="stream audio with the codec's full left context instead of the reference's 300-frame "
                        "windows (differs from the reference past 300 frames)")
    r = p.add_argument_group("requests")
    r.add_argument("--max-input-chars", type=int, default=4096, help="longest input, instructions and ref_text")
    r.add_argument("--default-max-new-tokens", type=int, default=None,
                   help="max_new_tokens of a request that gives none (default: none, so such a request runs to EOS, "
                        "its text's frame cap or the room under --max-model-len, whichever comes first; a request cut "
                        "short says which cap cut it: X-Length-Cap, the SSE done event, the log)")
    r.add_argument("--max-new-tokens-limit", type=int, default=4096,
                   help="largest max_new_tokens (and num_frames + 1) a request may ask for")
    r.add_argument("--max-ref-audio-bytes", type=int, default=10 * 1024 * 1024, help="largest reference clip")
    r.add_argument("--max-ref-audio-seconds", type=float, default=60.0, help="longest reference clip")
    # --- prompt-token limit (h-prompt) ---
    r.add_argument("--max-prompt-tokens", type=int, default=None,
                   help="most talker prompt tokens a request may bring (400 prompt_too_long, before the engine). "
                        "Default: what the largest legitimate request needs, --max-input-chars at 3 tokens per "
                        "character (the tokenizer's worst case for text in the model's languages) for the input, "
                        "again for instructions (models that take them) and for ref_text plus "
                        "--max-ref-audio-seconds x 12.5 frames (Base), + 16 template tokens: 12304 for a 0.6B "
                        "CustomVoice, 24592 for a 1.7B CustomVoice or VoiceDesign, 25342 for a Base model")
    # --- end prompt-token limit ---
    r.add_argument("--allowed-local-media-path", default=None,
                   help="directory whose files requests may name as file:// ref_audio (default: none)")
    r.add_argument("--allow-remote-media", action="store_true",
                   help="fetch http(s) ref_audio URLs (from public addresses only)")
    r.add_argument("--remote-media-allow-cidr", action="append", default=[], metavar="CIDR",
                   help="a non-public network remote ref_audio may come from, e.g. an internal media server "
                        "(repeatable; cloud metadata addresses stay refused)")
    r.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds before a request is aborted (0: never)")
    r.add_argument("--shutdown-grace", type=float, default=10.0, help="seconds in-flight requests get on shutdown")
    r.add_argument("--voices-dir", default=None,
                   help="saved voices of a Base model (default: $LEGATO_CACHE/voices/<served name>)")
    r.add_argument("--voice-alias", action="append", default=[], metavar="NAME=VOICE",
                   help="let requests say NAME for VOICE (repeatable; NAME= drops an alias); on top of the default "
                        f"OpenAI names: {', '.join(f'{k}={v}' for k, v in OPENAI_VOICE_ALIASES.items())}")
    p.set_defaults(func=serve, serve_defaults={a.dest: a.default for a in p._actions},
                   serve_checks={a.dest: (a.type, a.choices) for a in p._actions})
    return p


def voice_aliases(items: list[str]) -> dict[str, str]:
    """The default OpenAI aliases with `NAME=VOICE` items applied (`NAME=` removes one)."""
    aliases = dict(OPENAI_VOICE_ALIASES)
    for item in items:
        name, sep, voice = item.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"--voice-alias {item!r}: expected NAME=VOICE")
        if voice.strip():
            aliases[name.strip().lower()] = voice.strip().lower()
        else:
            aliases.pop(name.strip().lower(), None)
    return aliases


def ws_settings(args: argparse.Namespace) -> dict:
    """ServerSettings' WebSocket limits from the --ws-* flags (ValueError naming the flag if one is out of range)."""
    counts = {"--ws-max-message-bytes": args.ws_max_message_bytes, "--ws-max-contexts": args.ws_max_contexts,
              "--ws-send-queue": args.ws_send_queue}
    for flag, value in counts.items():
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    for flag, value in (("--ws-idle-timeout", args.ws_idle_timeout), ("--ws-send-timeout", args.ws_send_timeout)):
        if not (0 < value < float("inf")):
            raise ValueError(f"{flag} must be a positive number of seconds, got {value}")
    return {"ws_max_message_bytes": args.ws_max_message_bytes, "ws_max_contexts": args.ws_max_contexts,
            "ws_idle_timeout_s": args.ws_idle_timeout, "ws_send_queue": args.ws_send_queue,
            "ws_send_timeout_s": args.ws_send_timeout}


_UVICORN_WS_MAX_SIZE = 16 * 1024 * 1024  # uvicorn's own default ws_max_size


def uvicorn_ws_options(args: argparse.Namespace) -> dict:
    """The uvicorn options the --ws-* flags set (the others reach the socket through ServerSettings)."""
    # uvicorn closes a socket (1009) on a message over its ws_max_size before the session sees it: left at its 16 MiB,
    # a --ws-max-message-bytes above that was never reached. A MiB of room over the flag keeps a message just too
    # large within reach of the session, which answers it with its message_too_large event.
    max_size = max(_UVICORN_WS_MAX_SIZE, args.ws_max_message_bytes + 1024 * 1024)
    return {"ws_per_message_deflate": args.ws_per_message_deflate, "ws_max_size": max_size}


def access_settings(args: argparse.Namespace) -> dict:
    """ServerSettings' api_keys, allowed_origins and allowed_hosts from the access flags (ValueError if bad)."""
    import os

    from legato.server.access import LOOPBACK_HOSTS, load_api_keys, origin_key

    env_key = os.environ.get("LEGATO_API_KEY")
    keys = load_api_keys([*args.api_key, *([env_key] if env_key else [])], args.api_key_file)
    origins = tuple(o.strip() for o in args.allowed_origins.split(",") if o.strip())
    for origin in origins:
        if origin != "*" and origin_key(origin) is None:
            raise ValueError(f"--allowed-origins: {origin!r} is not an origin (scheme://host[:port])")
    if args.allowed_hosts is not None:
        names = tuple(h.strip() for h in args.allowed_hosts.split(",") if h.strip())
        hosts = None if "*" in names else names
    elif args.host.strip("[]") in LOOPBACK_HOSTS or args.host.startswith("127."):
        hosts = (*LOOPBACK_HOSTS, args.host)
    else:
        hosts = None
    return {"api_keys": keys, "allowed_origins": origins, "allowed_hosts": hosts,
            "protect_metrics": bool(getattr(args, "protect_metrics", False))}


# What the serve parser adds to its namespace besides the options: never passed on to other fronts, never typed.
PARSE_ONLY = ("serve_defaults", "serve_checks", "serve_given")


def typed_serve_options(argv: list[str]) -> list[str]:
    """The `legato serve` options `argv` names itself (argv from the subcommand on). A deploy file gives way to
    these alone: an option typed with its default value still wins, which comparing values cannot tell."""
    parser = argparse.ArgumentParser(add_help=False)
    serve_parser = add_serve_parser(parser.add_subparsers(dest="command"))
    for action in serve_parser._actions:
        action.default = argparse.SUPPRESS  # only what argv sets reaches the namespace
    named = parser.parse_args(argv)
    return sorted(k for k in vars(named) if k not in ("command", "func", *PARSE_ONLY))


def resolve_workers(workers: str, devices: list[str]) -> str:
    """`--workers auto`: a worker process per engine when any engine is on CUDA, else a thread. On the GPU
    an engine step is a few milliseconds of Python, and sharing one GIL with the HTTP front and its encoders
    cost about a fifth of the throughput at 64 streams (docs/benchmarks.md)."""
    if workers != "auto":
        return workers
    return "process" if any(d.startswith("cuda") for d in devices) else "thread"


def launcher_of(args: argparse.Namespace):
    """The launcher `--launcher` names, with the `--ray-*` options; `--launcher ray` implies process workers.
    Raises LauncherError (one line) when Ray is missing or an option is malformed."""
    from legato.pipeline.launchers import make_launcher, parse_node_resources

    if args.launcher == "local":
        return None
    args.workers = "process"
    return make_launcher(args.launcher, {"address": args.ray_address, "placement": args.ray_placement,
                                         "node_resources": parse_node_resources(args.ray_node_resource),
                                         "cpus_per_worker": args.ray_cpus_per_worker})


def check_devices(devices: list[str], hint: str = "use --device cpu, which also puts every worker of a deploy file "
                                                "on the CPU") -> None:
    """Refuses devices this machine does not have, before anything loads (one line, naming the device; `hint`
    says what to do where there is no CUDA device)."""
    import torch

    for dev in devices:
        try:
            torch.device(dev)
        except RuntimeError:
            raise ValueError(f"device {dev!r} is not a device torch knows (cpu, cuda, cuda:N)") from None
        if not dev.startswith("cuda"):
            continue
        if not torch.cuda.is_available():
            raise ValueError(f"device {dev!r} is a CUDA device, and this machine has no CUDA device ({hint})")
        index = dev.partition(":")[2]
        if index and (not index.isdigit() or int(index) >= torch.cuda.device_count()):
            raise ValueError(f"device {dev!r} does not exist: this machine has {torch.cuda.device_count()} CUDA "
                             "device(s)")


def check_stack_sharing(stack: bool, topology: Topology, devices: list[str], workers: str, mps: str,
                        launcher: str) -> None:
    """Refuses `--code-predictor-stack` where two engines that run the code predictor would share a GPU side by
    side: thread workers (one CUDA context) or worker processes under MPS. The one-launch pass waits at its grid
    barrier until all its programs are resident, so two such passes holding parts of the SMs can keep each other
    waiting until both give up and fail their steps' requests. Worker processes without MPS take turns on a
    shared GPU, whole, and the split topology's codec worker runs no code predictor."""
    if not stack or launcher != "local":  # Ray workers run under their nodes' own settings
        return
    from legato.pipeline.mps import shared_gpus, workers_run_under_mps
    from legato.pipeline.topology import worker_devices

    engines = worker_devices(topology, devices)
    shared = shared_gpus(engines[:1] if topology.kind == "split" else engines)
    if not shared:
        return
    if workers == "thread":
        how = "as threads of one process"
    elif workers_run_under_mps(mps):
        how = "under MPS"
    else:
        return
    raise ValueError(f"--code-predictor-stack: the engines sharing {', '.join(shared)} would run {how}, and its "
                     "one-launch pass needs all its programs on the GPU at once (two such passes can hold each "
                     "other off until both fail their requests); give each engine a GPU of its own, or run "
                     "worker processes with --mps off")


def serve(args: argparse.Namespace) -> int:
    """`legato serve` (its body in `legato.server.serve`, imported only when a server starts)."""
    from legato.server.serve import serve as run

    return run(args)
