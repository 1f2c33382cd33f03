"""The repository's scripts run as a user runs them: ``python -m`` from the repository root,
in a child process, its output captured as text (the tests of ``scripts/``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_module(
    module: str, *args: Path | str, env: dict[str, str] | None = None, timeout: float = 600
) -> subprocess.CompletedProcess:
    """``python -m module args...`` from the repository root, with ``env`` over this process's
    environment; never raises on its exit code (a child past ``timeout`` seconds raises)."""
    return subprocess.run(
        [sys.executable, "-m", module, *map(str, args)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=None if env is None else {**os.environ, **env},
        timeout=timeout,
    )


def run_interpreted(
    module: str, *args: Path | str, interpret: bool = True
) -> subprocess.CompletedProcess:
    """:func:`run_module` with Triton's CPU interpreter on (``TRITON_INTERPRET=1``) or off."""
    return run_module(module, *args, env={"TRITON_INTERPRET": "1" if interpret else "0"})
