"""The series folder's writes, all or nothing even against SIGKILL: a journal beside the folder.

Why: ``export`` replaces several files (diffs, ``patch.toml``, ``series``) one rename at a time;
a run killed between two renames would leave a half-written series (a new diff without its
``patch.toml`` change, a patch folder no ``series`` line names) that nothing notices. So
before anything is staged a journal lists every (target, staged, original) triple; once every
staged file and every original's link is on disk, one rename marks the journal committed (the
commit point), and only then are the targets replaced. Whoever loads the series next (every
command goes through ``load_series``) finishes a committed write or undoes an uncommitted
one, under the series lock, and removes the journal and the scratch files.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path, PurePosixPath

from megatron_rocm.errors import SourceError
from megatron_rocm.patchtool import interrupts, lock
from megatron_rocm.progress import note

PREPARED, COMMITTED, BACK = "prepared", "committed", "back"  # BACK: a failed rename, undoing

_held: set[Path] = set()  # series folders whose lock this process holds (``writer``)


@dataclass
class Entry:
    target: str  # paths relative to the series folder
    staged: str  # the new content, renamed over ``target``
    original: str | None  # a link to what ``target`` held (None: ``target`` is new)


@dataclass
class Journal:
    state: str
    entries: list[Entry]  # in rename order, the ``series`` listing last
    folders: list[str]  # created by this write: removed again when it is undone
    removals: list[str]  # files no variant names any more: removed once all is in place


def series_lock(folder: Path) -> Path:
    """The one-writer lock of a series folder, beside it as a fresh destination's is (inside,
    a lock left by a killed run would read as a stray file of the series)."""
    return folder.parent / f".{folder.name}.megatron-rocm.lock"


def journal_path(folder: Path) -> Path:
    """Beside the folder, like the lock: the series folder itself holds only the series."""
    return folder.parent / f".{folder.name}.megatron-rocm.journal"


@contextlib.contextmanager
def writer(folder: Path) -> Iterator[None]:
    """Hold the series' one-writer lock (another holder: ``Busy``, exit 5), an interrupted
    write settled first."""
    key = folder.resolve()
    with lock.hold(series_lock(folder), what=f"the series {folder}"):
        _held.add(key)
        try:
            _recover(folder)
            yield
        finally:
            _held.discard(key)


def settle(folder: Path) -> None:
    """Finish or undo the write a killed run left in ``folder``; with none, two ``stat`` calls."""
    path = journal_path(folder)
    if not path.exists() and not _tmp(path).exists():
        return
    if folder.resolve() in _held:
        _recover(folder)
        return
    with lock.hold(series_lock(folder), what=f"the series {folder}", wait=True):
        _recover(folder)


def write(
    folder: Path, files: dict[Path, bytes], folders: list[Path], removals: list[Path]
) -> None:
    """Write ``files`` (paths in ``folder``), creating ``folders`` first and removing
    ``removals`` last, all or nothing. The caller holds ``writer(folder)``."""
    tag = str(os.getpid())
    order = sorted(files, key=lambda p: p.name == "series")

    def rel(p: Path) -> str:
        return p.relative_to(folder).as_posix()

    j = Journal(
        PREPARED,
        [
            Entry(
                rel(p),
                rel(p.with_name(f".{p.name}.{tag}.tmp")),
                rel(p.with_name(f".{p.name}.{tag}.orig")) if p.exists() else None,
            )
            for p in order
        ],
        [rel(f) for f in dict.fromkeys(folders) if not f.exists()],
        [rel(p) for p in removals],
    )
    _save(folder, j)
    try:
        for f in j.folders:
            (folder / f).mkdir()
        for e, p in zip(j.entries, order, strict=True):
            _write_synced(folder / e.staged, files[p])
            if e.original is not None:
                _link(folder / e.target, folder / e.original)
        _sync_dirs(folder, j)
        interrupts.step("export-staged")
        j.state = COMMITTED
        _save(folder, j)  # the commit point
    except BaseException:
        _roll_back(folder, j)
        raise
    try:
        _forward(folder, j, "export-rename")
    except BaseException:
        j.state = BACK  # a rename failed (not a kill): put back what had moved
        _save(folder, j)
        _roll_back(folder, j)
        raise


def _recover(folder: Path) -> None:
    j = _load(folder)
    if j is None:
        return
    if j.state == COMMITTED:
        _forward(folder, j, "recover-rename")
        note(f"finished the write into the series {folder} that an interrupted export left")
    else:
        _roll_back(folder, j)
        note(f"undid the partial write into the series {folder} that an interrupted export left")


def _forward(folder: Path, j: Journal, step: str) -> None:
    """Past the commit point: every staged file is complete, so replace what is still to be
    replaced (a staged file that is gone was renamed already), then clean up."""
    for n, e in enumerate(j.entries, 1):
        interrupts.step(f"{step}-{n}")
        staged = folder / e.staged
        if staged.exists():
            os.replace(staged, folder / e.target)
    _sync_dirs(folder, j)
    for r in j.removals:
        (folder / r).unlink(missing_ok=True)
    for e in j.entries:
        if e.original is not None:
            (folder / e.original).unlink(missing_ok=True)
    _drop(folder)


def _roll_back(folder: Path, j: Journal) -> None:
    """Before the commit point no target was touched: drop the scratch. After it (a failed
    rename), put each original back and remove each new file first."""
    for e in reversed(j.entries):
        target, original = folder / e.target, folder / e.original if e.original else None
        if j.state != PREPARED:
            with contextlib.suppress(OSError):
                if original is None:
                    target.unlink(missing_ok=True)
                elif original.exists():
                    os.replace(original, target)
        with contextlib.suppress(OSError):
            (folder / e.staged).unlink(missing_ok=True)
        if original is not None and original.exists() and _same(original, target):
            with contextlib.suppress(OSError):  # the target holds it (never replaced, or
                original.unlink()  # put back by a rename that failed after all)
    for f in reversed(j.folders):
        with contextlib.suppress(OSError):
            (folder / f).rmdir()
    _sync_dirs(folder, j)
    _drop(folder)


def _same(a: Path, b: Path) -> bool:
    """Whether ``b`` holds ``a``'s bytes (so ``a``, the kept original, may go)."""
    try:
        return a.read_bytes() == b.read_bytes()
    except OSError:
        return False


