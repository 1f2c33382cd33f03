"""scripts/bench/fp8_linear.py: shape parsing and its CPU smoke run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from scripts.bench import fp8_linear as bench_fp8_linear  # noqa: E402


def test_shapes_by_name_and_by_size() -> None:
    assert bench_fp8_linear.parse_shapes("8b")[2] == (8192, 28672, 4096)
    assert bench_fp8_linear.parse_shapes("16x32x48,0.85b")[:2] == [
        (16, 32, 48),
        (32768, 2560, 1536),
    ]


@pytest.mark.parametrize("bad", ["1x2", "0x16x16", "16x-1x16"])
def test_a_bad_shape_is_a_usage_error(capsys, bad: str) -> None:
    with pytest.raises(SystemExit) as info:
        bench_fp8_linear.main(["--shapes", bad])
    assert info.value.code == 2
    assert capsys.readouterr().err == (
        f"bench_fp8_linear: bad shape {bad!r}: expected MxNxK (each at least 1), 8b or 0.85b\n"
    )


def test_smoke_run_reports_every_column(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    assert bench_fp8_linear.main(["--smoke", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert set(row["ms"]) == {
        "gemm_bf16",
        "gemm_fp8",
        "quantize_eager",
        "linear_bf16",
        "linear_fp8",
        "linear_fp8_delayed",
    }
    assert 1e-3 < row["fp8_forward_rel_error"] < 0.06
