"""scripts/bench_cp_attention.py on two gloo ranks (``--cpu``): the script, not the numbers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytestmark = [pytest.mark.torch, pytest.mark.slow]
SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_cp_attention.py"


def test_every_case_reports_its_costliest_ops(tmp_path: Path) -> None:
    out = tmp_path / "cp.jsonl"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        str(SCRIPT), "--cpu", "--lengths", "128", "--comm", "p2p,all_gather,a2a", "--iters", "1",
        "--ops", "5", "--json", str(out),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    cases = [r["case"] for r in records]
    assert cases == ["sdpa_1gpu", "cp2_p2p_cpu_flash", "cp2_all_gather_cpu_flash", "cp2_a2a_sdpa"]
    for record in records:
        ops = record["top_ops"]
        assert 1 <= len(ops) <= 5, record
        assert all(ms > 0 and calls > 0 for _, ms, calls in ops), ops
        assert [ms for _, ms, _ in ops] == sorted((ms for _, ms, _ in ops), reverse=True)
        # the attention kernel itself is among the costliest ops of every case
        assert any("scaled_dot_product" in name for name, _, _ in ops), ops
    for record in records[1:]:
        assert record["max_abs_err"] < 1e-5  # fp32 on the CPU: the CP result is the 1-rank one
