"""Hermetic test environment: no user git config, fixed identity and dates, private HOME.

Downloads (PyPI sdists) are cached outside the temporary HOME so repeated runs and CI reuse
them: $MEGATRON_ROCM_TEST_CACHE or ~/.cache/megatron-rocm-tests.
"""

from __future__ import annotations

import os
from pathlib import Path

import cache_paths  # noqa: F401 - imported before HOME is replaced, so it sees the real one
import pytest
from toyrepo import make_series, make_upstream


@pytest.fixture(autouse=True)
def hermetic(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path_factory.mktemp("home")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("XDG_CACHE_HOME", str(home / ".cache"))
    monkeypatch.delenv("MEGATRON_ROCM_SERIES", raising=False)
    monkeypatch.setenv("MEGATRON_ROCM_CACHE", str(home / ".cache" / "megatron-rocm"))
    for key in list(os.environ):
        if key.startswith("GIT_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", os.devnull)
    monkeypatch.setenv("GIT_AUTHOR_NAME", "Test Author")
    monkeypatch.setenv("GIT_AUTHOR_EMAIL", "author@example.invalid")
    monkeypatch.setenv("GIT_COMMITTER_NAME", "Test Author")
    monkeypatch.setenv("GIT_COMMITTER_EMAIL", "author@example.invalid")
    monkeypatch.setenv("GIT_AUTHOR_DATE", "2025-01-01T00:00:00+0000")
    monkeypatch.setenv("GIT_COMMITTER_DATE", "2025-01-01T00:00:00+0000")
    monkeypatch.setenv("GIT_EDITOR", "false")


@pytest.fixture
def toy(tmp_path: Path) -> tuple[Path, Path, Path]:
    """(scratch folder, upstream repo with core_v0.1.0..0.6.0 tags, patches/ folder)."""
    upstream = make_upstream(tmp_path)
    return tmp_path, upstream, make_series(tmp_path, upstream)
