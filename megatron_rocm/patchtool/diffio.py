"""The one reader and writer of the series' diff files.

A diff file is a unified git diff, optionally preceded by a mail header that makes it a
``git am`` patch::

    From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001
    From: megatron-rocm <megatron-rocm@users.noreply.github.com>
    Subject: [PATCH] <the patch's reason>

    Megatron-ROCm-Patch: <id>
    ---
    diff --git a/... b/...

Why a fixed header: ``git am patches/<id>/<variant>.diff`` then makes the same commit message
as ``apply`` (reason, blank line, trailer), and the bytes depend only on ``patch.toml`` and the
diff, so ``export`` of an unchanged fork stays a zero diff. Files without the header are read
the same way (the header is optional); ``python -m megatron_rocm.patchtool.normalize`` adds it.
"""

from __future__ import annotations

import email.header
import re
from pathlib import Path

from megatron_rocm.errors import UsageError
from megatron_rocm.patchtool.hunks import FileDiff, parse_diff
from megatron_rocm.patchtool.series import Series

TRAILER = "Megatron-ROCm-Patch"
FROM_LINE = "From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001"
AUTHOR = "megatron-rocm <megatron-rocm@users.noreply.github.com>"
_DIFF_START = re.compile(r"^diff --git ", re.M)
_TRAILER_RE = re.compile(rf"^{TRAILER}:\s*(\S+)\s*$", re.M)

_cache: dict[tuple[str, int, int], tuple[str | None, list[FileDiff]]] = {}


def split(text: str) -> tuple[str, str]:
    """(mail header or "", the diff from its first ``diff --git`` line)."""
    m = _DIFF_START.search(text)
    if m is None:
        return "", text
    return text[: m.start()], text[m.start() :]


def header_patch_id(header: str) -> str | None:
    m = _TRAILER_RE.search(header)
    return m.group(1) if m else None


def read_text(path: Path) -> str:
    """A diff file's text, byte for byte: no newline translation, so the ``\r`` of a hunk
    line of a CRLF file (upstream has some) is kept, as ``git apply`` keeps it."""
    try:
        return path.read_bytes().decode("utf-8", errors="surrogateescape")
    except OSError as e:
        raise UsageError(f"cannot read {path}: {e.strerror}") from None


def body(path: Path) -> str:
    """The diff part of a diff file (what ``git apply`` reads)."""
    return split(read_text(path))[1]


def load(path: Path, patch_id: str | None = None) -> list[FileDiff]:
    """Parse a diff file, header or not; checks that a header names ``patch_id``.

    Cached by path, size and modification time: the matrix reads each variant once per tag.
    """
    try:
        st = path.stat()
    except OSError as e:
        raise UsageError(f"cannot read {path}: {e.strerror}") from None
    key = (str(path), st.st_mtime_ns, st.st_size)
    if key not in _cache:
        header, diff = split(read_text(path))
        _cache[key] = (header_patch_id(header), parse_diff(diff, origin=str(path)))
    named, files = _cache[key]
    if patch_id and named and named != patch_id:
        raise UsageError(f"{path}: its header names patch {named!r}, not {patch_id!r}")
    return files


def read_all(series: Series) -> None:
    """Read every variant's diff now (~50 files, well under a second), so that a corrupt one
    is bad input before anything is cloned or fetched, not after."""
    for patch in series.patches:
        for variant in patch.variants:
            if not variant.skip:
                load(patch.diff_path(variant), patch.id)


def parse_text(text: str, origin: str) -> list[FileDiff]:
    """Diff text made in memory (``export``'s, before it is written), read by the rules a diff
    file is read by: what ``load`` would refuse later is refused now."""
    return parse_diff(split(text)[1], origin=origin)


def _subject(reason: str) -> str:
    line = " ".join(reason.split())
    if line.isascii():
        return f"Subject: [PATCH] {line}"
    return "Subject: " + email.header.Header(f"[PATCH] {line}", "utf-8").encode()


def header(patch_id: str, reason: str) -> str:
    return f"{FROM_LINE}\nFrom: {AUTHOR}\n{_subject(reason)}\n\n{TRAILER}: {patch_id}\n---\n"


def render(patch_id: str, reason: str, diff: bytes | str) -> bytes:
    """A diff file's bytes: the header for ``patch_id``, then ``diff`` (a header is dropped)."""
    text = diff if isinstance(diff, str) else diff.decode("utf-8", errors="surrogateescape")
    _, only = split(text)
    return (header(patch_id, reason) + only).encode("utf-8", errors="surrogateescape")
