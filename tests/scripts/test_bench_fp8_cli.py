"""scripts/bench/fp8_cli.py: the FP8 benchmarks' device choice and JSON output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from megatron_rocm.runtime.kernels import fp8  # noqa: E402
from scripts.bench import fp8_cli  # noqa: E402


def test_smoke_runs_on_the_cpu_whatever_the_machine(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert fp8_cli.fp8_device("bench_x", smoke=True) == "cpu"


def test_no_gpu_and_a_gpu_without_fp8_say_why_on_one_line(monkeypatch, capsys) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert fp8_cli.fp8_device("bench_x", smoke=False) is None
    assert capsys.readouterr().err == "bench_x: no GPU (use --smoke on a CPU)\n"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(fp8, "unsupported_gpu_reason", lambda: "gfx90a has no FP8 GEMMs")
    assert fp8_cli.fp8_device("bench_x", smoke=False) is None
    assert capsys.readouterr().err == "bench_x: this GPU: gfx90a has no FP8 GEMMs\n"
    monkeypatch.setattr(fp8, "unsupported_gpu_reason", lambda: None)
    assert fp8_cli.fp8_device("bench_x", smoke=False) == "cuda"


def test_report_prints_the_result_last_and_writes_json_when_asked(tmp_path: Path, capsys) -> None:
    result = {"device": "cpu", "ms": {"a": 1.5}}
    assert fp8_cli.report(result, None) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1]) == result
    out = tmp_path / "r.json"
    assert fp8_cli.report(result, out) == 0
    assert json.loads(out.read_text()) == result
