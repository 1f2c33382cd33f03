"""All printing: summaries of check/apply results, JSON, notes, and a stdout that a closed
pipe cannot break.

Why the pipe guard: ``megatron-rocm list | head -1`` closes stdout while the verb is still
printing. The verb must finish (an apply must stay applied) and exit with its own code, quietly,
so every write to stdout goes through ``pipe_safe_stdout`` (installed by ``main``).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

from megatron_rocm.errors import SourceError, UsageError
from megatron_rocm.patchtool.results import HunkLabel, PatchResult, RefReport, accepts

_closed = False


def stdout_closed() -> bool:
    """Whether the reader of stdout went away during this run."""
    return _closed


class _PipeSafe(io.TextIOBase):
    """Delegates to the real stdout; after a broken pipe, discards output instead of raising."""

    def __init__(self, inner: TextIO) -> None:
        self._inner = inner

    def _broken(self) -> None:
        global _closed
        _closed = True
        # Point the descriptor at /dev/null: the interpreter's final flush then succeeds
        # instead of printing "Exception ignored ... BrokenPipeError".
        with contextlib.suppress(OSError, ValueError, io.UnsupportedOperation):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._inner.fileno())
            os.close(devnull)

    def write(self, text: str) -> int:
        if _closed:
            return len(text)
        try:
            return self._inner.write(text)
        except BrokenPipeError:
            self._broken()
            return len(text)

    def flush(self) -> None:
        if _closed:
            return
        try:
            self._inner.flush()
        except BrokenPipeError:
            self._broken()

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return self._inner.isatty()

    def fileno(self) -> int:
        return self._inner.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self._inner, "encoding", "utf-8")


@contextlib.contextmanager
def pipe_safe_stdout() -> Iterator[None]:
    """Install the guard on ``sys.stdout`` for one CLI run; restore the stream afterwards."""
    global _closed, _json_printed
    _closed = _json_printed = False
    inner = sys.stdout
    sys.stdout = _PipeSafe(inner)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stdout = inner


def writable(path: str, option: str, folder: bool = False) -> Path:
    """Check, before any work, that a report can be written at ``path`` (a file, or with
    ``folder`` a folder to hold files): an unwritable target must fail in a second with one
    line (exit 3), not after an hour of work. Missing parents are fine (they get created)."""
    if not path or any(ord(c) < 32 or ord(c) == 127 for c in path):
        raise UsageError(f"{option} {path!r} is not a usable path")
    target = Path(path).expanduser()
    if target.is_dir() and not folder and not path.endswith(("/", "\\")):
        raise UsageError(f"{option} {path} is a folder; give a file name")
    probe = target
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if probe != target and not probe.is_dir():
        raise SourceError(f"cannot write {option} {path}: {probe} is not a folder")
    if probe.is_dir() and not os.access(probe, os.W_OK | os.X_OK):
        raise SourceError(f"cannot write {option} {path}: permission denied on {probe}")
    if probe == target and target.is_file() and not os.access(target, os.W_OK):
        raise SourceError(f"cannot write {option} {path}: permission denied")
    return target


def write_file(path: Path, text: str, option: str) -> None:
    """Write a report; an OSError is the environment's (exit 3, one line)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    except OSError as e:
        raise SourceError(f"cannot write {option} {path}: {e.strerror}") from None


def note(text: str) -> None:
    """A remark for the person at the terminal (stderr, so JSON on stdout stays parseable)."""
    print(f"note: {text}", file=sys.stderr, flush=True)


_json_printed = False


def json_printed() -> bool:
    """Whether this run printed its JSON document already (an error then adds none)."""
    return _json_printed


def print_json(data: Any) -> None:
    """The run's one JSON document on stdout (``--json``)."""
    global _json_printed
    json.dump(data, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")
    _json_printed = True


def hunk_summary(p: PatchResult) -> str:
    if p.error:
        return p.error
    if p.variant == "skip":
        return "upstream has the change" if p.merged else "not needed for this version"
    counts = Counter(h.label.value for h in p.hunks)
    order = [lb.value for lb in HunkLabel]
    return ", ".join(f"{counts[k]} {k}" for k in order if counts.get(k))


def first_failure(p: PatchResult, three_way: bool = False) -> str:
    """One line naming the patch, the file, the hunk and the upstream lines that moved."""
    if p.error:
        return f"patch {p.patch_id}: {p.error}"
    for h in p.hunks:
        if not accepts(h.label, three_way):
            return (
                f"patch {p.patch_id} ({p.variant}): {h.path} hunk {h.index} "
                f"{h.label.value}: {h.detail}"
            )
    return f"patch {p.patch_id}: ok"


def print_ref_report(r: RefReport, verbose: bool = False) -> None:
    status = "ok" if r.ok else "FAILS"
    print(f"{r.ref} ({r.commit[:12]}, megatron-core {r.version}): {status}")
    width = max((len(p.patch_id) for p in r.patches), default=10)
    for p in r.patches:
        print(f"  {p.patch_id:<{width}}  {p.status:<15} {p.variant or '-':<16} {hunk_summary(p)}")
        if verbose or not p.ok:
            for h in p.hunks:
                if h.label is not HunkLabel.CLEAN:
                    where = f"line {h.found_at}" if h.found_at else "nowhere"
                    extra = f": {h.detail}" if h.detail else ""
                    print(
                        f"      {h.path} hunk {h.index} (@{h.old_start}) "
                        f"{h.label.value} at {where}{extra}"
                    )
