"""scripts/bench/fp8_wgrad_accum.py: its kernel's sums under Triton's CPU interpreter, and its
bad input."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("triton")

from tests.script_run import run_interpreted  # noqa: E402

_run = functools.partial(run_interpreted, "scripts.bench.fp8_wgrad_accum")


def test_smoke_run_adds_the_fp8_product_into_main_grad_on_every_path(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    done = _run("--smoke", "--json", str(out))
    assert done.returncode == 0, done.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [r["main_grad"] for r in rows] == ["float32", "bfloat16"]
    for row in rows:
        # masked tiles on every side (80 tokens over tiles of 32, 150 x 40 over tiles of 16)
        # and ten tiles of N, more than one group of 8
        assert row["shape"] == "80x150x40"
        bound = 1e-5 if row["main_grad"] == "float32" else 1e-2  # bf16: the result's rounding
        for path in ("torch", "torch_fast", "triton_fast", "triton_promoted"):
            assert row[path]["rel_error"] <= bound, (row["main_grad"], path, row[path])
            assert row[path]["ms"] > 0


def test_smoke_run_with_block_scales_adds_on_the_triton_gemm(tmp_path: Path) -> None:
    """--blocks: the ROCm path (fp8_blockwise_triton's GEMM adding into main_grad) against
    fp32 math with the scales of each 128 tokens apart (80 tokens: one partial block)."""
    out = tmp_path / "r.json"
    done = _run("--smoke", "--blocks", "--json", str(out))
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert report["blocks"] is True
    for row in report["rows"]:
        bound = 1e-5 if row["main_grad"] == "float32" else 1e-2
        assert row["triton_block"]["rel_error"] <= bound, row
        assert "triton_fast" not in row and "torch_fast" not in row


def test_smoke_without_the_interpreter_is_a_usage_error(tmp_path: Path) -> None:
    done = _run("--smoke", interpret=False)
    assert done.returncode == 2
    assert done.stderr.strip() == (
        "bench_fp8_wgrad_accum: --smoke runs the kernel on the CPU: set TRITON_INTERPRET=1"
    )


def test_a_bad_shape_is_a_usage_error_before_the_device_is_asked(tmp_path: Path) -> None:
    done = _run("--shapes", "bogus", interpret=False)
    assert done.returncode == 2
    assert done.stderr.strip() == (
        "bench_fp8_wgrad_accum: bad shape 'bogus': expected MxNxK (each at least 1), 8b or 0.85b"
    )
