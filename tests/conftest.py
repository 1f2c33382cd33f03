"""Hermetic test environment: no user git config, fixed identity and dates, private HOME.

Downloads (PyPI sdists) are cached outside the temporary HOME so repeated runs and CI reuse
them: $MEGATRON_ROCM_TEST_CACHE or ~/.cache/megatron-rocm-tests.
"""

from __future__ import annotations

from pathlib import Path

import cache_paths  # noqa: F401 - imported before HOME is replaced, so it sees the real one
import pytest
from toyrepo import make_series, make_upstream, seal


@pytest.fixture(autouse=True)
def hermetic(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    seal(monkeypatch, tmp_path_factory.mktemp("home"))


@pytest.fixture
def toy(tmp_path: Path) -> tuple[Path, Path, Path]:
    """(scratch folder, upstream repo with core_v0.1.0..0.6.0 tags, patches/ folder)."""
    upstream = make_upstream(tmp_path)
    return tmp_path, upstream, make_series(tmp_path, upstream)


@pytest.fixture
def matrix_runs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """One entry per time ``matrix`` started its work (``build_matrix``, stubbed): tests of
    refusals that must come before the work read it empty."""
    called: list[int] = []
    monkeypatch.setattr(
        "megatron_rocm.commands.matrix.build_matrix", lambda *a, **k: called.append(1)
    )
    return called
