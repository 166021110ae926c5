"""Prometheus metrics of the consumer service (``decode --serve``; ``prometheus_client``,
imported only here and only when the service starts, into a registry of its own, served as
text format): TTFT and per-token latency by source, bytes shipped, rows held, fallbacks by
reason, gate refusals, producer health, queue depth, requests by status, the budget split. The resident
producer's (``prefill --serve --metrics``) are :mod:`muser_cli.pulllane.metrics`."""

from __future__ import annotations

from muser_cli.pulllane.metrics import LATENCY_BUCKETS

_TOKEN = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1)


def fallback_kind(reason: str) -> str:
    """A short label for why a request did not get (all of) its rows from a producer."""
    r = reason.lower()
    for key, label in (("broke its promise", "hedge"), ("route:", "route"), ("no producer", "no_producer"),
                       ("deadline", "deadline"), ("timed out", "deadline"),
                       ("cut stream", "cut"), ("refused", "refused"), ("busy", "busy"), ("failed", "pull_failed")):
        if key in r:
            return label
    return "other"


class ConsumerMetrics:
    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = r = CollectorRegistry()
        self.ttft = Histogram("muser_ttft_seconds", "Request arrival to its first token, by where the rows came from",
                              ["source"], buckets=LATENCY_BUCKETS, registry=r)
        self.token = Histogram("muser_token_latency_seconds", "Time between consecutive tokens, by source",
                               ["source"], buckets=_TOKEN, registry=r)
        self.shipped = Counter("muser_shipped_bytes", "Pack bytes received from producers", ["producer"], registry=r)
        self.held = Counter("muser_rows_held", "Prompt rows taken from this machine's store", registry=r)
        self.computed = Counter("muser_rows_computed", "Prompt rows prefilled on this machine", registry=r)
        self.fallbacks = Counter("muser_fallbacks", "Requests prefilled here (all or part), by reason", ["reason"],
                                 registry=r)
        self.gate = Counter("muser_gate_refusals", "Packs refused by a check (binding, numeric gate, merge)",
                            registry=r)
        self.producer_up = Gauge("muser_producer_up", "1 when the producer's last pull succeeded, else 0",
                                 ["producer"], registry=r)
        self.queue = Gauge("muser_queue_depth", "Requests waiting for the engine", registry=r)
        self.running = Gauge("muser_running", "Requests running (sequences taking the engine's turns)", registry=r)
        self.batch = Histogram("muser_batch_size", "Sequences running at each decode step or prefill chunk",
                               buckets=(1, 2, 4, 8, 16, 32, 64), registry=r)
        self.requests = Counter("muser_requests", "Requests answered, by endpoint and HTTP status",
                                ["endpoint", "status"], registry=r)
        self.tokens = Counter("muser_generated_tokens", "Tokens generated", registry=r)
        self.store_errors = Counter("muser_store_errors", "Answers whose rows the store could not keep (the answer "
                                    "was given)", registry=r)
        # issue #39: each answer's budget split, and the component that overran its budget
        self.budget = Histogram("muser_budget_seconds", "Each answer's TTFT, by component of the budget split",
                                ["component"], buckets=LATENCY_BUCKETS, registry=r)
        self.overruns = Counter("muser_budget_overruns", "Answers over their budget, by the component that overran",
                                ["component"], registry=r)

    def observe_budget(self, split: dict[str, float], over: str | None) -> None:
        for component, seconds in split.items():
            self.budget.labels(component).observe(max(0.0, float(seconds)))
        if over:
            self.overruns.labels(over).inc()

    def text(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST

