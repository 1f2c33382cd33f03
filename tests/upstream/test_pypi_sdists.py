"""The real series against real megatron-core sdists from PyPI (downloaded once, cached).

Select with ``-m upstream``; they need a reachable package index. The sdists hold
``megatron/core`` (and ``megatron/training`` from 0.17), so hunks on other files are
reported out of scope, never as failures.
"""

from __future__ import annotations

import json
import shutil

import pytest
from cache_paths import DOWNLOAD_CACHE

from megatron_rocm.main import main
from megatron_rocm.patchtool import pypi
from megatron_rocm.patchtool.series import default_series_dir

pytestmark = [pytest.mark.upstream, pytest.mark.slow]
FIXED = ["0.12.0", "0.14.0", "0.16.0"]


@pytest.fixture
def cache(monkeypatch):
    monkeypatch.setenv("MEGATRON_ROCM_CACHE", str(DOWNLOAD_CACHE))
    return DOWNLOAD_CACHE


@pytest.fixture
def newest(cache) -> str:
    return pypi.release_versions()[-1]


@pytest.mark.full  # four sdists and the index's newest release; the quick tier fetches one
def test_real_series_applies_to_release_sdists(cache, newest, capsys):
    refs = [*FIXED, newest]
    code = main(["check", "--source", "pypi", "--ref", *refs, "--json"])
    data = json.loads(capsys.readouterr().out)
    failing = {
        r["ref"]: [p["patch_id"] for p in r["patches"] if not p["ok"]]
        for r in data["refs"]
        if not r["ok"]
    }
    assert failing == {}
    assert code == 0
    assert [r["version"].split("rc")[0] for r in data["refs"]][:3] == FIXED
    labels = {h["label"] for r in data["refs"] for p in r["patches"] for h in p["hunks"]}
    assert "out-of-scope" in labels  # e.g. megatron/legacy is not in any sdist
    assert labels <= {"clean", "offset", "fuzz", "out-of-scope"}


def test_apply_from_pypi_then_export_is_zero_diff(cache, tmp_path, capsys):
    series = tmp_path / "series"
    shutil.copytree(default_series_dir(), series)
    dest = tmp_path / "fork"
    assert (
        main(
            [
                "apply",
                "--source",
                "pypi",
                "--ref",
                "0.14.0",
                "--dest",
                str(dest),
                "--series",
                str(series),
                "--json",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert out["branch"] == "rocm/core_v0.14.0"
    assert any(c["commit"] for c in out["commits"])
    assert (dest / "megatron/core/fusions/fused_softmax.py").read_text().count("megatron_rocm") >= 1
    assert main(["export", "--repo", str(dest), "--series", str(series), "--json"]) == 0
    exported = json.loads(capsys.readouterr().out)
    assert {p["action"] for p in exported["patches"]} <= {"unchanged", "no-change"}
    for f in sorted(series.rglob("*")):
        if f.is_file():
            assert f.read_bytes() == (default_series_dir() / f.relative_to(series)).read_bytes()
