"""One rule each, in one place: hunk acceptance, diff loading, the cache folder.

The issue that led here found the acceptance rule written four times, diff loading three
and the cache folder three (one ignoring ``MEGATRON_ROCM_CACHE``); copies drift apart. The
structural checks read the package source; the behavioural ones run the code.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from megatron_rocm.error_handler import log_path
from megatron_rocm.main import main
from megatron_rocm.patchtool import upstream
from megatron_rocm.patchtool.results import HunkLabel, PatchResult, accepts

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_rocm"


def _uses(pattern: str) -> set[str]:
    rx = re.compile(pattern)
    return {
        p.relative_to(PACKAGE).as_posix()
        for p in PACKAGE.rglob("*.py")
        if rx.search(p.read_text(encoding="utf-8"))
    }


def _line_of(rel: str, text: str) -> str:
    return next(ln for ln in (PACKAGE / rel).read_text(encoding="utf-8").splitlines() if text in ln)


def test_acceptance_is_decided_in_results_only():
    assert _uses(r"\.label\.applies|label\.applies\b") <= {"patchtool/results.py"}


def test_diff_files_are_parsed_by_diffio_only():
    assert _uses(r"\bparse_diff\(") == {"patchtool/diffio.py", "patchtool/hunks.py"}


def test_cache_folder_comes_from_one_function():
    # runtime/settings.py declares the variable only so that a training run leaves the tool's
    # setting alone (it refuses MEGATRON_ROCM_* names nothing reads); it reads no folder
    assert _uses(r"MEGATRON_ROCM_CACHE") - {"runtime/settings.py"} == {"cache.py"}
    assert "environ" not in _line_of("runtime/settings.py", "MEGATRON_ROCM_CACHE")
    assert _uses(r"XDG_CACHE_HOME") <= {"cache.py"}


@pytest.mark.parametrize("label", list(HunkLabel))
def test_acceptance_table(label):
    plain = {HunkLabel.CLEAN, HunkLabel.OFFSET, HunkLabel.FUZZ, HunkLabel.OUT_OF_SCOPE}
    plain.add(HunkLabel.ALREADY_APPLIED)
    assert accepts(label) == (label in plain)
    assert accepts(label, three_way=True) == (label in plain | {HunkLabel.NEEDS_3WAY})


def test_cache_env_moves_mirrors_and_log(tmp_path, monkeypatch, toy):
    _, up, _ = toy
    monkeypatch.setenv("MEGATRON_ROCM_CACHE", str(tmp_path / "cache"))
    repo = upstream.reading_repo(upstream.classify("file://" + str(up)), None, quiet=True)
    assert repo.is_relative_to(tmp_path / "cache")
    assert log_path() == tmp_path / "cache" / "megatron-rocm.log"


def test_check_and_apply_agree_on_what_applies(toy, capsys):
    """check's ok and apply's go-ahead come from the same rule: needs-3-way fails both
    without --3way (core_v0.6.0 of the toy), and passes apply with it."""
    root, up, series = toy
    assert (
        main(["check", "--source", str(up), "--series", str(series), "--ref", "core_v0.6.0"]) == 1
    )
    argv = ["apply", "--source", str(up), "--series", str(series), "--ref", "core_v0.6.0"]
    assert main([*argv, "--dest", str(root / "a")]) == 1
    assert main([*argv, "--dest", str(root / "a"), "--3way"]) == 0
    result = PatchResult("p", "v", [])
    assert result.ok and result.accepted(True)
