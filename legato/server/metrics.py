"""Prometheus metrics of one server, in a registry of its own (two apps in one process never share one).

Latency histograms are observed by the speech route as requests progress; the engine's gauges (queue
depth, running requests, KV usage) are read from `EngineClient.stats()` at scrape time, so they are never
stale and cost nothing between scrapes.

Routers that balance model servers (llm-d's endpoint picker, the Gateway API inference extension, others)
score them on vLLM's metric names, so the same figures are also exported under those names and meanings,
with vLLM's `model_name` label: `vllm:num_requests_waiting`, `vllm:num_requests_running`,
`vllm:kv_cache_usage_perc` (a fraction in [0, 1], as vLLM's; also as the older `vllm:gpu_cache_usage_perc`),
`vllm:time_to_first_token_seconds` (our time to first audio) and `vllm:e2e_request_latency_seconds`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
    values,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from legato.pipeline.client import EngineClient

# Seconds; TTFP spans a few ms (tiny model on a GPU) to seconds (long prompts under load).
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_RTF_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 5.0, 10.0)


class ServerMetrics:
    """What /metrics exposes. `mode` labels are file | audio | sse (how the response was delivered).

    `legato_requests_total{status}` counts finished speech requests by the HTTP status they ended with;
    a stream that failed after its 200 header counts as the status it would have had (500 error,
    504 timeout, 503 shutdown), and a client that left mid-request as 499."""

    def __init__(self, client: EngineClient, model_name: str = "") -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        # `--fronts N` (fronts.py): every front writes its figures to files in this directory, and a scrape of any
        # front adds them all up; the engine's gauges are read from this front's link as always.
        self.multiprocess_dir = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        if self.multiprocess_dir and values.ValueClass is values.MutexValue:
            values.ValueClass = values.get_value_class()  # prometheus_client was imported before the variable
        self.ttfp = Histogram(
            "legato_time_to_first_audio_seconds", "Request arrival to the first audio byte ready to send.",
            ["mode"], buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.e2e = Histogram(
            "legato_e2e_latency_seconds", "Request arrival to the last audio byte.", ["mode"],
            buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.rtf = Histogram(
            "legato_real_time_factor", "End-to-end latency divided by the audio duration produced.", ["mode"],
            buckets=_RTF_BUCKETS, registry=self.registry)
        self.requests = Counter(
            "legato_requests", "Speech requests by final status (refusals included).", ["status"],
            registry=self.registry)
        self.aborts = Counter(
            "legato_request_aborts", "Speech requests the server aborted, by reason.", ["reason"],
            registry=self.registry)
        self.audio_seconds = Counter(
            "legato_audio_seconds", "Seconds of audio produced.", registry=self.registry)
        # The streaming-text WebSocket (ws_session.py).
        self.ws_sockets = Gauge("legato_ws_open_sockets", "Streaming-text WebSockets open.", registry=self.registry,
                                multiprocess_mode="livesum")
        self.ws_contexts = Gauge("legato_ws_contexts", "Streaming-text contexts open on all sockets.",
                                 registry=self.registry, multiprocess_mode="livesum")
        self.ws_cancels = Counter("legato_ws_cancels", "Streaming-text contexts cancelled by their client "
                                  "(response.cancel).", registry=self.registry)
        self.ws_refused = Counter("legato_ws_refused_messages", "Streaming-text client messages answered with an "
                                  "error event, by code.", ["code"], registry=self.registry)
        self.ws_slow_closes = Counter("legato_ws_slow_client_closes", "Streaming-text sockets closed because the "
                                      "client stopped reading.", registry=self.registry)
        # vLLM's names, for routers (one observation each, beside ours: see the module doc).
        self.vllm_ttft = Histogram(
            "vllm:time_to_first_token_seconds", "Time to first audio (vLLM's name: routers read it).",
            ["model_name"], buckets=_LATENCY_BUCKETS, registry=self.registry).labels(model_name)
        self.vllm_e2e = Histogram(
            "vllm:e2e_request_latency_seconds", "End-to-end latency of successful requests (vLLM's name).",
            ["model_name"], buckets=_LATENCY_BUCKETS, registry=self.registry).labels(model_name)
        self.engine = _EngineCollector(client, model_name)
        self.registry.register(self.engine)

    def observe_ttfp(self, mode: str, seconds: float) -> None:
        self.ttfp.labels(mode).observe(seconds)
        self.vllm_ttft.observe(seconds)

    def observe_e2e(self, mode: str, seconds: float) -> None:
        self.e2e.labels(mode).observe(seconds)
        self.vllm_e2e.observe(seconds)

    def render(self) -> tuple[bytes, str]:
        if not self.multiprocess_dir:
            return generate_latest(self.registry), CONTENT_TYPE_LATEST
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, self.multiprocess_dir)
        registry.register(self.engine)
        return generate_latest(registry), CONTENT_TYPE_LATEST


class _EngineCollector(Collector):
    """Engine gauges read at scrape time."""

    def __init__(self, client: EngineClient, model_name: str) -> None:
        self.client = client
        self.model_name = model_name

    def describe(self) -> list:
        return []  # dynamic: read at collect time

    def collect(self) -> Iterator:
        s = self.client.stats()
        yield GaugeMetricFamily("legato_num_requests_waiting", "Requests in the engine's waiting queue.",
                                value=s.waiting)
        yield GaugeMetricFamily("legato_num_requests_running", "Requests holding an engine slot.",
                                value=s.running)
        yield GaugeMetricFamily("legato_kv_cache_usage_ratio", "Fraction of KV blocks in use.", value=s.kv_usage)
        yield GaugeMetricFamily("legato_kv_cache_free_blocks", "Free KV blocks.", value=s.free_kv_blocks)
        yield GaugeMetricFamily("legato_engines_down", "Engines of the deployment found dead (their blocks are not "
                                "counted as free).", value=s.engines_down)
        engine_aborts = CounterMetricFamily("legato_engine_aborts", "Requests the engine aborted, by reason.",
                                            labels=["reason"])
        for reason, count in sorted(s.aborted.items()):
            engine_aborts.add_metric([reason], count)
        yield engine_aborts
        yield CounterMetricFamily("legato_kv_handoffs_recomputed", "Process MpNd: requests whose KV handoff "
                                  "failed and that were run again on a decode engine (--kv-failure-policy).",
                                  value=s.recomputed)
        for name, doc, value in (
            ("legato_engine_steps", "Engine steps run.", s.steps),
            ("legato_engine_decode_rows", "Streams decoded, summed over engine steps (per step: the streams a "
             "step carries).", s.decode_rows),
            ("legato_engine_step_host_seconds", "Host time spent in engine steps.", s.step_host_s),
            ("legato_engine_step_gpu_seconds", "Device time of the engine steps' work on the compute stream.",
             s.step_gpu_s),
            ("legato_engine_step_gap_seconds", "Device idle time between engine steps (host work not hidden).",
             s.step_gap_s),
            ("legato_engine_loop_other_seconds", "Host time of the engine loop outside its steps while work runs "
             "(inbox, handing outputs to the event loop, stats).", s.loop_other_s),
        ):
            yield CounterMetricFamily(name, doc, value=value)
        yield GaugeMetricFamily("legato_num_requests_waiting_for_text", "Running requests whose text has not "
                                "arrived (streaming text): they hold their state and sit out decode steps.",
                                value=s.waiting_for_text)
        yield CounterMetricFamily("legato_text_wait_seconds", "Seconds streaming-text requests sat out decode steps "
                                  "waiting for text, summed over requests.", value=s.text_wait_s)
        busy = s.step_gpu_s + s.step_gap_s
        yield GaugeMetricFamily("legato_gpu_busy_ratio", "Device time over device time plus the gaps between "
                                "steps, since start (0 before the first GPU step).",
                                value=s.step_gpu_s / busy if busy > 0 else 0.0)
        for name, doc, value in (
            ("vllm:num_requests_waiting", "Requests waiting to be scheduled (vLLM's name).", s.waiting),
            ("vllm:num_requests_running", "Requests running on the engine (vLLM's name).", s.running),
            ("vllm:kv_cache_usage_perc", "KV-cache usage, 1 = 100 % (vLLM's name).", s.kv_usage),
            ("vllm:gpu_cache_usage_perc", "KV-cache usage, 1 = 100 % (vLLM's older name).", s.kv_usage),
        ):
            gauge = GaugeMetricFamily(name, doc, labels=["model_name"])
            gauge.add_metric([self.model_name], value)
            yield gauge
