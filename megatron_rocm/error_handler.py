"""Turn exceptions into one line on stderr and a documented exit code (no tracebacks for users)."""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from megatron_rocm.errors import EXIT_INTERRUPTED, FatalError

EXIT_INTERNAL = 4


@dataclass
class Result:
    code: int = 0


def log_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "megatron-rocm" / "megatron-rocm.log"


def _write_log(exc: BaseException) -> Path:
    path = log_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(traceback.format_exception(exc)), encoding="utf-8")
    except OSError:
        fd, name = tempfile.mkstemp(prefix="megatron-rocm-", suffix=".log")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write("".join(traceback.format_exception(exc)))
        path = Path(name)
    return path


@contextlib.contextmanager
def error_handler() -> Iterator[Result]:
    """Yield a ``Result`` whose ``code`` the caller sets; map exceptions to exit codes."""
    result = Result()
    try:
        yield result
    except FatalError as e:
        print(f"megatron-rocm: error: {e}", file=sys.stderr)
        result.code = e.code
    except KeyboardInterrupt:
        print("megatron-rocm: interrupted", file=sys.stderr)
        result.code = EXIT_INTERRUPTED
    except BrokenPipeError:
        result.code = 1
    except Exception as e:  # noqa: BLE001 - the boundary: anything else is a bug
        path = _write_log(e)
        print(
            f"megatron-rocm: internal error: {type(e).__name__}: {e} (traceback in {path})",
            file=sys.stderr,
        )
        result.code = EXIT_INTERNAL
