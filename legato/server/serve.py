"""`legato serve`'s body: load the configuration, bind the port, build the engine client and the app, start the
other front processes (`--fronts N`), and run uvicorn until a signal drains the server. The options are
`legato.server.cli`'s; this module is imported only when a server starts.
"""

from __future__ import annotations

import argparse
import logging
import re
import signal
import socket
import sys
import threading
from pathlib import Path

import torch
import uvicorn

from legato.engine.config import EngineConfig
from legato.models.qwen3_tts.config import ConfigError
from legato.models.qwen3_tts.default import DEFAULT_MODEL_NAME, cache_dir, default_model_dir
from legato.models.qwen3_tts.loader import load_generation_defaults, load_model, resolve_model_dir
from legato.pipeline import heap
from legato.pipeline.deploy import DeployError, apply_deploy, load_deploy
from legato.pipeline.launchers import LauncherError, LocalLauncher
from legato.pipeline.local import set_gil_switch_interval
from legato.pipeline.mps import MpsDaemon, MpsError, start_for
from legato.pipeline.topology import TopologyError, build_client, parse_topology, worker_devices
from legato.server.app import build_app
from legato.server.body_deadline import BodyTimeoutMiddleware
from legato.server.cli import (
    access_settings,
    check_devices,
    check_stack_sharing,
    launcher_of,
    resolve_workers,
    uvicorn_ws_options,
    voice_aliases,
    ws_settings,
)
from legato.server.connections import check_limits, default_slow_share, guarded_http
from legato.server.fronts import (
    FrontSupervisor,
    bind_front_listeners,
    check_fronts,
    follow_front0,
    metrics_dir,
    remove_metrics_dir,
    resolved_args,
    role_from_env,
)
from legato.server.lifecycle import GracefulServer, Lifecycle, graceful_timeout
from legato.server.listen import bind_listener
from legato.server.logs import configure_logging
from legato.server.prompt_limit import PromptLimit
from legato.server.settings import ServerSettings
from legato.server.stream_response import install_uvicorn_log_filters
from legato.server.voices import VoiceStore

log = logging.getLogger("legato.serve")


def _terminated_while_starting(signum, frame) -> None:
    # Before uvicorn installs its handlers a SIGTERM would end the process on the spot; as an exit, the cleanup
    # of what start-up made so far runs (the MPS daemon, worker processes' links).
    log.warning("terminated while starting")
    raise SystemExit(128 + signum)


def _engine_config(**options) -> EngineConfig:
    """`EngineConfig(**options)`, its refusals in the flags' names ("--max-num-seqs must be ...", not the field's)."""
    try:
        return EngineConfig(**options)
    except ValueError as e:
        raise ValueError(re.sub(r"EngineConfig\.(\w+)", lambda m: "--" + m.group(1).replace("_", "-"), str(e))) from e


