"""The test setup: its refusal of a GPU run that would only interpret kernels, a compiled run that leaves out the
modules that only interpret them, and its interpreted fp32 dots."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
import triton
import triton.language as tl

from server.threads import THREAD_POOLS, share_of_cores
from tests.conftest import interpreter_trap, left_out_of_compiled_run, share_cores_among_workers

TESTS = Path(__file__).resolve().parent
PROBE = """
import os
def pytest_collection_finish(session):
    open(os.environ["PROBE_OUT"], "w").write(os.environ.get("TRITON_INTERPRET", ""))
"""
THREADS_PROBE = """
import os
import torch
def test_threads():
    share = max(1, len(os.sched_getaffinity(0)) // 2)
    assert torch.get_num_threads() == share and os.environ["OMP_NUM_THREADS"] == str(share)
"""
LINEAR_PROBE = """
import os, sys
def pytest_collection_finish(session):
    open(os.environ["PROBE_OUT"], "w").write(str(sys.modules["kernels.linear"].INTERPRET))
"""


def test_a_gpu_run_without_compiled_kernels_is_refused() -> None:
    assert "TRITON_INTERPRET=0" in interpreter_trap("gpu", cuda=True, given=None)
    assert interpreter_trap("gpu", cuda=True, given="1")
    assert interpreter_trap("gpu", cuda=True, given="0") is None
    assert interpreter_trap("gpu", cuda=False, given=None) is None  # no CUDA: the GPU tests skip as they should
    assert interpreter_trap("", cuda=True, given=None) is None  # the whole suite on a GPU machine: mixed, as in CI


def test_a_compiled_run_leaves_out_exactly_the_modules_that_only_interpret() -> None:
    """Under `-m gpu` with TRITON_INTERPRET=0, the test modules that set TRITON_INTERPRET to 1 (none holds a GPU test)
    are not imported, and every module with a GPU test is; any other selection imports them all."""
    modules = sorted(TESTS.rglob("test_*.py"))
    left_out = {p for p in modules if left_out_of_compiled_run(p, "gpu", "0")}
    with_gpu_tests = {p for p in modules if "mark.gpu" in p.read_text()}
    assert TESTS / "kernels" / "test_hyper.py" in left_out and TESTS / "kernels" / "test_hyper_gpu.py" in with_gpu_tests
    assert not left_out & with_gpu_tests, sorted(str(p) for p in left_out & with_gpu_tests)
    for markexpr, given in (("gpu", None), ("gpu", "1"), ("", "0"), ("not gpu", "0"), ("gpu or slow", "0")):
        assert not any(left_out_of_compiled_run(p, markexpr, given) for p in left_out), (markexpr, given)


def test_collecting_a_module_that_only_interprets_leaves_a_compiled_run_compiled(tmp_path: Path) -> None:
    """Collected with `-m gpu` and TRITON_INTERPRET=0 beside a GPU module, a module that sets TRITON_INTERPRET to 1
    does not switch the kernel modules imported after it to the interpreter: the variable is still 0 at the end."""
    (tmp_path / "interpret_probe.py").write_text(PROBE)
    out = tmp_path / "interpret.txt"
    env = os.environ | {"TRITON_INTERPRET": "0", "PROBE_OUT": str(out), "PYTHONPATH": f"{tmp_path}:{TESTS.parent}"}
    files = [str(TESTS / "kernels" / "test_hyper.py"), str(TESTS / "kernels" / "test_hyper_gpu.py")]
    command = [sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "interpret_probe", "-p", "no:xdist"]
    run = subprocess.run([*command, "-m", "gpu", *files], cwd=TESTS.parent, env=env, capture_output=True, text=True)
    assert out.exists() and out.read_text() == "0", run.stdout[-2000:] + run.stderr[-2000:]


@pytest.mark.skipif(torch.cuda.is_available(), reason="without CUDA only")
def test_kernel_modules_interpret_whichever_test_module_imports_them_first(tmp_path: Path) -> None:
    """Without CUDA and without TRITON_INTERPRET given, a model test module that imports the linear kernel before any
    kernel test module sets the interpreter leaves that kernel module interpreting."""
    (tmp_path / "interpret_probe.py").write_text(LINEAR_PROBE)
    out = tmp_path / "interpret.txt"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env |= {"PROBE_OUT": str(out), "PYTHONPATH": f"{tmp_path}:{TESTS.parent}"}
    files = [str(TESTS / "model" / "test_fused_weight.py"), str(TESTS / "kernels" / "test_linear.py")]
    command = [sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "interpret_probe", "-p", "no:xdist"]
    run = subprocess.run([*command, *files], cwd=TESTS.parent, env=env, capture_output=True, text=True)
    assert out.exists() and out.read_text() == "True", run.stdout[-2000:] + run.stderr[-2000:]


@triton.jit
def _dot_kernel(a_ptr, b_ptr, out_ptr, N: tl.constexpr):
    """out = 0.5 + a·b for one [N, N] tile of fp32."""
    offs = tl.arange(0, N)[:, None] * N + tl.arange(0, N)[None, :]
    acc = tl.full((N, N), 0.5, tl.float32)
    tl.store(out_ptr + offs, tl.dot(tl.load(a_ptr + offs), tl.load(b_ptr + offs), acc, input_precision="ieee"))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the interpreter's dots only")
def test_an_interpreted_fp32_dot_rounds_its_sum_once() -> None:
    """Each row of `a` holds 1, 2^24 and -2^24 (in two orders, at every place): its sum is 1 exactly, and 0 or 1
    in fp32 as the machine's BLAS orders it (OpenBLAS's Haswell kernels give 0 for half of these rows)."""
    a = torch.zeros(16, 16)
    for r in range(16):
        values = [1.0, -(2.0**24), 2.0**24] if r % 2 == 0 else [1.0, 2.0**24, -(2.0**24)]
        a[r, [r, (r + 1) % 16, (r + 2) % 16]] = torch.tensor(values)
    out = torch.empty(16, 16)
    _dot_kernel[(1,)](a, torch.ones(16, 16), out, N=16)
    assert out.eq(1.5).all()


def test_each_worker_takes_its_share_of_the_cores() -> None:
    assert share_of_cores(2, cores=2) == 1 and share_of_cores(2, cores=16) == 8 and share_of_cores(4, cores=1) == 1
    assert share_cores_among_workers({}) is None  # outside xdist: the pools as torch sizes them
    environ = {"PYTEST_XDIST_WORKER_COUNT": "2", "MKL_NUM_THREADS": "3"}
    share = share_cores_among_workers(environ)
    assert share == share_of_cores(2)
    assert environ["OMP_NUM_THREADS"] == environ["OPENBLAS_NUM_THREADS"] == str(share)
    assert environ["MKL_NUM_THREADS"] == "3"  # a size set by hand is kept


def test_a_parallel_runs_workers_and_what_they_start_use_their_share(tmp_path: Path) -> None:
    """Run under xdist, a test sees torch's pool and its children's environment sized to the worker's share."""
    (tmp_path / "test_probe.py").write_text(THREADS_PROBE)
    env = {k: v for k, v in os.environ.items() if k not in THREAD_POOLS and not k.startswith("PYTEST_XDIST")}
    env["PYTHONPATH"] = str(TESTS.parent)
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-n",
        "2",
        "-p",
        "no:cacheprovider",
        "-p",
        "tests.conftest",
        "test_probe.py",
    ]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_interpreters_cached_helpers_answer_as_its_own() -> None:
    """The dtype and block-shape helpers the test setup caches give the interpreter's answers, and a refused shape is
    refused every time."""
    import numpy as np
    from triton.language import core
    from triton.runtime import interpreter

    from tests.conftest import cached_interpreter_helpers

    before = interpreter._get_np_dtype, core.validate_block_shape  # the run's own, cached by the setup already
    own_dtype, own_numel = (getattr(f, "__wrapped__", f) for f in before)
    interpreter._get_np_dtype, core.validate_block_shape = own_dtype, own_numel
    cached_interpreter_helpers()
    try:
        assert interpreter._get_np_dtype is not own_dtype and core.validate_block_shape is not own_numel
        scalars = [tl.int1, tl.int8, tl.uint16, tl.int32, tl.int64, tl.float16, tl.bfloat16, tl.float32, tl.float8e4nv]
        for tt in [*scalars, *(tl.pointer_type(t) for t in scalars)]:
            for typed in (tt, tl.block_type(tt, [4, 8]), tl.block_type(tt, [2])):
                assert interpreter._get_np_dtype(typed) == own_dtype(typed), typed
                assert interpreter._get_np_dtype(typed) == own_dtype(typed), typed  # from the cache
        assert interpreter._get_np_dtype(tl.bfloat16) == np.dtype(np.uint16)
        for shape in ([4, 8], (16,), [1, 2, 64]):
            assert core.validate_block_shape(shape) == own_numel(shape) == core.validate_block_shape(list(shape))
        for bad in ([3, 4], [4, 3]):
            for _ in range(2):
                with pytest.raises(ValueError, match="power of 2"):
                    core.validate_block_shape(bad)
    finally:
        interpreter._get_np_dtype, core.validate_block_shape = before


