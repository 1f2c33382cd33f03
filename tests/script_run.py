"""The repository's scripts run as a user runs them: ``python -m`` from the repository root,
in a child process, its output captured as text (the tests of ``scripts/``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_module(module: str, *args: Path | str) -> subprocess.CompletedProcess:
    """``python -m module args...`` from the repository root; never raises on its exit code."""
    return subprocess.run(
        [sys.executable, "-m", module, *map(str, args)], capture_output=True, text=True, cwd=REPO
    )
