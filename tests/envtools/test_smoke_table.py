"""scripts/smoke_table.py: smoke JSON reports of several trees -> one Markdown table, and
scripts/training/validate_distopt_resume.py's command-line guards (no GPU needed for either)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def script(name: str):
    package = "scripts" if name == "smoke_table" else "scripts.training"
    return importlib.import_module(f"{package}.{name}")


def report(tmp_path: Path, name: str, checks: list[tuple[str, str, str]]) -> str:
    data = {
        "device": "NVIDIA H200 (sm_90) x2, CUDA 13.0",
        "torch": "2.11.0",
        "checks": [{"name": n, "status": s, "seconds": 1.0, "detail": d} for n, s, d in checks],
    }
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(data))
    return f"{name}={path}"


def test_table_rows_cells_and_shared_notes(tmp_path: Path, capsys) -> None:
    old = report(
        tmp_path,
        "core_v0.12.0",
        [
            ("kernels.rope", "pass", ""),
            ("training.llama.te", "pass", "loss 6.9 -> 2.1"),
            ("parallel.megatron_fsdp.te", "skip", "Megatron-FSDP is in megatron-core from 0.14"),
            ("parallel.cp2.local", "skip", "only through TEDotProductAttention"),
        ],
    )
    new = report(
        tmp_path,
        "main",
        [
            ("training.llama.te", "fail", "loss did not decrease"),
            ("parallel.megatron_fsdp.te", "pass", ""),
            ("parallel.cp2.local", "skip", "only through TEDotProductAttention"),
            ("parallel.cp2.te", "pass", ""),
        ],
    )
    assert script("smoke_table").main([old, new]) == 0
    out = capsys.readouterr().out
    assert "- core_v0.12.0: NVIDIA H200 (sm_90) x2, CUDA 13.0, torch 2.11.0" in out
    assert "| check | core_v0.12.0 | main |" in out
    assert "| `training.llama.te` | pass | FAIL [1] |" in out
    assert "| `parallel.megatron_fsdp.te` | skip [2] | pass |" in out
    assert "| `parallel.cp2.local` | skip [3] | skip [3] |" in out  # one note for both
    assert "| `parallel.cp2.te` | - | pass |" in out  # the old report has no such row
    assert "kernels.rope" not in out  # not selected by the default --only
    assert "[1] loss did not decrease" in out  # notes in row order


def test_table_refuses_bad_input(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "x.json"
    bad.write_text("{}")
    assert script("smoke_table").main([f"main={bad}"]) == 2
    assert "not a smoke JSON report" in capsys.readouterr().err
    assert script("smoke_table").main(["main"]) == 2
    assert "expected LABEL=REPORT.json" in capsys.readouterr().err


def test_distopt_script_needs_a_full_tree(tmp_path: Path, capsys) -> None:
    module = script("validate_distopt_resume")
    assert module.main([str(tmp_path)]) == 2
    assert "has no pretrain_gpt.py" in capsys.readouterr().err
    (tmp_path / "pretrain_gpt.py").write_text("")
    assert module.main([str(tmp_path), "--formats", "torch,zarr"]) == 2
    assert "unknown formats ['zarr']" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("fmt", "text"),
    [("fsdp_dtensor", "fsdp_dtensor"), ("torch_dist_fully_reshardable", "dist_ckpt_optim")],
)
def test_distopt_script_skips_formats_the_tree_lacks(tmp_path: Path, fmt, text) -> None:
    module = script("validate_distopt_resume")
    (tmp_path / "megatron/training").mkdir(parents=True)
    (tmp_path / "megatron/training/arguments.py").write_text("choices=['torch', 'torch_dist']")
    verdict = module.check_format(tmp_path, fmt, 2, tmp_path / "out")
    assert verdict["status"] == "skip" and text in verdict["detail"]
