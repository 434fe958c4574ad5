"""Programmatic dependent launch: when it is on, that every launched kernel waits first, and its bits on a GPU."""

from __future__ import annotations

import ast
import os
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from kernels import pdl

KERNELS = Path(pdl.__file__).resolve().parent


def launches(tree: ast.AST) -> list[ast.Call]:
    """Every `_name_kernel[grid](...)` call in a module."""
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Subscript)
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id.endswith("_kernel")
    ]


def kernel_defs(tree: ast.Module) -> dict[str, ast.FunctionDef]:
    """Module-level functions named `_..._kernel`."""
    return {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.endswith("_kernel")}


# index arithmetic, selects and sums in registers, the L2 prefetch, and loads of memory no kernel writes (weights)
SAFE_CALLS = {
    "tl.program_id",
    "tl.arange",
    "tl.minimum",
    "tl.where",
    "tl.sum",
    "tl.cdiv",
    "tl.num_programs",
    "range",
    "prefetch_l2",
    "load_unwritten",
    "_ascending_places",  # kernels/moe.py's ranking of a row's expert ids (checked below to touch no memory)
}
# kernels that may read, before the wait, memory that no kernel still running then writes (`load_settled`): whether
# that holds depends on what is launched before each, so each is listed with what it reads
SETTLED_READERS = {
    "_gdn_step_kernel": "its row's lane (written at the round's start) and state (a round before)",
    "_down_pairs_kernel": "its row's expert ids and weights (written before the gate-up pairs kernel, which waits)",
    "_combine_kernel": "its row's ids, weights (before the plan), shared output and logit (joined before the gate-up)",
}


def before_enter(fn: ast.FunctionDef) -> list[ast.stmt]:
    """The statements ahead of `enter(PDL)` (docstring excluded); fails if the kernel never calls it."""
    body = fn.body[1:] if isinstance(fn.body[0], ast.Expr) and isinstance(fn.body[0].value, ast.Constant) else fn.body
    for i, stmt in enumerate(body):
        if ast.unparse(stmt) == "enter(PDL)":
            return body[:i]
    raise AssertionError(f"{fn.name} never calls enter(PDL)")


def touches_memory(stmt: ast.stmt, allowed: set[str] = SAFE_CALLS) -> bool:
    """Whether a statement calls anything beyond `allowed` (a load, a store, a helper), or returns: a block that ends
    before its wait lets the next kernel launch before the one it follows has finished."""
    for node in ast.walk(stmt):
        if isinstance(node, ast.Return):
            return True
        if isinstance(node, ast.Call):
            name = ast.unparse(node.func)
            if name not in allowed and not name.endswith(".to"):
                return True
    return False


@pytest.mark.parametrize("path", sorted(KERNELS.glob("*.py")), ids=lambda p: p.name)
def test_every_launched_kernel_waits_before_touching_memory(path: Path) -> None:
    """A kernel launched as a dependent must call enter(PDL) before its first load or store (other than of weights,
    by `load_unwritten`, and in `SETTLED_READERS` by `load_settled`) and never return before it, and each launch
    passes its own launch options."""
    tree = ast.parse(path.read_text())
    defs = kernel_defs(tree)
    for call in launches(tree):
        name = call.func.value.id
        fn = defs[name]
        assert "PDL" in [a.arg for a in fn.args.args], f"{path.name}: {name} takes no PDL"
        allowed = SAFE_CALLS | ({"load_settled"} if name in SETTLED_READERS else set())
        early = [ast.unparse(stmt) for stmt in before_enter(fn) if touches_memory(stmt, allowed)]
        assert not early, f"{path.name}: {name} may touch memory before enter(PDL): {early}"
        options = [k.value for k in call.keywords if k.arg is None and isinstance(k.value, ast.Call)]
        assert any(ast.unparse(o.func) == "launch_options" and ast.unparse(o.args[0]) == name for o in options), (
            f"{path.name}:{call.lineno}: {name} is launched without launch_options({name}, ...)"
        )


def test_the_gdn_step_reads_its_lane_and_state_while_the_projection_before_it_runs() -> None:
    """GDN's decode step loads its row's lane and its recurrent state tile ahead of its wait (no kernel launched since
    the layer's last step writes them), so their latency passes under the input projection's."""
    tree = ast.parse((KERNELS / "gdn_step.py").read_text())
    early = [ast.unparse(stmt) for stmt in before_enter(kernel_defs(tree)["_gdn_step_kernel"])]
    loads = [line.split(" = ", 1)[0] for line in early if "load_settled(" in line]
    assert loads == ["lane", "first", "s"], early


