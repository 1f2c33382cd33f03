"""The quick tier's area check (``tiers``, enforced by ``tests/conftest.py``)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import tiers


def item(path: str, fixtures: tuple[str, ...] = (), marks: tuple[str, ...] = ()) -> SimpleNamespace:
    return SimpleNamespace(
        path=Path("/repo") / path,
        fixturenames=list(fixtures),
        get_closest_marker=lambda name: name if name in marks else None,
    )


EVERY_AREA = [
    item("tests/patchtool/test_series.py", fixtures=("toy",)),
    item("tests/upstream/test_pypi_sdists.py", marks=("upstream",)),
    item("tests/runtime/kernels/test_norm.py", marks=("triton", "triton_interpreted")),
    item("tests/runtime/backend/packed/test_packed_attention.py"),
    item("tests/commands/test_errors.py"),
    item("tests/envtools/test_doctor.py"),
]


def test_every_area_covered_is_no_gap():
    assert tiers.missing_areas(EVERY_AREA) == []


def test_each_missing_area_is_named():
    for lost in range(len(EVERY_AREA)):
        kept = EVERY_AREA[:lost] + EVERY_AREA[lost + 1 :]
        assert tiers.missing_areas(kept) == [list(tiers.AREAS)[lost]]


def test_the_patch_tool_counts_only_against_the_toy_repo():
    no_toy = [item("tests/patchtool/test_refnames.py"), *EVERY_AREA[1:]]
    assert tiers.missing_areas(no_toy) == ["the patch tool on the toy repo"]


def test_only_plain_pytest_is_checked():
    def config(markexpr="not full", keyword="", source="TESTPATHS", deselect=None, ignore=None):
        kinds = SimpleNamespace(TESTPATHS="TESTPATHS", ARGS="ARGS")
        return SimpleNamespace(
            option=SimpleNamespace(markexpr=markexpr, keyword=keyword, deselect=deselect),
            args_source=getattr(kinds, source),
            ArgsSource=kinds,
            getoption=lambda name: ignore,
        )

    assert tiers.is_whole_quick_run(config())
    assert not tiers.is_whole_quick_run(config(markexpr="full"))
    assert not tiers.is_whole_quick_run(config(keyword="softmax"))
    assert not tiers.is_whole_quick_run(config(source="ARGS"))
    assert not tiers.is_whole_quick_run(config(deselect=["tests/x.py"]))
    assert not tiers.is_whole_quick_run(config(ignore=["tests/upstream"]))
