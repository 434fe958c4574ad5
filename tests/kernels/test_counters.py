"""The zeroed word pools that kernels leave zero: one set per (device, stream), sized once, refusing more."""

from __future__ import annotations

import pytest
import torch

from kernels.counters import CounterPool


def test_a_pool_gives_one_zeroed_set_per_stream_and_refuses_more_words_than_it_holds() -> None:
    """A pool hands the same zeroed tensor to every call on a stream, and names its owner when a call needs more."""
    pool = CounterPool(8, "owner", "test words")
    words = pool.get(torch.device("cpu"), 8)
    assert words.dtype == torch.int32 and words.shape == (8,) and not words.any()
    assert pool.get(torch.device("cpu"), 3) is words
    with pytest.raises(ValueError, match="owner: 9 test words exceed the 8 words of its zeroed pool"):
        pool.get(torch.device("cpu"), 9)
