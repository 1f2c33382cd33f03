"""Options several verbs share, declared once so that their help reads the same everywhere."""

from __future__ import annotations

import argparse

DEFAULT_SOURCE_HELP = (
    "where upstream comes from: a git URL (default: https://github.com/NVIDIA/Megatron-LM.git), "
    "a local clone or mirror path, or 'pypi' for a megatron-core sdist"
)


def add_source(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--source", default=None, help=DEFAULT_SOURCE_HELP)


def add_series(parser: argparse.ArgumentParser, version: bool = True) -> None:
    parser.add_argument(
        "--series",
        default=None,
        metavar="DIR",
        help="patch series folder (default: $MEGATRON_ROCM_SERIES or the bundled patches/)",
    )
    if not version:  # a verb that reads no tree has no version to override
        return
    parser.add_argument(
        "--megatron-version",
        default=None,
        metavar="X.Y.Z",
        help="override the version read from megatron/core/package_info.py",
    )


def add_json(parser: argparse.ArgumentParser) -> None:
    """``--json``: one document on stdout (``main`` then prints an error as one too)."""
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")
    parser.prints_json = True  # type: ignore[attr-defined]