def _link(target: Path, original: Path) -> None:
    """Keep what ``target`` holds under ``original``: a hard link (atomic, no copy), or a
    synced copy where the file system has none."""
    original.unlink(missing_ok=True)
    try:
        os.link(target, original)
    except OSError:
        shutil.copy2(target, original)
        with open(original, "rb") as f:
            os.fsync(f.fileno())


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _sync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _sync_dirs(folder: Path, j: Journal) -> None:
    for d in {(folder / e.target).parent for e in j.entries} | {folder}:
        _sync_dir(d)


def _tmp(path: Path) -> Path:
    return path.with_name(path.name + ".tmp")


def _save(folder: Path, j: Journal) -> None:
    """Replace the journal with one rename, synced: it is either the old state or the new."""
    path = journal_path(folder)
    _write_synced(_tmp(path), json.dumps(asdict(j)).encode())
    os.replace(_tmp(path), path)
    _sync_dir(path.parent)


def _drop(folder: Path) -> None:
    path = journal_path(folder)
    _tmp(path).unlink(missing_ok=True)
    path.unlink(missing_ok=True)
    _sync_dir(path.parent)


def _load(folder: Path) -> Journal | None:
    path = journal_path(folder)
    _tmp(path).unlink(missing_ok=True)  # never renamed: nothing was staged after it
    if not path.exists():
        return None
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        j = Journal(
            raw["state"],
            [Entry(**e) for e in raw["entries"]],
            list(raw["folders"]),
            list(raw["removals"]),
        )
        names = [n for e in j.entries for n in (e.target, e.staged, e.original) if n is not None]
        if j.state not in (PREPARED, COMMITTED, BACK) or not all(
            _inside(n) for n in names + j.folders + j.removals
        ):
            raise ValueError("a state or path it cannot hold")
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
        raise SourceError(
            f"{path}: not a journal of an interrupted export ({e}); check the series folder "
            "against version control, then remove this file"
        ) from None
    return j


def _inside(name: object) -> bool:
    """A journal path names a file inside the series folder, never one elsewhere."""
    if not isinstance(name, str) or not name or "\0" in name:
        return False
    p = PurePosixPath(name)
    return not p.is_absolute() and ".." not in p.parts
