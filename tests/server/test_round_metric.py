"""The engine times each round into flashnext:round_seconds."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from model.weights import load_model
from rankwire.header import DrawSpec
from server.engine import Engine, Request
from server.metrics import EngineMetrics
from server.runner import ModelRunner
from tests.server.engine_harness import Outcome
from tests.tiny import checkpoint


def test_every_round_is_timed_and_shows_in_metrics(tmp_path):
    model = load_model(checkpoint(tmp_path / "m"), dtype="float32")
    metrics = EngineMetrics("m")
    engine = Engine(ModelRunner(model, 1), context=256, prompt_budget=4, metrics=metrics)
    outcome = Outcome()
    engine.start()
    try:
        engine.submit(Request("r", [5, 9, 14, 3, 22, 8], 3, DrawSpec(0.0, 0, 1.0, 0.0, 1), frozenset(), outcome.sink))
        assert outcome.done.wait(120)
    finally:
        engine.stop()
    families = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}
    samples = {s.name: s.value for s in families["flashnext:round_seconds"].samples}
    # a 6-token prompt at 4 tokens a round takes two rounds, and the last of 3 tokens comes one round after the first
    assert samples["flashnext:round_seconds_count"] >= 4
    assert samples["flashnext:round_seconds_sum"] > 0
