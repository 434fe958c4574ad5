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
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0)


def token_buckets(limit: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` tokens (vLLM's buckets for its per-request token histograms)."""
    buckets, scale = [], 1
    while True:
        for step in (1, 2, 5):
            if step * scale > limit:
                return tuple(buckets)
            buckets.append(step * scale)
        scale *= 10


class CollectiveCollector(Collector):
    """This rank's tensor-parallel collectives, read at scrape time: calls and bytes sent to peers, by op."""

    def __init__(self, counts: CollectiveCounts, model_name: str) -> None:
        self.counts, self.model_name = counts, model_name

    def collect(self) -> Iterator[CounterMetricFamily]:
        labels = ["model_name", "op"]
        calls = CounterMetricFamily("flashnext:collectives", "Tensor-parallel collectives on this rank", labels=labels)
        sent = CounterMetricFamily(
            "flashnext:collective_bytes", "Bytes of this rank's data sent to its peers by collectives", labels=labels
        )
        for op, count in self.counts.calls.items():
            calls.add_metric([self.model_name, op], count)
            sent.add_metric([self.model_name, op], self.counts.bytes[op])
        yield calls
        yield sent


class CacheCollector(Collector):
    """The prompt cache's running totals, read at scrape time, as vLLM's counters: prompt tokens looked up, and those
    found kept."""

    def __init__(self, cache, model_name: str) -> None:
        self.cache, self.model_name = cache, model_name

    def collect(self) -> Iterator[CounterMetricFamily]:
        hits = self.cache.cached_tokens  # read first: a lookup between the reads adds to queries, never hits alone
        for name, what, value in (
            ("queries", "Prompt tokens looked up in the prompt cache", self.cache.queried_tokens),
            ("hits", "Prompt tokens found in the prompt cache", hits),
        ):
            family = CounterMetricFamily(f"flashnext:prefix_cache_{name}", what, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family


class EngineMetrics:
    """The counters and histograms the engine and the front end update, each labelled with the served model's name
    (as vLLM's are, which its dashboards select by)."""

    def __init__(self, model_name: str, context: int = 2**20) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        labels = {"model_name": model_name}
        names = list(labels)

        def labelled(kind, name: str, what: str, **options):
            """A metric of `kind` whose one series is this model's."""
            return kind(name, what, names, registry=self.registry, **options).labels(**labels)

        self.running = labelled(Gauge, "flashnext:num_requests_running", "Requests holding a lane")
        self.waiting = labelled(Gauge, "flashnext:num_requests_waiting", "Requests waiting for a lane")
        self.prompt_tokens = labelled(Counter, "flashnext:prompt_tokens", "Prompt tokens admitted")
        self.generation_tokens = labelled(Counter, "flashnext:generation_tokens", "Tokens generated")
        self.time_to_first_token = labelled(
            Histogram, "flashnext:time_to_first_token_seconds", "Arrival to first token", buckets=LATENCY_BUCKETS
        )
        self.inter_token_latency = labelled(
            Histogram,
            "flashnext:inter_token_latency_seconds",
            "Time between a request's tokens",
            buckets=LATENCY_BUCKETS,
        )
        self.e2e_request_latency = labelled(
            Histogram, "flashnext:e2e_request_latency_seconds", "Arrival to a request's end", buckets=REQUEST_BUCKETS
        )
        self.request_prompt_tokens = labelled(
            Histogram,
            "flashnext:request_prompt_tokens",
            "Prompt tokens of each ended request",
            buckets=token_buckets(context),
        )
        self.request_generation_tokens = labelled(
            Histogram,
            "flashnext:request_generation_tokens",
            "Tokens generated for each ended request",
            buckets=token_buckets(context),
        )
        self.round_seconds = labelled(
            Histogram,
            "flashnext:round_seconds",
            "Wall time of one engine round on rank 0: plan, forward, tokens handed out",
            buckets=ROUND_BUCKETS,
        )
        self.draft_tokens = labelled(Counter, "flashnext:spec_decode_num_draft_tokens", "Draft tokens verified")
        self.accepted_tokens = labelled(Counter, "flashnext:spec_decode_num_accepted_tokens", "Draft tokens accepted")
        self.draft_tokens_per_pos = Counter(
            "flashnext:spec_decode_num_draft_tokens_per_pos",
            "Draft tokens verified, by position in the window",
            [*names, "position"],
            registry=self.registry,
        )
        self.accepted_tokens_per_pos = Counter(
            "flashnext:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by position in the window",
            [*names, "position"],
            registry=self.registry,
        )
        reasons = [*names, "finished_reason"]
        self.finished = Counter(
            "flashnext:request_success", "Requests ended, by reason", reasons, registry=self.registry
        )
        self.model_info = Gauge("flashnext:model_info", "The served model", names, registry=self.registry)
        self.model_info.labels(**labels).set(1)

    def count_drafts(self, drafted: int, accepted: int) -> None:
        """One verified window: `drafted` drafts, the first `accepted` of them kept."""
        self.draft_tokens.inc(drafted)
        self.accepted_tokens.inc(accepted)
        for position in range(drafted):
            self.draft_tokens_per_pos.labels(model_name=self.model_name, position=str(position)).inc()
            if position < accepted:
                self.accepted_tokens_per_pos.labels(model_name=self.model_name, position=str(position)).inc()

    def count_end(self, reason: str | None, seconds: float, prompt_tokens: int, generated: int) -> None:
        """A request ended for `reason` after `seconds` from its arrival, with its prompt's and its output's tokens."""
        self.finished.labels(model_name=self.model_name, finished_reason=reason).inc()
        self.e2e_request_latency.observe(seconds)
        self.request_prompt_tokens.observe(prompt_tokens)
        self.request_generation_tokens.observe(generated)

    def track_cache(self, cache) -> None:
        """Read the prompt cache's figures at scrape time."""
        self.registry.register(CacheCollector(cache, self.model_name))
        for name, what, read in (
            ("bytes", "Memory held by kept prompt states on rank 0", lambda: cache.nbytes),
            ("entries", "Kept prompt states", lambda: len(cache.entries)),
        ):
            gauge = Gauge(f"flashnext:prefix_cache_{name}", what, ["model_name"], registry=self.registry)
            gauge.labels(model_name=self.model_name).set_function(read)

    def track_collectives(self, counts: CollectiveCounts) -> None:
        """Read the model's collective counts at scrape time."""
        self.registry.register(CollectiveCollector(counts, self.model_name))

    def track_counts(self, counts: Callable[[], tuple[int, int]]) -> None:
        """Read running/waiting from the engine at scrape time."""
        self.running.set_function(lambda: counts()[0])
        self.waiting.set_function(lambda: counts()[1])

    def render(self) -> bytes:
        return generate_latest(self.registry)
