"""Test setup: the scripts folder is importable (checkpoint makers), kernels interpret without CUDA whichever module
imports them first, GPU tests skip without CUDA, a GPU run that would only interpret kernels is refused, a run of the
GPU tests alone leaves out the modules that only interpret, the Triton interpreter does not patch triton.language
again for every helper a kernel calls, two of its pure helpers and its block types answer from a cache, it skips the
overflow checks it would drop, its fp32 dots give the same bits on every machine, and the workers of a parallel run
split the cores between their thread pools."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from server.threads import give_thread_pools_a_share  # imports nothing heavy: torch reads its pool sizes later


def share_cores_among_workers(environ: dict[str, str] = os.environ) -> int | None:
    """Under pytest-xdist, each worker's thread pools (and those of the servers and ranks it starts, which inherit
    the environment) get the worker's share of the cores (docs/performance.md, fifty-fifth session); a size set by
    hand is kept. The share, or None outside xdist."""
    workers = environ.get("PYTEST_XDIST_WORKER_COUNT")
    return None if workers is None else give_thread_pools_a_share(environ, int(workers))


WORKER_THREADS = share_cores_among_workers()  # before torch and NumPy read the variables

import pytest  # noqa: E402
import torch  # noqa: E402

if WORKER_THREADS is not None:
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
INTERPRET_GIVEN = os.environ.get("TRITON_INTERPRET")  # before test modules default it to the interpreter
if INTERPRET_GIVEN is None and not torch.cuda.is_available():
    # no GPU: every kernel module interprets, whichever test module (a model test, say) imports it first
    os.environ["TRITON_INTERPRET"] = "1"


def interpreter_trap(markexpr: str, cuda: bool, given: str | None) -> str | None:
    """Why a run must stop: `-m gpu` on a CUDA machine without TRITON_INTERPRET=0, where the GPU test modules fall
    back to the interpreter and skip every compiled-kernel test (a run that would pass having checked nothing)."""
    if cuda and "gpu" in markexpr and given != "0":
        return "-m gpu runs compiled kernels only with TRITON_INTERPRET=0 set; without it they all skip"
    return None


FORCES_INTERPRETER = 'os.environ["TRITON_INTERPRET"] = "1"'  # how a module that only interprets kernels says so


def left_out_of_compiled_run(path: Path, markexpr: str, given: str | None) -> bool:
    """Whether a run of the GPU tests alone (`-m gpu` with TRITON_INTERPRET=0) must not import this file: a test
    module that sets TRITON_INTERPRET to 1 holds no GPU test, and importing it would make every kernel module imported
    after it an interpreted one."""
    if given != "0" or markexpr.strip() != "gpu" or path.suffix != ".py" or not path.name.startswith("test_"):
        return False
    return FORCES_INTERPRETER in path.read_text()


class LeftOut(pytest.File):
    """A test module a run of compiled kernels does not import (`left_out_of_compiled_run`): no tests."""

    def collect(self) -> list[pytest.Item]:
        return []


@pytest.hookimpl(tryfirst=True)
def pytest_pycollect_makemodule(module_path: Path, parent: pytest.Collector) -> pytest.Collector | None:
    """An empty file in place of a test module a run of the GPU tests alone must not import."""
    if left_out_of_compiled_run(module_path, parent.config.getoption("markexpr") or "", INTERPRET_GIVEN):
        return LeftOut.from_parent(parent, path=module_path)
    return None


def patch_language_once_per_launch() -> None:
    """The interpreter patches triton.language when a kernel launches and again (scanning every member of the
    language modules) on each call of a @triton.jit helper inside it; a fifth of an interpreted forward went to the
    repeats. A helper whose language modules the running launch has patched already skips the repeat."""
    import triton.language as tl
    from triton.runtime import interpreter

    launch, call, patch_lang = (
        interpreter.GridExecutor.__call__,
        interpreter.InterpretedFunction.__call__,
        interpreter._patch_lang,
    )
    patched: list[set[int]] = []  # per running launch: the language modules patched so far
    modules: dict[object, frozenset[int]] = {}

    def languages(fn) -> frozenset[int]:
        """The language modules `fn` sees, as the interpreter's patch finds them."""
        if fn not in modules:
            modules[fn] = frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core)
        return modules[fn]

    def counted_launch(self, *args, **kwargs):
        patched.append(set(languages(self.fn)))
        try:
            return launch(self, *args, **kwargs)
        finally:
            patched.pop()

    def helper_call(self, *args, **kwargs):
        repeat = bool(patched) and languages(self.fn) <= patched[-1]
        if patched:
            patched[-1] |= languages(self.fn)
        outer, interpreter._patch_lang = interpreter._patch_lang, (lambda fn: None) if repeat else patch_lang
        try:
            return call(self, *args, **kwargs)
        finally:
            interpreter._patch_lang = outer

    interpreter.GridExecutor.__call__ = counted_launch
    interpreter.InterpretedFunction.__call__ = helper_call


def cached_interpreter_helpers() -> None:
    """Two pure functions the interpreter calls for nearly every op, answered from a dict after their first call
    with a key: NumPy's dtype for a Triton type (rebuilt as a table of all types on every call) and a block shape's
    element count (checked element by element). Left alone where this Triton has neither."""
    import triton.language as tl
    from triton.language import core
    from triton.runtime import interpreter

    np_dtype, block_numel = getattr(interpreter, "_get_np_dtype", None), getattr(core, "validate_block_shape", None)
    if np_dtype is None or block_numel is None:
        return
    dtypes: dict[object, object] = {}
    numels: dict[tuple[int, ...], int] = {}

    def cached_np_dtype(tt_dtype):
        scalar = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype  # a block's is its element's
        if isinstance(scalar, tl.pointer_type):  # answered before the table is built (and not hashable)
            return np_dtype(scalar)
        found = dtypes.get(scalar)
        if found is None:
            found = dtypes[scalar] = np_dtype(scalar)
        return found

    def cached_numel(shape):
        key = tuple(shape)
        found = numels.get(key)
        if found is None:  # a shape that is refused raises each time, as before
            found = numels[key] = block_numel(shape)
        return found

    cached_np_dtype.__wrapped__, cached_numel.__wrapped__ = np_dtype, block_numel  # type: ignore[attr-defined]
    interpreter._get_np_dtype, core.validate_block_shape = cached_np_dtype, cached_numel


