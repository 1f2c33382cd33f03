"""scripts/bench/moe_experts.py on a real patched 0.19 sdist, on the CPU (``--cpu``): that the
script builds upstream's two expert modules from upstream's specs, gives them the same experts
and times both, not the numbers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cache_paths import DOWNLOAD_CACHE

from megatron_rocm.main import main

pytest.importorskip("torch")
pytestmark = [pytest.mark.torch, pytest.mark.slow, pytest.mark.upstream, pytest.mark.full]
REPO = Path(__file__).resolve().parents[2]

SMALL = ["--cpu", "--tokens", "64", "--hidden", "64", "--ffn", "32"]


def _bench(tree: Path, out: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "scripts.bench.moe_experts", str(tree), "--json", str(out), *args],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_upstreams_loop_and_the_native_grouped_module_run_the_same_experts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MEGATRON_ROCM_CACHE", str(DOWNLOAD_CACHE))
    tree = tmp_path / "mcore"
    assert main(["apply", "--source", "pypi", "--ref", "0.19.2", "--dest", str(tree)]) == 0
    out = tmp_path / "moe.jsonl"
    done = _bench(tree, out, *SMALL, "--experts", "3", "8")
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["experts"], r["module"]) for r in records] == [
        (3, "SequentialMLP"), (3, "TEGroupedMLP"), (8, "SequentialMLP"), (8, "TEGroupedMLP"),
    ]  # fmt: skip
    for record in records:
        assert record["ms"] > 0
        # the same experts and tokens: upstream's loop and the grouped module agree (fp32)
        assert record["max_abs_diff_out"] < 1e-5 and record["max_abs_diff_dx"] < 1e-5, record
    grouped = [r for r in records if r["module"] == "TEGroupedMLP"]
    assert {r["grouped_gemm"] for r in grouped} == {"loop"}  # no GPU: which one ran is said


def test_a_directory_that_is_not_a_megatron_tree_is_refused_in_one_line(tmp_path: Path) -> None:
    done = _bench(tmp_path, tmp_path / "x.jsonl", "--cpu")
    assert done.returncode == 2
    assert (
        done.stderr.strip()
        .splitlines()[-1]
        .endswith("is not a Megatron-LM tree (no megatron/core)")
    )
    assert "Traceback" not in done.stderr
