"""Which megatron-core release `apply --source pypi` takes without --ref: pip's choice for the
running Python (newest final release whose sdist admits it), from a fake index listing."""

from __future__ import annotations

import pytest

from megatron_rocm.errors import SourceError
from megatron_rocm.patchtool import pypi


def sdist(requires: str | None) -> list[dict]:
    return [{"packagetype": "sdist", "requires_python": requires}]


@pytest.fixture
def index(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[dict]]:
    releases = {
        "0.15.0": sdist(">=3.10"),
        "0.16.1": sdist(">=3.10"),
        "0.17.0": sdist(">=3.12"),
        "0.18.0": sdist(">=3.12"),
        "0.19.0rc1": sdist(None),  # a pre-release is never the default
        "0.20.0": [{"packagetype": "bdist_wheel", "requires_python": None}],  # no sdist
    }
    monkeypatch.setattr(pypi, "_releases", lambda index: releases)
    return releases


def test_python_3_11_takes_the_newest_release_it_can_install(index) -> None:
    assert pypi.newest_for_python("3.11.7") == ("0.16.1", ["0.17.0", "0.18.0"])


def test_python_3_12_takes_the_newest_release(index) -> None:
    assert pypi.newest_for_python("3.12.4") == ("0.18.0", [])


def test_missing_or_unreadable_requires_python_admits(index) -> None:
    index["0.18.0"] = sdist("not a specifier")
    index["0.18.1"] = sdist(None)
    assert pypi.newest_for_python("3.9.0")[0] == "0.18.1"


def test_no_release_for_this_python_is_a_source_error(index) -> None:
    with pytest.raises(SourceError, match="supports Python 3.8"):
        pypi.newest_for_python("3.8.10")


def test_apply_default_ref_names_the_skipped_releases(index, monkeypatch, capsys) -> None:
    from megatron_rocm.patchtool import upstream

    monkeypatch.setattr(pypi.platform, "python_version", lambda: "3.11.7")
    assert upstream.pypi_ref(None) == "core_v0.16.1"
    assert "megatron-core 0.17.0, 0.18.0 need a newer Python" in capsys.readouterr().err
    assert upstream.pypi_ref(None, quiet=True) == "core_v0.16.1"
    assert capsys.readouterr().err == ""
    assert upstream.pypi_ref("0.18.0") == upstream.pypi_ref("core_v0.18.0") == "core_v0.18.0"


def test_apply_from_pypi_takes_the_chosen_release_not_the_newest_cached(toy, monkeypatch, capsys):
    """The sdist cache repo may already hold newer tags (from `check`): the fork must still be
    cut at the release chosen for this Python."""
    from megatron_rocm.main import main

    root, upstream, series = toy  # a repo with tags core_v0.1.0 .. core_v0.6.0
    monkeypatch.setattr(pypi, "sdist_repo", lambda refs: upstream)
    monkeypatch.setattr(pypi, "newest_for_python", lambda: ("0.2.0", ["0.3.0"]))
    dest = root / "fork"
    argv = ["apply", "--source", "pypi", "--series", str(series), "--dest", str(dest)]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert "created branch rocm/core_v0.2.0" in out
    assert "megatron-core 0.3.0 need a newer Python" in err
