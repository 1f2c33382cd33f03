"""The quick tier's promise: plain ``pytest`` (addopts ``-m 'not full'``) touches every area.

``tests/conftest.py`` checks the collected quick tier against ``AREAS`` and refuses to run one
that lost an area (a tier that passes because it tests nothing there is no tier)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

QUICK = "not full"


def _under(item: Any, *parts: str) -> bool:
    path = item.path.parts
    return any(path[i : i + len(parts)] == parts for i in range(len(path)))


AREAS: dict[str, Callable[[Any], bool]] = {
    "the patch tool on the toy repo": lambda i: _under(i, "patchtool") and "toy" in i.fixturenames,
    "a real sdist": lambda i: i.get_closest_marker("upstream") is not None,
    "kernels under the Triton interpreter": lambda i: (
        i.get_closest_marker("triton_interpreted") is not None
    ),
    "the backend's CPU paths": lambda i: _under(i, "runtime", "backend"),
    "the CLI's errors": lambda i: _under(i, "commands"),
    "install, smoke and doctor": lambda i: _under(i, "envtools"),
}


def missing_areas(items: Iterable[Any]) -> list[str]:
    """The areas no item covers."""
    items = list(items)
    return [name for name, covers in AREAS.items() if not any(covers(i) for i in items)]


def is_whole_quick_run(config: Any) -> bool:
    """Plain ``pytest``: the default tier over the default paths, nothing narrowed."""
    return (
        config.option.markexpr == QUICK
        and not config.option.keyword
        and config.args_source == config.ArgsSource.TESTPATHS
        and not config.option.deselect
        and not config.getoption("ignore")
    )
