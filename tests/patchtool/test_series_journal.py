"""series_journal: a failed rename is put back; a journal it cannot trust is refused, untouched.

(A process killed mid-write is ``tests/commands/test_export_faults.py``, full tier.)
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from megatron_rocm.main import main
from megatron_rocm.patchtool import series_journal


def _series(root: Path) -> Path:
    folder = root / "patches"
    (folder / "p").mkdir(parents=True)
    (folder / "p" / "patch.toml").write_text(
        'id = "p"\nreason = "r"\nupstream = "rocm-only"\n\n[[variant]]\nsince = "0.1.0"\nskip = true\n'
    )
    (folder / "series").write_text("p\n")
    return folder


def _tree(folder: Path) -> dict[str, bytes | None]:
    out: dict[str, bytes | None] = {
        str(p.relative_to(folder)): None if p.is_dir() else p.read_bytes()
        for p in sorted(folder.rglob("*"))
    }
    return out | {f"../{p.name}": b"" for p in folder.parent.iterdir() if p != folder}


def test_a_rename_that_fails_after_the_commit_point_puts_back_what_had_moved(tmp_path, monkeypatch):
    folder = _series(tmp_path)
    before = _tree(folder)
    files = {
        folder / "p" / "patch.toml": b"changed\n",
        folder / "q" / "v0.1.diff": b"new diff\n",
        folder / "q" / "patch.toml": b"new toml\n",
        folder / "series": b"p\nq\n",
    }
    real, renames = os.replace, []

    def failing(src, dst):
        if str(src).endswith(".tmp") and not str(src).endswith("journal.tmp"):
            renames.append(dst)
            if len(renames) == 3:
                raise OSError(28, "No space left on device")
        return real(src, dst)

    monkeypatch.setattr(series_journal.os, "replace", failing)
    with series_journal.writer(folder), pytest.raises(OSError):
        series_journal.write(folder, files, [folder / "q"], [])
    assert len(renames) == 3  # two targets had been replaced when the third failed
    assert _tree(folder) == before


def test_a_journal_naming_a_path_outside_the_series_is_refused_and_nothing_touched(
    tmp_path, capsys
):
    folder = _series(tmp_path)
    outside = tmp_path / "precious.txt"
    outside.write_text("keep me\n")
    journal = series_journal.journal_path(folder)
    entry = {"target": "series", "staged": "../precious.txt", "original": None}
    journal.write_text(
        json.dumps({"state": "prepared", "entries": [entry], "folders": [], "removals": []})
    )
    assert main(["list", "--series", str(folder)]) == 3
    err = capsys.readouterr().err
    assert str(journal) in err and "Traceback" not in err
    assert outside.read_text() == "keep me\n" and (folder / "series").read_text() == "p\n"


def test_an_uncommitted_journal_is_undone_by_list(tmp_path, capsys):
    folder = _series(tmp_path)
    before = _tree(folder)
    (folder / "q").mkdir()
    (folder / "q" / ".patch.toml.1.tmp").write_text("half")
    (folder / ".series.1.tmp").write_text("p\nq\n")
    os.link(folder / "series", folder / ".series.1.orig")
    entries = [
        {"target": "q/patch.toml", "staged": "q/.patch.toml.1.tmp", "original": None},
        {"target": "series", "staged": ".series.1.tmp", "original": ".series.1.orig"},
    ]
    series_journal.journal_path(folder).write_text(
        json.dumps({"state": "prepared", "entries": entries, "folders": ["q"], "removals": []})
    )
    assert main(["list", "--series", str(folder)]) == 0
    assert "undid the partial write" in capsys.readouterr().err
    assert _tree(folder) == before