def serve(args: argparse.Namespace) -> int:
    role = role_from_env()  # set when front 0 of `--fronts N` started this process
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _terminated_while_starting)
    args.worker_memory = None
    deploy_note = None
    if args.deploy:
        try:
            options = load_deploy(args.deploy, args.serve_defaults, getattr(args, "serve_checks", None))
            deploy_note = apply_deploy(args, options, args.serve_defaults, getattr(args, "serve_given", None))
        except DeployError as e:
            print(f"legato serve: error: {e}", file=sys.stderr)
            return 2
    configure_logging(args.log_format, args.log_level,
                      front=(role.index if role is not None else 0) if getattr(args, "fronts", 1) > 1 else None)
    if deploy_note:
        log.info("%s", deploy_note)
    if args.model_arg is not None:
        if args.model is not None and args.model != args.model_arg:
            print(f"legato serve: error: the model is given twice ({args.model_arg!r} and --model {args.model!r})",
                  file=sys.stderr)
            return 2
        args.model = args.model_arg
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if device.startswith("cuda") else "float32")
    listener = None
    front_sockets: dict = {}
    mps: MpsDaemon | None = None
    try:
        if args.launcher == "local":  # Ray workers run on other nodes: their devices are theirs to check
            check_devices([device, *(args.devices.split(",") if args.devices else [])])
        check_limits(args.timeout_header, args.timeout_body, args.max_connections, args.min_body_rate,
                     args.max_slow_connections_per_client, args.timeout_send)
        topology = parse_topology(args.topology)
        devices = args.devices.split(",") if args.devices else None
        args.workers = resolve_workers(args.workers, devices or [device])
        check_fronts(args.fronts, args.workers, topology.kind, args.launcher, args.topology)
        check_stack_sharing(args.code_predictor_stack, topology, devices or [device], args.workers, args.mps,
                            args.launcher)
        # Before anything loads: a port in use is one line now, not after the model (bound, not yet listening).
        if role is not None:
            listener = socket.socket(fileno=role.fd)
        elif args.fronts > 1:
            listener, *others = bind_front_listeners(args.host, args.port, args.fronts)
            front_sockets = dict(enumerate(others, start=1))
        else:
            listener = bind_listener(args.host, args.port)
        set_gil_switch_interval()  # a bad $LEGATO_GIL_SWITCH_MS is refused here, in one line, not in a worker
        heap.freeze_enabled()  # and a bad $LEGATO_GC_FREEZE, not after the warm-up
        if args.model is None:
            model_path = default_model_dir()
            log.warning("no --model: serving the embedded default %s, which has RANDOM weights (its audio is "
                        "noise); pass --model for real speech", DEFAULT_MODEL_NAME)
            name = args.served_model_name or DEFAULT_MODEL_NAME
        else:
            model_path = args.model
            name = args.served_model_name or _name_of(args.model)
        for flag, value, zero in (("--frames-per-text-token", args.frames_per_text_token, "no cap"),
                                  ("--request-timeout", args.request_timeout, "never")):
            if not 0 <= value < float("inf"):  # a negative one read as "off", which only 0 means
                raise ValueError(f"{flag} must be a number >= 0 (0: {zero}), got {value}")
        engine_config = _engine_config(
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            max_waiting=args.max_waiting, max_model_len=args.max_model_len, prefill_interval=args.prefill_interval,
            gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.enforce_eager,
            first_chunk_frames=args.first_chunk_frames, chunk_frames=args.chunk_frames, device=device, dtype=dtype,
            mtp_replicas=args.mtp_replicas, code_predictor_stack=args.code_predictor_stack,
            chunk_ramp=args.chunk_ramp, voice_cache_size=args.voice_cache_size,
            codec_decode_every_step=args.codec_decode_every_step, codec_dtype=args.codec_dtype,
            batch_invariant=args.batch_invariant, invariant_rows=args.invariant_rows,
            frames_per_text_token=args.frames_per_text_token if args.frames_per_text_token > 0 else None,
            frame_cap_margin=args.frame_cap_margin,
            **({"codec_window_frames": None} if args.codec_full_context else {}),
        )
        voices_dir = args.voices_dir or str(cache_dir() / "voices" / _safe(name))
        if Path(voices_dir).exists() and not Path(voices_dir).is_dir():
            raise ValueError(f"--voices-dir {voices_dir} is a file, not a directory")
        settings = ServerSettings(
            model_name=name, max_input_chars=args.max_input_chars,
            default_max_new_tokens=args.default_max_new_tokens, max_new_tokens_limit=args.max_new_tokens_limit,
            max_ref_audio_bytes=args.max_ref_audio_bytes, max_ref_audio_seconds=args.max_ref_audio_seconds,
            allowed_local_media_path=args.allowed_local_media_path, allow_remote_media=args.allow_remote_media,
            remote_media_allow_cidrs=tuple(args.remote_media_allow_cidr),
            request_timeout_s=args.request_timeout if args.request_timeout > 0 else None,
            shutdown_grace_s=args.shutdown_grace, voices_dir=voices_dir, voice_aliases=voice_aliases(args.voice_alias),
            max_prompt_tokens=args.max_prompt_tokens, **access_settings(args), **ws_settings(args),
        )
        # The front counts prompt tokens with the tokenizer alone; the engines hold the same limit at admission.
        prompt_limit = PromptLimit.from_model_dir(resolve_model_dir(model_path), settings, engine_config)
        engine_config.max_prompt_tokens = prompt_limit.limit
        settings.max_num_seqs = args.max_num_seqs
        settings.decode_slots = args.max_num_seqs * topology.decode_engines
        settings.freeze_heap = any(d.startswith("cuda") for d in devices or [device])
        generation_defaults: dict = {}

        def load(dev: str):
            loaded = load_model(model_path, device=dev, dtype=getattr(torch, dtype))
            generation_defaults.update(loaded.generation_defaults)
            return loaded

        launcher = launcher_of(args)
        if role is None:  # front 0 starts the workers; the other fronts only connect to them
            mps = start_for(args.mps, worker_devices(topology, devices or [device]), args.workers == "process",
                            args.launcher == "local")
            if mps is not None:
                launcher = LocalLauncher(env=mps.env)
        instance_id, fronts = None, {}
        if args.fronts > 1:
            from legato.pipeline.process_client import new_instance_id

            instance_id = role.instance_id if role is not None else new_instance_id()
            fronts = {"process_options": {"front": role.index if role is not None else 0, "fronts": args.fronts}}
        client = build_client(topology, load, engine_config, devices=devices, name=name, workers=args.workers,
                              model_path=model_path, memory_shares=args.worker_memory, kv_backend=args.kv_transfer,
                              pairing=args.pd_pairing, on_kv_failure=args.kv_failure_policy, launcher=launcher,
                              instance_id=instance_id, **fronts)
        if args.workers == "process":  # the workers load the model; its generation defaults come from disk
            generation_defaults.update(load_generation_defaults(resolve_model_dir(model_path)))
    except (ConfigError, TopologyError, LauncherError, MpsError, ValueError) as e:
        for sock in (listener, *front_sockets.values()):
            if sock is not None:
                sock.close()
        if mps is not None:
            mps.stop()
        print(f"legato serve: error: {e}", file=sys.stderr)
        return 2
    settings.generation_defaults = generation_defaults
    # Front 0 of several: the fronts' metrics meet in one directory (made before any metric exists).
    metrics_path = metrics_dir() if args.fronts > 1 and role is None else None
    # Holds voices only for Base models (lists and refuses otherwise); the fronts of --fronts N share them.
    store = VoiceStore(voices_dir, client, shared=args.fronts > 1, tidy=role is None)
    lifecycle = Lifecycle(client, settings.shutdown_grace_s)
    install_uvicorn_log_filters()
    app = BodyTimeoutMiddleware(build_app(client, settings, store, lifecycle, prompt_limit), args.timeout_body,
                                args.min_body_rate)
    slow_share = args.max_slow_connections_per_client or default_slow_share(args.max_connections)
    # Each front holds its share of the connection limits (the kernel spreads connections evenly).
    max_connections = -(-args.max_connections // args.fronts)
    slow_share = -(-slow_share // args.fronts)
    # uvicorn's limit counts the connection asking too, so one more lets exactly --max-connections in.
    config = uvicorn.Config(app, host=args.host, port=args.port, log_config=None, lifespan="on",
                            http=guarded_http(args.timeout_header, slow_share, parser=args.http,
                                              send_timeout_s=args.timeout_send),
                            limit_concurrency=max_connections + 1,
                            **uvicorn_ws_options(args),
                            timeout_graceful_shutdown=graceful_timeout(settings.shutdown_grace_s))
    port = listener.getsockname()[1]
    server = GracefulServer(config, lifecycle)
    supervisor = None
    if role is not None:
        follow_front0(role.parent_pid, server.request_drain)
    elif front_sockets:
        supervisor = FrontSupervisor(resolved_args(args), args.host, port, args.fronts, instance_id,
                                     on_give_up=lambda: server.request_drain(failed=True))
        server.on_signal = supervisor.drain_all
        supervisor.start(front_sockets)
    front = f", front {role.index} of {role.count}" if role is not None else (
        f", front 0 of {args.fronts}" if args.fronts > 1 else "")
    where = f"http://{args.host}:{port}"
    log.info("starting %s (model %s, %s, %s on %s, topology %s%s): it takes connections once the engine runs",
             where, name, client.info.model_type, dtype, devices or device, topology, front)
    # Said once connections are taken: the port is bound from the start, but refuses them until then.
    server.on_started = lambda: log.info("listening on %s", where)
    try:
        server.run(sockets=[listener])
    except KeyboardInterrupt:  # a Ctrl-C before the server installed its handlers; nothing left to report
        return 130
    finally:
        if supervisor is not None:
            supervisor.stop(graceful_timeout(settings.shutdown_grace_s))
        if metrics_path is not None:
            remove_metrics_dir(metrics_path)
        if mps is not None:  # after the workers are gone (the server's shutdown stopped them)
            mps.stop()
    return 1 if server.gave_up else 0


def _name_of(model: str) -> str:
    """A local directory is named by its last component, a hub id by itself."""
    path = Path(model).expanduser()
    return path.resolve().name if path.is_dir() else model


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", name)