def cached_block_types() -> None:
    """The interpreter builds a block type (and a tensor's shape of constexprs from it) for nearly every op, a fifth
    of an interpreted forward. A block type of one element type and shape is built once and answered from a dict
    after, with its tensors' shape, as the interpreter's own values; a subclass's (Gluon's) is built as before."""
    import math

    from triton.language import core

    block_type, tensor = core.block_type, core.tensor
    build, base_init = block_type.__init__, core.base_value.__init__
    made: dict[tuple, core.block_type] = {}

    def key(element_ty, shape) -> tuple | None:
        """The cache's key: the element type's kind, name and address space, and the shape's ints (None: not
        plain ints)."""
        if type(shape) not in (list, tuple):
            return None
        dims = tuple(s.value if isinstance(s, core.constexpr) else s for s in shape)
        if not all(type(d) is int for d in dims):
            return None
        return type(element_ty), element_ty.name, getattr(element_ty, "address_space", None), dims

    def new(cls, *args, **kwargs):
        found = key(*args, **kwargs) if cls is block_type and not kwargs and len(args) == 2 else None
        if found is None:
            return object.__new__(cls)
        typed = made.get(found)
        if typed is None:
            typed = object.__new__(cls)
            build(typed, *args)
            typed.__dict__["_made"] = True  # built: the __init__ Python calls next leaves it as it is
            made[found] = typed
        return typed

    def init(self, *args, **kwargs):
        if not self.__dict__.get("_made"):
            build(self, *args, **kwargs)

    def tensor_init(self, handle, type):
        base_init(self)
        self.handle, self.type, self.dtype = handle, type, type.scalar
        shaped = type.__dict__.get("_tensor_shape")
        if shaped is None:  # the shape and element count as constexprs, made once for each type
            dims = type.shape if type.is_block() else ()
            shaped = (core.constexpr(math.prod(dims)), core.tuple([core.constexpr(d) for d in dims]))
            type.__dict__["_tensor_shape"] = shaped
        self.shape, self.numel = shaped[1], shaped[0]

    own_tensor_init = tensor.__init__
    init.__wrapped__, tensor_init.__wrapped__ = build, own_tensor_init  # type: ignore[attr-defined]
    block_type.__new__, block_type.__init__, tensor.__init__ = new, init, tensor_init
    if not same_tensors(own_tensor_init, tensor_init):  # another Triton's tensor: keep its own __init__
        tensor.__init__ = own_tensor_init


def same_tensors(own_init, cached_init) -> bool:
    """Whether tensors made by the two __init__s hold equal attributes, for a block type and a scalar one."""
    import triton.language as tl
    from triton.language import core

    for typed in (tl.block_type(tl.float32, [4, 8]), tl.pointer_type(tl.int32)):
        a, b = object.__new__(core.tensor), object.__new__(core.tensor)
        own_init(a, None, typed)
        cached_init(b, None, typed)
        if vars(a).keys() != vars(b).keys() or repr(a.shape) != repr(b.shape) or repr(a.numel) != repr(b.numel):
            return False
        if a.type is not b.type or a.dtype != b.dtype:
            return False
    return True


def no_overflow_checks_without_debug() -> None:
    """The interpreter runs every int32 add, sub and mul again in int64 to check for overflow, then drops the check
    unless its options ask for debug asserts (they never do): without debug it skips the repeat, as compiled code
    does."""
    import dataclasses

    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    if not builder.options.debug:
        builder.options = dataclasses.replace(builder.options, sanitize_overflow=False)


def machine_independent_dots() -> None:
    """The interpreter's tl.dot is NumPy's matmul, whose BLAS sums in an order it picks for the machine and the shape,
    so two tiles of one fp32 sum could differ on one machine and not on another (tests that compare tiles failed on
    an AVX2 AMD EPYC with OpenBLAS's Haswell kernels). An fp32 dot here forms its exact products in float64, adds
    them in k order, rounds once to fp32 and then adds the accumulator, as the same steps on any machine."""
    import numpy as np
    from triton.runtime import interpreter

    blas_dot = interpreter.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if not a.data.dtype == b.data.dtype == d.data.dtype == np.float32 or a.data.ndim != 2:
            return blas_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        products = a.data.astype(np.float64)[:, :, None] * b.data.astype(np.float64)[None, :, :]
        sums = np.add.reduce(products, axis=1).astype(np.float32)  # over a middle axis: k in order, row by row
        return interpreter.TensorHandle(sums + d.data, d.dtype.scalar)

    interpreter.InterpreterBuilder.create_dot = create_dot


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if "triton" in sys.modules:  # after the test modules chose the interpreter (TRITON_INTERPRET) and imported it
        patch_language_once_per_launch()
        machine_independent_dots()
        cached_interpreter_helpers()
        if os.environ.get("TRITON_INTERPRET") == "1":
            cached_block_types()
            no_overflow_checks_without_debug()
    trap = interpreter_trap(config.getoption("markexpr") or "", torch.cuda.is_available(), INTERPRET_GIVEN)
    if trap:
        raise pytest.UsageError(trap)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
