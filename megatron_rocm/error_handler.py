"""Turn exceptions into one line on stderr and a documented exit code (no tracebacks for users).

``FatalError`` subclasses carry their own code. An ``OSError`` that escapes a verb is the
environment's doing (disk full, permissions, a folder where a file should be): exit 3 with one
line. Anything else is a bug: exit 4, the traceback goes to the log the line names.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from megatron_rocm.cache import cache_dir
from megatron_rocm.errors import (
    EXIT_ENVIRONMENT,
    EXIT_INTERNAL,
    EXIT_INTERRUPTED,
    FatalError,
    Interrupted,
    clip,
)
from megatron_rocm.output import json_printed, print_json, stdout_closed

__all__ = [
    "EXIT_INTERNAL",
    "Result",
    "error_handler",
    "interrupted_code",
    "interrupted_line",
    "log_path",
    "say",
]


@dataclass
class Result:
    code: int = 0


def log_path() -> Path:
    return cache_dir() / "megatron-rocm.log"


def _write_log(exc: BaseException) -> Path:
    text = "".join(traceback.format_exception(exc))
    try:
        path = log_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    except (OSError, FatalError):  # no cache folder either: a temporary file holds it
        fd, name = tempfile.mkstemp(prefix="megatron-rocm-", suffix=".log")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        path = Path(name)
    return path


def say(line: str) -> None:
    """One line on stderr, with control characters escaped so it stays one line."""
    flat = clip(line).replace("\r", "\\r").replace("\n", "\\n")
    try:
        print(f"megatron-rocm: {flat}", file=sys.stderr, flush=True)
    except OSError:
        pass  # stderr itself is gone: the exit code still says it


def _os_error_line(e: OSError) -> str:
    what = e.strerror or type(e).__name__
    where = f": {e.filename}" if e.filename else ""
    return f"error: {what}{where}"


def interrupted_code(e: KeyboardInterrupt) -> int:
    """128 + the signal: SIGINT's unless an ``Interrupted`` names another."""
    return e.code if isinstance(e, Interrupted) else EXIT_INTERRUPTED


def interrupted_line(e: KeyboardInterrupt) -> str:
    return e.message if isinstance(e, Interrupted) else "interrupted"


@contextlib.contextmanager
def error_handler(as_json: bool = False) -> Iterator[Result]:
    """Yield a ``Result`` whose ``code`` the caller sets; map exceptions to exit codes.

    With ``as_json`` (the verb's ``--json``) an error also prints ``{"ok": false, "error":
    ..., "exit_code": ...}`` on stdout, unless the verb printed its own document first, so a
    reader of stdout always gets one JSON document."""
    result = Result()
    try:
        yield result
    except FatalError as e:
        _fail(result, f"error: {e}", e.code, as_json)
    except KeyboardInterrupt as e:
        _fail(result, interrupted_line(e), interrupted_code(e), as_json)
    except BrokenPipeError as e:
        if stdout_closed():
            return  # the reader went away (`| head`): not an error, keep the verb's code
        path = _write_log(e)
        _fail(result, f"{_os_error_line(e)} (details in {path})", EXIT_ENVIRONMENT, as_json)
    except OSError as e:
        path = _write_log(e)
        _fail(result, f"{_os_error_line(e)} (details in {path})", EXIT_ENVIRONMENT, as_json)
    except Exception as e:  # noqa: BLE001 - the boundary: anything else is a bug
        path = _write_log(e)
        line = f"internal error: {type(e).__name__}: {e} (traceback in {path})"
        _fail(result, line, EXIT_INTERNAL, as_json)


def _fail(result: Result, line: str, code: int, as_json: bool) -> None:
    """Say ``line`` on stderr, set the exit code and, for ``--json``, the error document."""
    line = clip(line)
    say(line)
    result.code = code
    if as_json and not json_printed():
        with contextlib.suppress(OSError):
            print_json({"ok": False, "error": line, "exit_code": code})
