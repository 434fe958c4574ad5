"""scripts/bench_collectives.py on the CPU: its command line, sizes, inputs, table and JSON (the timing needs GPUs)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
from pathlib import Path
from types import ModuleType
from unittest import mock

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_collectives.py"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    """The script imported by path; the environment it sets on import is put back afterwards."""
    spec = importlib.util.spec_from_file_location("bench_collectives", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    with mock.patch.dict(os.environ):
        os.environ.pop("NCCL_NVLS_ENABLE", None)
        spec.loader.exec_module(module)
        assert os.environ["NCCL_NVLS_ENABLE"] == "0" and os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
    return module


def test_arguments_default_to_the_models_per_step_sizes(bench, tmp_path):
    args = bench.parse_args(["--json", str(tmp_path / "c.json")])
    assert args.rows == (1, 4, 8, 64, 256) and args.json == tmp_path / "c.json"
    assert bench.combines_per_forward(args.model) == (2560, 96)  # 48 layers: a mixer and a MoE each
    assert bench.sizes(2560, args.rows)[0] == {"rows": 1, "bytes": 2560 * 4}
    assert bench.parse_args(["--rows", "2,16", "--graph-calls", "8"]).rows == (2, 16)


@pytest.mark.parametrize("text", ["1,x", "0,4", ""])
def test_bad_row_lists_are_refused_by_name(bench, text):
    with pytest.raises(argparse.ArgumentTypeError, match="--rows"):
        bench.parse_rows(text)


def test_partials_are_per_rank_repeatable_and_span_large_and_small_magnitudes(bench):
    p0, p1 = bench.partial_sums(0, 8, 2560), bench.partial_sums(1, 8, 2560)
    assert p0.dtype == torch.float32 and p0.shape == (8, 2560)
    assert torch.equal(p0, bench.partial_sums(0, 8, 2560)) and not torch.equal(p0, p1)
    magnitude = p0.abs()[p0 != 0]
    assert magnitude.max() > 1e7 and magnitude.min() < 1e-7
    assert ((p0 + p1).double() != p0.double() + p1.double()).any()  # the sums round


def test_table_and_json_show_times_missing_methods_and_graph_failures(bench):
    records = [
        {"method": "all_reduce", "rows": 1, "bytes": 10240, "eager_us": 20.5, "graph_us": 9.25, "bits_equal": True},
        {
            "method": "gather_sum",
            "rows": 1,
            "bytes": 10240,
            "eager_us": 30.0,
            "graph_us": None,
            "bits_equal": False,
            "graph_error": "RuntimeError: capture",
        },
        {"method": "symm_mem_one_shot", "rows": 1, "bytes": 10240, "unavailable": "ImportError: no symm_mem"},
    ]
    lines = bench.format_table(records, 96).splitlines()
    assert "x96 us" in lines[0]
    assert lines[1].split() == ["1", "10240", "all_reduce", "20.5", "9.2", "same", "888"]
    assert "DIFF" in lines[2] and "graph: RuntimeError: capture" in lines[2]
    assert lines[3].endswith("unavailable: ImportError: no symm_mem")
    doc = json.loads(json.dumps(bench.report(records, 2560, 96, "cpu")))
    assert doc["results"] == records and doc["combines_per_forward"] == 96
    assert set(doc["env"]) == {"NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"}
