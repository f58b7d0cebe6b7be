"""`/metrics`: the server's state in Prometheus' text format, with vLLM's set of metrics
under eqrope's prefix (`vllm:num_requests_running` is `eqrope_requests_running`, ...).

Gauges are set by the engine's thread after every step, from `Engine.stats`; the token
counters and the latency histograms are observed by the HTTP side, which sees each
request arrive and each of its tokens leave. Every metric has a `model_name` label.
"""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


# vLLM's buckets (vllm/v1/metrics/loggers.py), in seconds.
_TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
_ITL = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
_E2E = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip


class Metrics:
    """The server's metrics, in a registry of its own (so that two servers in one process
    do not share counters)."""

    def __init__(self, model_name: str):
        self.registry = r = CollectorRegistry()
        m = ["model_name"]
        self.running = Gauge("eqrope_requests_running", "Samples in the engine's slots, and prompts being prefilled.", m, registry=r)
        self.waiting = Gauge("eqrope_requests_waiting", "Requests waiting for a slot.", m, registry=r)
        self.kv_usage = Gauge("eqrope_kv_cache_usage_ratio", "Pages of the key/value pool held by requests, over all pages (0 to 1).", m, registry=r)
        self.prompt_tokens = Counter("eqrope_prompt_tokens", "Prompt tokens of the requests taken.", m, registry=r)
        self.generation_tokens = Counter("eqrope_generation_tokens", "Tokens generated.", m, registry=r)
        self.success = Counter("eqrope_request_success", "Samples finished, by finish reason.", [*m, "finished_reason"], registry=r)
        self.ttft = Histogram("eqrope_time_to_first_token_seconds", "From a request's arrival to its first token.", m, buckets=_TTFT, registry=r)
        self.itl = Histogram("eqrope_inter_token_latency_seconds", "Between a sample's tokens (a chunk of k tokens after a gap g counts k times g / k).", m, buckets=_ITL, registry=r)
        self.e2e = Histogram("eqrope_e2e_request_latency_seconds", "From a request's arrival to its last token.", m, buckets=_E2E, registry=r)
        self.labels = {"model_name": model_name}
        for metric in (self.running, self.waiting, self.kv_usage, self.prompt_tokens, self.generation_tokens):
            metric.labels(**self.labels)  # shown at 0 before the first request

    def on_step(self, stats, events, now: float) -> None:
        """After an engine step, on the engine's thread."""
        self.running.labels(**self.labels).set(stats.running + stats.prefilling)
        self.waiting.labels(**self.labels).set(stats.waiting)
        self.kv_usage.labels(**self.labels).set(stats.pages_used / max(stats.pages_total, 1))
        self.generation_tokens.labels(**self.labels).inc(sum(len(e.tokens) for e in events))

    def finished(self, reason: str) -> None:
        self.success.labels(finished_reason=reason, **self.labels).inc()
