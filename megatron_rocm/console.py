"""The console command's entry point: only the standard library until a Ctrl-C has a handler.

The CLI's own modules take longer to import than Python takes to start; a Ctrl-C landing
while they load raised ``KeyboardInterrupt`` inside an import, and Python printed a traceback
before ``main`` could turn it into one line. This module installs a handler first, then
imports the CLI: an interrupt until then says so in one line and exits ``128 + signum``, since
nothing can have been changed yet. (Python's own start-up, before any of this runs, cannot be
covered from Python.) A stream closed at start (``>&-``) becomes ``os.devnull``.
"""

from __future__ import annotations

import os
import signal
import sys
from types import FrameType

_LINE = b"megatron-rocm: interrupted while starting; nothing was changed\n"


def _interrupted_while_starting(signum: int, frame: FrameType | None) -> None:
    try:
        os.write(2, _LINE)
    except OSError:  # stderr closed: the exit code still says it
        pass
    raise SystemExit(128 + signum)


def _closed_streams_to_devnull() -> None:
    """Started with stdout or stderr closed (``>&-``), Python sets that stream to None, and
    every print, the error line included, would fail; the run goes on as with ``>/dev/null``
    (what it prints is lost, its exit code is not)."""
    for name in ("stdout", "stderr"):
        if getattr(sys, name) is None:
            setattr(sys, name, open(os.devnull, "w", encoding="utf-8"))  # noqa: SIM115


def cli() -> int:
    """Load the CLI under the start-up handler, then hand SIGINT back to ``main``'s."""
    previous = signal.signal(signal.SIGINT, _interrupted_while_starting)
    _closed_streams_to_devnull()
    from megatron_rocm.main import cli as run

    signal.signal(signal.SIGINT, previous)
    return run()
