"""The wheel must carry every package and the series (non-editable installs use the copy)."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_is_listed_for_the_wheel():
    listed = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    found = {
        ".".join(p.parent.relative_to(ROOT).parts)
        for p in (ROOT / "megatron_rocm").rglob("__init__.py")
    }
    assert found <= listed, f"add to [tool.setuptools] packages: {sorted(found - listed)}"
    assert "megatron_rocm._patches" in listed


def test_series_files_match_the_wheel_package_data():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert data["package-dir"]["megatron_rocm._patches"] == "patches"
    globs = data["package-data"]["megatron_rocm._patches"]
    patches = ROOT / "patches"
    shipped = {p for g in globs for p in patches.glob(g)}
    every = {p for p in patches.rglob("*") if p.is_file()}
    assert every <= shipped, f"not shipped in the wheel: {sorted(every - shipped)}"