def test_a_block_type_is_built_once_with_the_interpreters_values() -> None:
    """A block type of one element type and shape (ints or constexprs, list or tuple) is one object, holding what the
    interpreter's own __init__ gives it; other types or shapes are others, a refused shape is refused every time, and
    a subclass is built as its own __init__ says."""
    from triton.language import core

    build = core.block_type.__init__.__wrapped__  # the setup replaced it: the interpreter runs cached
    typed = tl.block_type(tl.float32, [4, 8])
    assert typed is tl.block_type(tl.float32, (core.constexpr(4), 8)) is tl.block_type(tl.float32, [4, 8])
    own = object.__new__(core.block_type)
    build(own, tl.float32, [4, 8])
    assert (typed.shape, typed.numel, typed.name, typed.element_ty) == (own.shape, own.numel, own.name, own.element_ty)
    others = [
        tl.block_type(tl.float16, [4, 8]),
        tl.block_type(tl.float32, [8, 4]),
        tl.block_type(tl.pointer_type(tl.float32), [4, 8]),
        tl.block_type(tl.pointer_type(tl.float32, const=True), [4, 8]),
        tl.block_type(tl.pointer_type(tl.float32, "shared"), [4, 8]),
    ]
    assert len({id(t) for t in [typed, *others]}) == 6
    assert others[2] is tl.block_type(tl.pointer_type(tl.float32), [4, 8])
    for _ in range(2):
        with pytest.raises(ValueError, match="power of 2"):
            tl.block_type(tl.float32, [3, 4])

    class Laid(core.block_type):
        def __init__(self, element_ty, shape, layout):
            super().__init__(element_ty, shape)
            self.layout = layout

    laid = Laid(tl.float32, [4, 8], "rows")
    assert laid is not Laid(tl.float32, [4, 8], "rows") and (laid.shape, laid.layout) == (own.shape, "rows")