def test_the_one_row_moe_down_finds_its_expert_while_the_gate_up_runs() -> None:
    """The pairs path's down kernel reads its row's router ids and weights ahead of its wait (the gate-up pairs kernel
    before it writes neither and waits for their writer) and ranks them for its expert, so that none of it waits for
    the gate-up to end."""
    tree = ast.parse((KERNELS / "moe.py").read_text())
    early = [ast.unparse(stmt) for stmt in before_enter(kernel_defs(tree)["_down_pairs_kernel"])]
    loads = [line.split(" = ", 1)[0] for line in early if "load_settled(" in line]
    assert loads == ["row_ids", "row_wts"], early
    assert any(line.startswith("e = ") for line in early), early


def test_the_combine_reads_its_rows_routing_and_shared_output_while_the_down_runs() -> None:
    """The grouped path's combine reads its row's ids and weights and the shared expert's output and logit ahead of
    its wait (the down before it writes none of them) and ranks the ids, so only the down's outputs wait for it."""
    tree = ast.parse((KERNELS / "moe.py").read_text())
    early = [ast.unparse(stmt) for stmt in before_enter(kernel_defs(tree)["_combine_kernel"])]
    loads = [line.split(" = ", 1)[0] for line in early if "load_settled(" in line and "\n" not in line]
    gated = next(line for line in early if line.startswith("if GATED:"))
    assert loads == ["ids", "wts"] and "shared = load_settled(" in gated and "logit = load_settled(" in gated, early
    assert any(line.startswith("rank = ") for line in early), early


def test_the_helpers_let_before_the_wait_touch_no_memory() -> None:
    """The jit helpers SAFE_CALLS lists compute in registers: no load, store or other helper in their bodies."""
    tree = ast.parse((KERNELS / "moe.py").read_text())
    helper = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "_ascending_places")
    body = [stmt.value if isinstance(stmt, ast.Return) else stmt for stmt in helper.body[1:]]  # its result's return
    assert body and not [ast.unparse(part) for part in body if touches_memory(part)]


def test_a_read_of_settled_memory_or_a_return_before_the_wait_is_refused_elsewhere() -> None:
    """`load_settled` passes only where listed, and a return ahead of the wait never does."""
    settled, early_return = (ast.parse(line).body[0] for line in ("s = load_settled(p, None, None)", "return"))
    assert touches_memory(settled) and touches_memory(early_return)
    assert not touches_memory(settled, SAFE_CALLS | {"load_settled"})


def test_launch_options_refuse_a_kernel_without_the_constexpr() -> None:
    from kernels.sample import _draw

    with pytest.raises(TypeError, match="_draw takes no PDL"):
        pdl.launch_options(_draw, torch.device("cpu"))


def test_off_on_the_cpu_and_under_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    from kernels.router import _router_kernel

    assert pdl.launch_options(_router_kernel, torch.device("cpu")) == {"PDL": False, "launch_pdl": False}
    monkeypatch.setattr(pdl, "INTERPRET", True)
    monkeypatch.setattr(pdl, "_hopper_or_later", lambda index: True)
    assert not pdl.pdl_enabled(torch.device("cuda", 0))


def test_on_for_hopper_unless_the_environment_says_no(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pdl, "INTERPRET", False)
    monkeypatch.setattr(pdl, "_hopper_or_later", lambda index: index == 0)
    monkeypatch.delenv(pdl.PDL_ENV, raising=False)
    monkeypatch.delenv(pdl.PREFETCH_ENV, raising=False)
    assert pdl.pdl_enabled(torch.device("cuda", 0)) and pdl.prefetch_enabled(torch.device("cuda", 0))
    assert not pdl.pdl_enabled(torch.device("cuda", 1))  # an older GPU
    monkeypatch.setenv(pdl.PREFETCH_ENV, "0")
    assert pdl.pdl_enabled(torch.device("cuda", 0)) and not pdl.prefetch_enabled(torch.device("cuda", 0))
    monkeypatch.setenv(pdl.PDL_ENV, "0")
    assert not pdl.pdl_enabled(torch.device("cuda", 0)) and not pdl.prefetch_enabled(torch.device("cuda", 0))


@pytest.mark.gpu
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="needs compiled kernels")
def test_a_graph_of_dependent_launches_gives_the_bits_of_plain_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    """Linear kernels (split and whole K) and a norm, captured with PDL on, equal the chain eager with PDL off."""
    from kernels.linear import linear
    from kernels.norm import zc_rms_norm

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(7, 2560, device="cuda", generator=gen).bfloat16()
    w1 = torch.randn(3072, 2560, device="cuda", generator=gen).bfloat16() / 50
    w2 = torch.randn(2560, 3072, device="cuda", generator=gen).bfloat16() / 50
    norm_w = torch.randn(2560, device="cuda", generator=gen).bfloat16()

    def chain(inp: torch.Tensor) -> torch.Tensor:
        return linear(zc_rms_norm(linear(linear(inp, w1), w2), norm_w, 1e-6), w1)

    monkeypatch.setenv(pdl.PDL_ENV, "0")
    plain = chain(x)
    monkeypatch.setenv(pdl.PDL_ENV, "1")
    static = x.clone()
    chain(static)  # compile the PDL variants before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(static)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, plain)
