"""Graphs are captured with the garbage collector paused: a collection that destroys an earlier model's CUDA graph
during a capture ends that capture with an error. On a GPU, captures are watched with collections forced often."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import gc
import weakref

import pytest
import torch
from make_checkpoint import make_checkpoint

from model import kernel_path
from model.graphs import collector_paused
from model.weights import load_model
from tests.tiny import KERNEL_TEXT, text_config


class Node:
    """An object a weak reference can watch."""


def cyclic_garbage() -> weakref.ref[Node]:
    """A weak reference to an object only a collection can free (it refers to itself)."""
    node = Node()
    node.itself = node  # type: ignore[attr-defined]
    return weakref.ref(node)


@pytest.mark.parametrize("enabled_before", [True, False])
def test_the_collector_collects_on_entry_stays_off_inside_and_is_restored_after(enabled_before) -> None:
    """...even when the block raises."""
    try:
        if not enabled_before:
            gc.disable()
        garbage = cyclic_garbage()
        with pytest.raises(RuntimeError, match="inside"), collector_paused():
            assert garbage() is None and not gc.isenabled()
            raise RuntimeError("inside")
        assert gc.isenabled() == enabled_before
    finally:
        gc.enable()


@pytest.mark.gpu
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="needs compiled kernels")
def test_no_collection_runs_during_a_capture_with_an_earlier_models_graphs_in_garbage(tmp_path) -> None:
    path = make_checkpoint(text_config("base", **KERNEL_TEXT), tmp_path, fmt="bf16")

    def graphed_model():
        model = load_model(path, "cuda", "bfloat16", kernels="on")
        kernel_path.lane_pool(model, slots=4, context=64)
        kernel_path.enable_graphs(model, {"trunk": 8, "verify": 8, "prompt": 16, "mtp": 8}, listed_logits=8)
        return model

    cycle: list[object] = [graphed_model()]
    cycle.append(cycle)  # the earlier model, graphs and all, is garbage only a collection frees
    del cycle
    capturing_at_collections: list[bool] = []

    def watch(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            capturing_at_collections.append(torch.cuda.is_current_stream_capturing())

    thresholds = gc.get_threshold()
    gc.callbacks.append(watch)
    gc.set_threshold(1, 1, 1)  # a collection at almost every allocation
    try:
        model = graphed_model()
    finally:
        gc.set_threshold(*thresholds)
        gc.callbacks.remove(watch)
    assert model.round_graphs.graphs and capturing_at_collections
    assert not any(capturing_at_collections)
