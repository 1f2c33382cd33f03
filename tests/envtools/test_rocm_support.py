"""The supported ROCm PyTorch table: doctor's one line per older component, install's index,
and docs/rocm.md rendered from the same table."""

from __future__ import annotations

from pathlib import Path

from megatron_rocm.envtools import envcheck, installer, rocm_support

DOC = Path(__file__).resolve().parents[2] / "docs" / "rocm.md"


def test_a_supported_rocm_stack_has_no_problems() -> None:
    assert rocm_support.problems("2.13.0+rocm7.2", "7.2.53211", "3.6.0") == []
    assert rocm_support.problems("2.7.1+cu126", None, "3.3.0") == []  # not a ROCm build


def test_an_old_rocm_torch_is_named_once_per_reason() -> None:
    lines = rocm_support.problems("2.8.0+rocm6.4", "6.4.1", "3.4.0")
    assert all("\n" not in line for line in lines)
    assert sum("base 2" in line for line in lines) == 1
    assert any("torch 2.8.0+rocm6.4 is older than 2.11" in line for line in lines)
    assert any(line.startswith("Triton 3.4.0 is older than 3.6") for line in lines)
    assert any(rocm_support.ROCM_INDEX in line for line in lines)
    newer = rocm_support.problems("2.9.1+rocm6.4", "6.4.1", "3.6.0")
    assert len(newer) == 1 and "older than 2.11" in newer[0]


def test_doctor_reports_each_as_a_problem() -> None:
    gpu = envcheck.Gpu(0, "AMD Instinct MI300X", "gfx942", 192.0)
    snap = envcheck.Snapshot(torch="2.8.0+rocm6.4", hip="6.4.1", triton="3.6.0", gpus=[gpu])
    found = [p for p in envcheck.problems(snap) if p.code == "older-than-supported"]
    assert len(found) == len(rocm_support.REQUIREMENTS)


def test_doctor_and_install_name_the_rocm7_index() -> None:
    assert "rocm7" in envcheck.ROCM_TORCH_HINT and "rocm6" not in envcheck.ROCM_TORCH_HINT
    assert installer.ROCM_TORCH == rocm_support.ROCM_TORCH_HINT


def test_docs_show_the_table() -> None:
    assert rocm_support.markdown() in DOC.read_text()
