"""scripts/bench/attention.py: its CPU smoke run, a kernel that cannot run, usage errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from scripts.bench import attention as bench_attention  # noqa: E402


def test_smoke_run_times_each_variant_and_records_one_that_cannot_run(tmp_path: Path) -> None:
    out = tmp_path / "rows.jsonl"
    assert bench_attention.main(["--smoke", "--json", str(out)]) == 0
    rows = {r["variant"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert set(rows) == {"te_spec", "math", "cudnn_op"}
    for name in ("te_spec", "math"):
        assert rows[name]["ms"] > 0 and rows[name]["max_diff"] < 1e-5, rows[name]
    # cuDNN's op needs an NVIDIA GPU: the row says so instead of ending the run
    assert "NVIDIA GPU" in rows["cudnn_op"]["error"] and "ms" not in rows["cudnn_op"]


def test_causal_flops_count_half_the_square() -> None:
    shape = bench_attention.Shape(batch=2, seq=8, heads=3, kv_heads=1, dim=4)
    assert shape.flops == 3.5 * 2 * 2 * 3 * 8 * 8 * 4


def test_an_unknown_shape_is_a_usage_error(capsys) -> None:
    assert bench_attention.main(["--shapes", "70b"]) == 2
    assert "unknown shape or variant '70b'" in capsys.readouterr().err
