"""Prometheus metrics, named like vLLM's with a `flashnext:` prefix, in a registry per server."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from model.parallel import CollectiveCounts

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ROUND_BUCKETS = tuple(round(0.001 * 1.25**i, 6) for i in range(42))  # 1 ms to 9.4 s, 25% apart


class CollectiveCollector(Collector):
    """This rank's tensor-parallel collectives, read at scrape time: calls and bytes sent to peers, by op."""

    def __init__(self, counts: CollectiveCounts) -> None:
        self.counts = counts

    def collect(self) -> Iterator[CounterMetricFamily]:
        calls = CounterMetricFamily("flashnext:collectives", "Tensor-parallel collectives on this rank", labels=["op"])
        sent = CounterMetricFamily(
            "flashnext:collective_bytes", "Bytes of this rank's data sent to its peers by collectives", labels=["op"]
        )
        for op, count in self.counts.calls.items():
            calls.add_metric([op], count)
            sent.add_metric([op], self.counts.bytes[op])
        yield calls
        yield sent


class EngineMetrics:
    """The counters and histograms the engine and the front end update."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}
        self.running = Gauge("flashnext:num_requests_running", "Requests holding a lane", registry=self.registry)
        self.waiting = Gauge("flashnext:num_requests_waiting", "Requests waiting for a lane", registry=self.registry)
        self.prompt_tokens = Counter("flashnext:prompt_tokens", "Prompt tokens admitted", registry=self.registry)
        self.generation_tokens = Counter("flashnext:generation_tokens", "Tokens generated", registry=self.registry)
        self.time_to_first_token = Histogram(
            "flashnext:time_to_first_token_seconds",
            "Arrival to first token",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.inter_token_latency = Histogram(
            "flashnext:inter_token_latency_seconds",
            "Time between a request's tokens",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.round_seconds = Histogram(
            "flashnext:round_seconds",
            "Wall time of one engine round on rank 0: plan, forward, tokens handed out",
            buckets=ROUND_BUCKETS,
            registry=self.registry,
        )
        self.draft_tokens = Counter(
            "flashnext:spec_decode_num_draft_tokens", "Draft tokens verified", registry=self.registry
        )
        self.accepted_tokens = Counter(
            "flashnext:spec_decode_num_accepted_tokens", "Draft tokens accepted", registry=self.registry
        )
        self.draft_tokens_per_pos = Counter(
            "flashnext:spec_decode_num_draft_tokens_per_pos",
            "Draft tokens verified, by position in the window",
            ["position"],
            registry=self.registry,
        )
        self.accepted_tokens_per_pos = Counter(
            "flashnext:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by position in the window",
            ["position"],
            registry=self.registry,
        )
        self.finished = Counter(
            "flashnext:request_success", "Requests ended, by reason", ["finished_reason"], registry=self.registry
        )
        self.model_info = Gauge("flashnext:model_info", "The served model", list(labels), registry=self.registry)
        self.model_info.labels(**labels).set(1)

    def count_drafts(self, drafted: int, accepted: int) -> None:
        """One verified window: `drafted` drafts, the first `accepted` of them kept."""
        self.draft_tokens.inc(drafted)
        self.accepted_tokens.inc(accepted)
        for position in range(drafted):
            self.draft_tokens_per_pos.labels(position=str(position)).inc()
            if position < accepted:
                self.accepted_tokens_per_pos.labels(position=str(position)).inc()

    def track_cache(self, cache) -> None:
        """Read the prompt cache's figures at scrape time."""
        for name, what, read in (
            ("queries", "Prompt cache lookups", lambda: cache.queries),
            ("hits", "Prompt cache lookups that resumed a kept state", lambda: cache.hits),
            ("cached_tokens", "Prompt tokens served from kept states", lambda: cache.cached_tokens),
            ("bytes", "Memory held by kept prompt states on rank 0", lambda: cache.nbytes),
            ("entries", "Kept prompt states", lambda: len(cache.entries)),
        ):
            Gauge(f"flashnext:prefix_cache_{name}", what, registry=self.registry).set_function(read)

    def track_collectives(self, counts: CollectiveCounts) -> None:
        """Read the model's collective counts at scrape time."""
        self.registry.register(CollectiveCollector(counts))

    def track_counts(self, counts: Callable[[], tuple[int, int]]) -> None:
        """Read running/waiting from the engine at scrape time."""
        self.running.set_function(lambda: counts()[0])
        self.waiting.set_function(lambda: counts()[1])

    def render(self) -> bytes:
        return generate_latest(self.registry)
