"""scripts/bench/fp8_experts.py: its CPU smoke run and its bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from scripts.bench import fp8_experts as bench  # noqa: E402


def test_smoke_run_times_every_path(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    assert bench.main(["--smoke", "--experts", "3", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    paths = {"fp8_experts", "fp8_per_expert", "bf16_grouped"}
    assert set(result["host_us"]) == set(result["gpu_ms"]) == paths
    assert all(v > 0 for v in [*result["host_us"].values(), *result["gpu_ms"].values()])
    assert result["experts"] == 3 and len(result["counts"]) == 3


def test_token_counts_spread_around_the_mean_in_multiples_of_16() -> None:
    counts = bench._counts(8, 2048)
    assert all(c % 16 == 0 for c in counts) and len(set(counts)) > 1
    assert all(abs(c - 2048) <= 0.1 * 2048 + 8 for c in counts)


@pytest.mark.parametrize("flag", ["--experts", "--tokens", "--calls", "--iters"])
def test_a_count_below_one_is_a_usage_error(capsys, flag: str) -> None:
    assert bench.main([flag, "0"]) == 2
    assert "must be 1 or more" in capsys.readouterr().err


def test_no_gpu_without_smoke_exits_3(monkeypatch, capsys) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main([]) == 3
    assert capsys.readouterr().err.strip() == "bench_fp8_experts: no GPU (use --smoke on a CPU)"
