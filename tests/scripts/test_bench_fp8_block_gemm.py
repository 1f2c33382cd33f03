"""scripts/bench/fp8_block_gemm.py: the Triton block-scaled GEMM's three products under
Triton's CPU interpreter, and its bad input."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("triton")

from tests.script_run import run_interpreted  # noqa: E402

_run = functools.partial(run_interpreted, "scripts.bench.fp8_block_gemm")


def test_smoke_run_times_the_linears_three_gemms_on_the_triton_kernel(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    done = _run("--smoke", "--json", str(out))
    assert done.returncode == 0, done.stderr
    rows = json.loads(out.read_text())["rows"]
    # 96 tokens, 256 outputs, 300 inputs: the dgrad contracts over 256, the others past 128s
    assert [(r["gemm"], r["mnk"]) for r in rows] == [
        ("forward", [96, 256, 300]),
        ("dgrad", [96, 300, 256]),
        ("wgrad", [256, 300, 96]),
    ]
    for row in rows:
        bound = 1e-5 if row["gemm"] == "wgrad" else 1e-2  # fp32 main_grad; bf16 rounding
        assert row["triton"]["rel_error"] <= bound, row
        assert row["triton"]["ms"] > 0
        assert "cublaslt" not in row and "bf16" not in row  # a GPU's paths


def test_smoke_without_the_interpreter_is_a_usage_error() -> None:
    done = _run("--smoke", interpret=False)
    assert done.returncode == 2
    assert done.stderr.strip() == (
        "bench_fp8_block_gemm: --smoke runs the kernel on the CPU: set TRITON_INTERPRET=1"
    )


def test_a_bad_shape_is_a_usage_error_before_the_device_is_asked() -> None:
    done = _run("--shapes", "8b,bogus", interpret=False)
    assert done.returncode == 2
    assert (
        done.stderr.strip()
        == "bench_fp8_block_gemm: bad shape 'bogus': expected MxNxK (each at least 1), 8b or 0.85b"
    )
