"""``python3 -m megatron_rocm.patchtool.normalize``: the command line of :mod:`..patchtool.normalize`.

Here, not in the patch tool, because it is the CLI's error handling that turns errors into
one line and an exit code; the patch tool imports nothing from the CLI.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from megatron_rocm.error_handler import error_handler
from megatron_rocm.patchtool.normalize import normalize


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m megatron_rocm.patchtool.normalize")
    parser.add_argument("series", nargs="?", default=None, help="series folder (default: patches/)")
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if needed")
    args = parser.parse_args(argv)
    with error_handler() as result:
        result.code = normalize(args.series, args.check)
    return result.code