def test_a_tensor_holds_the_interpreters_attributes_with_its_types_shape_made_once() -> None:
    from triton.language import core

    from tests.conftest import same_tensors

    cached, own = core.tensor.__init__, core.tensor.__init__.__wrapped__
    assert cached is not own and same_tensors(own, cached)
    typed = tl.block_type(tl.int32, [2, 16])
    a, b = core.tensor(None, typed), core.tensor(None, typed)
    assert a.shape is b.shape and [s.value for s in a.shape] == [2, 16] and a.numel.value == 32 and a.dtype == tl.int32
    scalar = core.tensor(None, tl.float32)
    assert len(scalar.shape) == 0 and scalar.numel.value == 1 and scalar.type is tl.float32


@triton.jit
def _add_kernel(x_ptr, y_ptr, out_ptr, N: tl.constexpr):
    offsets = tl.arange(0, N)
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets) + tl.load(y_ptr + offsets))


def test_the_interpreter_skips_the_overflow_checks_it_drops_and_wraps_as_before() -> None:
    """Without debug asserts the interpreter's overflow checks decide nothing: the setup turns them off, and an int32
    sum that overflows wraps to the same values with them on."""
    import dataclasses

    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    assert not builder.options.debug and not builder.options.sanitize_overflow
    x = torch.tensor([2**31 - 1, -(2**31), 5, -7], dtype=torch.int32)
    y = torch.tensor([1, -1, 9, 3], dtype=torch.int32)
    outs = []
    for sanitize in (False, True):
        options, builder.options = builder.options, dataclasses.replace(builder.options, sanitize_overflow=sanitize)
        try:
            out = torch.empty_like(x)
            _add_kernel[(1,)](x, y, out, N=4)
            outs.append(out)
        finally:
            builder.options = options
    assert torch.equal(outs[0], outs[1]) and outs[0].tolist() == [-(2**31), 2**31 - 1, 14, -4]
