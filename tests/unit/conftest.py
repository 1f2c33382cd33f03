"""Fixtures shared by the engine tests: a synthetic upstream and a series made against it."""

from __future__ import annotations

from pathlib import Path

import pytest
from toyrepo import make_series, make_upstream


@pytest.fixture
def toy(tmp_path: Path) -> tuple[Path, Path, Path]:
    """(scratch folder, upstream repo with core_v0.1.0..0.6.0 tags, patches/ folder)."""
    upstream = make_upstream(tmp_path)
    return tmp_path, upstream, make_series(tmp_path, upstream)
