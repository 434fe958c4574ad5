"""Which Triton kernels a call launches, recorded under the interpreter."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from unittest import mock

import triton


@contextmanager
def recording_launches() -> Iterator[list[str]]:
    """Within: the name of every Triton kernel launched, in order."""
    names: list[str] = []
    real_run = triton.runtime.interpreter.InterpretedFunction.run

    def run(self, *args, **kwargs):
        names.append(self.fn.__name__)
        return real_run(self, *args, **kwargs)

    with mock.patch.object(triton.runtime.interpreter.InterpretedFunction, "run", run):
        yield names
