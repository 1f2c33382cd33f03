"""One apply at a time per repository: a pid lock file inside the git directory."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from megatron_rocm.errors import FatalError

LOCK_NAME = "megatron-rocm.lock"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def repo_lock(git_dir: Path) -> Iterator[None]:
    """Refuse (never wait forever) when another live process holds the lock; clear stale ones."""
    path = git_dir / LOCK_NAME
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                pid = int(path.read_text().strip() or 0)
            except (OSError, ValueError):
                pid = 0
            if pid and _alive(pid):
                raise FatalError(
                    f"another megatron-rocm apply (pid {pid}) is working on {git_dir.parent}; "
                    "wait for it to finish"
                ) from None
            path.unlink(missing_ok=True)  # stale: its process is gone
            continue
        with os.fdopen(fd, "w") as f:
            f.write(str(os.getpid()))
        break
    else:
        raise FatalError(f"cannot take the lock {path}")
    try:
        yield
    finally:
        path.unlink(missing_ok=True)
