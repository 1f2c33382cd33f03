"""Two ``export`` runs into one series folder at once, each adding a new patch.

Each run reads ``series``, appends its patch's line and writes the file back: without one
writer at a time, the second write drops the first's line and leaves its folder orphaned
(``list`` silent). Either both patches end up listed, or one run is refused with exit 5 and
changes nothing; never a folder without its line.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from toyrepo import apply_argv, make_series, make_upstream, run

from megatron_rocm.main import main
from megatron_rocm.patchtool.interrupts import FAULT_ENV

ROUNDS = 8
NEW = {"one": "add-rocm-notes-one", "two": "add-rocm-notes-two"}


@pytest.fixture(scope="module")
def forks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path]]:
    from toyrepo import seal

    root = tmp_path_factory.mktemp("concurrent")
    with pytest.MonkeyPatch.context() as mp:
        seal(mp, root / "home")
        upstream = make_upstream(root)
        series = make_series(root, upstream)
        forks = {}
        for name in NEW:
            dest = root / f"fork-{name}"
            assert main(apply_argv(upstream, series, dest)) == 0
            (dest / f"NOTES-{name}.md").write_text(f"notes {name}\n")
            run("add", "-A", cwd=dest)
            run("commit", "-qm", f"Add ROCm notes {name}", cwd=dest)
            forks[name] = dest
    return series, forks


def _listed(series: Path) -> list[str]:
    lines = (series / "series").read_text().splitlines()
    return [s for ln in lines if (s := ln.split("#", 1)[0].strip())]


def test_concurrent_exports_never_lose_a_line(forks, tmp_path):
    template, repos = forks
    for r in range(ROUNDS):
        series = tmp_path / f"round-{r}" / "patches"
        shutil.copytree(template, series)
        procs = {
            name: subprocess.Popen(
                [sys.executable, "-m", "megatron_rocm", "export", "--repo", str(repo)]
                + ["--series", str(series)],
                env={**os.environ, FAULT_ENV: "export-mapped:sleep=1"},  # read, then wait
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            for name, repo in repos.items()
        }
        codes = {name: (p.wait(timeout=120), p.stderr.read()) for name, p in procs.items()}
        listed = _listed(series)
        for name, (code, err) in codes.items():
            assert code in (0, 5), err
            if code == 5:
                assert len(err.strip().splitlines()) == 1 and "another megatron-rocm" in err
            assert (NEW[name] in listed) == (code == 0), (r, codes, listed)
        assert 0 in {code for code, _ in codes.values()}
        folders = {p.name for p in series.iterdir() if p.is_dir()}
        assert folders == set(listed), (r, codes, listed)  # no orphaned patch folder
        assert not [p.name for p in series.parent.iterdir() if p.name != "patches"]
