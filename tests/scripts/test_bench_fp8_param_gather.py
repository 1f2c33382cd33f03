"""scripts/bench/fp8_param_gather.py: its CPU smoke run and its bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from scripts.bench import fp8_param_gather as bench  # noqa: E402


def test_smoke_run_times_every_piece_of_both_recipes_on_both_paths(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    assert bench.main(["--smoke", "--layers", "2", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["weights"] == 8 and result["dp"] == 2
    assert set(result["ms"]) == {
        "tensorwise_kernels", "tensorwise_torch", "delayed_kernels", "delayed_torch"
    }  # fmt: skip
    for pieces in result["ms"].values():
        assert set(pieces) == {"shard_casts", "transposes", "without_the_flag"}
        assert all(value > 0 for value in pieces.values())


@pytest.mark.parametrize("flag", ["--layers", "--dp", "--iters"])
def test_a_count_below_one_is_a_usage_error(capsys, flag: str) -> None:
    assert bench.main([flag, "0"]) == 2
    assert capsys.readouterr().err.strip() == (
        "bench_fp8_param_gather: --layers, --dp and --iters must be 1 or more"
    )


def test_no_gpu_without_smoke_exits_3(monkeypatch, capsys) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main([]) == 3
    assert (
        capsys.readouterr().err.strip() == "bench_fp8_param_gather: no GPU (use --smoke on a CPU)"
    )
