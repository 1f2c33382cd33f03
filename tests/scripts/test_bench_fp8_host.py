"""scripts/bench/fp8_host.py: its CPU smoke run and its bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from scripts.bench import fp8_host as bench_fp8_host  # noqa: E402


def test_smoke_run_times_every_piece_a_cpu_has(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    assert bench_fp8_host.main(["--smoke", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    # the Triton launches are timed on a GPU only; the GEMMs and the three linears everywhere
    assert set(result["host_us"]) == {
        "mm_bf16",
        "fp8_mm",
        "linear_bf16",
        "linear_fp8",
        "linear_fp8_delayed",
    }
    assert all(value > 0 for value in result["host_us"].values())
    assert result["calls"] == 10


def test_a_call_count_below_one_is_a_usage_error(capsys) -> None:
    assert bench_fp8_host.main(["--calls", "0"]) == 2
    assert capsys.readouterr().err.strip() == "bench_fp8_host: --calls must be 1 or more"


def test_no_gpu_without_smoke_exits_3(monkeypatch, capsys) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench_fp8_host.main([]) == 3
    assert capsys.readouterr().err.strip() == "bench_fp8_host: no GPU (use --smoke on a CPU)"
