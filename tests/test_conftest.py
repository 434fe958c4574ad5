"""The test setup's refusal of a GPU run that would only interpret kernels."""

from __future__ import annotations

from tests.conftest import interpreter_trap


def test_a_gpu_run_without_compiled_kernels_is_refused() -> None:
    assert "TRITON_INTERPRET=0" in interpreter_trap("gpu", cuda=True, given=None)
    assert interpreter_trap("gpu", cuda=True, given="1")
    assert interpreter_trap("gpu", cuda=True, given="0") is None
    assert interpreter_trap("gpu", cuda=False, given=None) is None  # no CUDA: the GPU tests skip as they should
    assert interpreter_trap("", cuda=True, given=None) is None  # the whole suite on a GPU machine: mixed, as in CI
