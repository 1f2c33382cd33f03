"""Apply a unified diff to file contents in memory, labelling every hunk.

Why not ``git apply``: ``check`` must say *how* each hunk lands (clean, offset, fuzz, already
applied, ...) for dozens of tags in seconds, without a checkout. ``git apply`` only says yes or
no per file. The rules follow GNU patch: exact position first, then the nearest offset, then
up to two lines of context dropped at each end (fuzz).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import unidiff

from megatron_rocm.errors import UsageError
from megatron_rocm.patchtool.results import HunkLabel, HunkResult, accepts

MAX_FUZZ = 2
_LINE_RE = re.compile(r"[^\n]*\n|[^\n]+\Z")
_INDEX_RE = re.compile(r"^index ([0-9a-f]+)\.\.([0-9a-f]+)(?: (\d+))?$", re.M)
_MODE_RE = re.compile(r"^new file mode (\d+)$", re.M)
_MODE_CHANGE_RE = re.compile(r"^old mode (\d+)\nnew mode (\d+)$", re.M)
_RENAME_RE = re.compile(r"^(rename|copy) from ", re.M)
_GITLINK_RE = re.compile(r"^(?:new file mode|deleted file mode|index \S+) 160000$", re.M)
_SPACED_HEADER = re.compile(r"^diff --git [^\n]* [^\n]* ", re.M)  # a name holds a space


@dataclass
class Hunk:
    old_start: int  # 1-based, as in the @@ header
    old: list[str]  # context + removed lines, with their newlines
    new: list[str]  # context + added lines
    lead: int  # context lines before the first change
    trail: int  # context lines after the last change
    text: str


@dataclass
class FileDiff:
    path: str  # the file this diff edits (target path; source path for deletions)
    is_new: bool
    is_deleted: bool
    old_blob: str | None  # full preimage blob id from the 'index' line, if any
    new_mode: str | None
    hunks: list[Hunk] = field(default_factory=list)


def split_lines(text: str) -> list[str]:
    return _LINE_RE.findall(text)


def decode(data: bytes) -> str:
    return data.decode("utf-8", errors="surrogateescape")


def encode(text: str) -> bytes:
    return text.encode("utf-8", errors="surrogateescape")


_ESCAPES = {"a": 7, "b": 8, "t": 9, "n": 10, "v": 11, "f": 12, "r": 13, '"': 34, "\\": 92}
_OCTAL = re.compile(r"[0-7]{3}")


def unquote(name: str) -> str:
    """A path as git writes it in a diff header, with its C-style quoting undone: ``"a\\tb"``
    is ``a<TAB>b``, ``\\303\\251`` is the UTF-8 bytes of ``é``. Names without quotes are
    returned as they are. Stripping only the quotes would make a file called ``a\\nb.py``."""
    if len(name) < 2 or not (name.startswith('"') and name.endswith('"')):
        return name
    body, out, i = name[1:-1], bytearray(), 0
    while i < len(body):
        if body[i] != "\\":
            out += body[i].encode("utf-8", errors="surrogateescape")
            i += 1
        elif body[i + 1 : i + 2] in _ESCAPES:
            out.append(_ESCAPES[body[i + 1]])
            i += 2
        elif _OCTAL.fullmatch(body[i + 1 : i + 4]):
            out.append(int(body[i + 1 : i + 4], 8))
            i += 4
        else:
            raise UsageError(f"corrupt or malformed diff (bad quoting in path {name})")
    return out.decode("utf-8", errors="surrogateescape")


def _quote(name: str) -> str:
    """``name`` C-quoted as ``unquote`` reads it, every space, control and non-ASCII byte as
    an octal escape: a quoted name with no space in it."""
    out = []
    for byte in name.encode("utf-8", errors="surrogateescape"):
        if byte in (0x22, 0x5C):
            out.append("\\" + chr(byte))
        elif byte <= 0x20 or byte >= 0x7F:
            out.append(f"\\{byte:03o}")
        else:
            out.append(chr(byte))
    return '"' + "".join(out) + '"'


def _header_name(names: str) -> str | None:
    """The one path of a ``diff --git`` line's ``a/X b/X`` (quoted or not), found as git
    finds it: the split where both halves name the same file. None for two different names
    (a rename or copy, refused later) or a line that is not of this form."""
    if names.startswith('"'):
        end = 1
        while end < len(names) and names[end] != '"':
            end += 2 if names[end] == "\\" else 1
        if names[end + 1 : end + 3] != ' "':
            return None
        a, b = _unquoted(names[: end + 1]), _unquoted(names[end + 2 :])
        if a is None or b is None:
            return None
    else:
        half = (len(names) - 1) // 2
        a, b = names[:half], names[half + 1 :]
        if names[half : half + 1] != " ":
            return None
    if a[:2] == "a/" and b[:2] == "b/" and a[2:] == b[2:]:
        return a[2:]
    return None


def _spaces_quoted(text: str) -> str:
    """``text`` with the names of a file whose path holds a space written quoted, space and
    all escaped, in its ``diff --git``, ``---`` and ``+++`` lines (only for the parser: the
    stored diff is git's). unidiff splits ``diff --git a/x b/y b/x b/y`` at the wrong space: a
    new file's ``+++`` line then looked like a second file's ("Target without source"), and a
    deleted file got the path ``x b/y b/x``."""
    if not _SPACED_HEADER.search(text):
        return text
    out: list[str] = []
    name: str | None = None  # the spaced path of the file whose header lines these are
    for line in split_lines(text):
        if line.startswith("diff --git "):
            name = _header_name(line[len("diff --git ") :].rstrip("\n"))
            if name is not None and " " in name:
                line = f"diff --git {_quote('a/' + name)} {_quote('b/' + name)}\n"
            else:
                name = None
        elif line.startswith("@@"):
            name = None  # hunk lines from here on: a "--- x" is a removed line
        elif name is not None and line.startswith(("--- ", "+++ ")):
            side = "a/" if line[0] == "-" else "b/"
            given = line[4:].rstrip("\n").removesuffix("\t")
            if given != "/dev/null" and _unquoted(given) == side + name:
                line = f"{line[:4]}{_quote(side + name)}\n"
        out.append(line)
    return "".join(out)


def _unquoted(name: str) -> str | None:
    try:
        return unquote(name)
    except UsageError:
        return None


def _strip_prefix(name: str) -> str:
    name = unquote(name)
    return name[2:] if name[:2] in ("a/", "b/") else name


def _check_tree_path(path: str, origin: str) -> None:
    """A diff may only name files inside the work tree: relative, no empty, ``.`` or ``..``
    component, nothing in ``.git``."""
    parts = path.split("/")
    if (
        not path
        or path.startswith("/")
        or any(part in ("", ".", "..") for part in parts)
        or any(part.lower() == ".git" for part in parts)
    ):
        raise UsageError(
            f"{origin}: corrupt or malformed diff (path {path!r} is not a file inside the tree)"
        )


def _hunk(h: unidiff.Hunk) -> Hunk:
    old: list[str] = []
    new: list[str] = []
    kinds: list[str] = []
    for line in h:
        if line.line_type == "\\":  # "\ No newline at end of file" applies to the line before
            prev = kinds[-1] if kinds else " "
            if prev in (" ", "-") and old:
                old[-1] = old[-1].rstrip("\n")
            if prev in (" ", "+") and new:
                new[-1] = new[-1].rstrip("\n")
            continue
        kinds.append(line.line_type)
        if line.line_type in (" ", "-"):
            old.append(line.value)
        if line.line_type in (" ", "+"):
            new.append(line.value)
    lead = next((i for i, k in enumerate(kinds) if k != " "), len(kinds))
    trail = next((i for i, k in enumerate(reversed(kinds)) if k != " "), len(kinds))
    return Hunk(h.source_start, old, new, lead, trail, str(h))


def parse_diff(text: str, origin: str = "diff") -> list[FileDiff]:
    """Parse a git diff; a malformed or empty one is a usage error naming ``origin``.

    Malformed includes what the parser would skip without a word: a hunk header it cannot read
    (its hunk would be dropped, and the patch reported as applied without it) and a path that
    is not a plain path inside the tree (``git update-index`` ignores a ``.git/`` or absolute
    one, which made an empty commit called applied)."""
    try:
        patch_set = unidiff.PatchSet(_spaces_quoted(text))
    except unidiff.UnidiffParseError as e:
        raise UsageError(f"{origin}: corrupt or malformed diff ({e})") from None
    if not len(patch_set):
        raise UsageError(f"{origin}: contains no file changes (empty or not a unified diff)")
    headers = sum(1 for line in text.splitlines() if line.startswith("@@"))
    readable = sum(len(pf) for pf in patch_set)
    if headers != readable:
        raise UsageError(
            f"{origin}: corrupt or malformed diff ({headers - readable} of its {headers} hunk "
            "headers cannot be read)"
        )
    files = []
    for pf in patch_set:
        path = _strip_prefix(pf.source_file if pf.is_removed_file else pf.target_file)
        if getattr(pf, "is_binary_file", False):
            raise UsageError(f"{origin}: binary changes are not supported ({path})")
        info = str(pf.patch_info or "")
        index = _INDEX_RE.search(info)
        mode = _MODE_RE.search(info)
        for name in (pf.source_file, pf.target_file):
            if name != "/dev/null":
                _check_tree_path(_strip_prefix(name), origin)
        if _RENAME_RE.search(info):  # the reader sees only the target: the rename is dropped
            raise UsageError(
                f"{origin}: renames and copies are not supported ({path}); write the diff "
                "with --no-renames"
            )
        if _GITLINK_RE.search(info):  # a submodule's commit is not a file's text
            raise UsageError(f"{origin}: submodule (gitlink) changes are not supported ({path})")
        change = _MODE_CHANGE_RE.search(info)
        if change:  # apply keeps a file's mode: a change of it would be dropped without a word
            raise UsageError(
                f"{origin}: mode changes are not supported ({path}: {change[1]} -> {change[2]})"
            )
        old_blob = index.group(1) if index and len(index.group(1)) == 40 else None
        fd = FileDiff(
            path,
            pf.is_added_file,
            pf.is_removed_file,
            old_blob,
            mode.group(1) if mode else None,
            [_hunk(h) for h in pf],
        )
        files.append(fd)
    return files


def _matches(lines: list[str], seq: list[str], pos: int) -> bool:
    return 0 <= pos and pos + len(seq) <= len(lines) and lines[pos : pos + len(seq)] == seq


def _nearest(lines: list[str], seq: list[str], expected: int, lo: int) -> int | None:
    """Position of ``seq`` in ``lines`` at or after ``lo`` closest to ``expected``."""
    if not seq:
        return max(lo, min(expected, len(lines)))
    best: int | None = None
    first = seq[0]
    for i in range(lo, len(lines) - len(seq) + 1):
        if lines[i] == first and lines[i : i + len(seq)] == seq:
            if best is None or abs(i - expected) < abs(best - expected):
                best = i
            elif i > expected:
                break
    return best


def _mismatch(lines: list[str], old: list[str], expected: int) -> str:
    """Name the first upstream line that no longer matches, where the hunk fits best."""
    best, best_score = expected, -1
    for pos in range(max(0, len(lines) - len(old) + 1)):
        score = sum(1 for k, want in enumerate(old) if lines[pos + k] == want)
        if score > best_score or (
            score == best_score and abs(pos - expected) < abs(best - expected)
        ):
            best, best_score = pos, score
    for k, want in enumerate(old):
        pos = best + k
        have = lines[pos] if 0 <= pos < len(lines) else "<end of file>"
        if have != want:
            return f"line {pos + 1}: expected {want.rstrip()!r}, upstream has {have.rstrip()!r}"
    return f"hunk context not found near line {expected + 1}"


@dataclass
class FileOutcome:
    lines: list[str] | None  # None: the file does not exist afterwards
    results: list[HunkResult]


def apply_file(lines: list[str] | None, fd: FileDiff) -> FileOutcome:
    """Apply one file's hunks to ``lines`` (None = file absent); label each hunk."""

    def result(
        i: int, h: Hunk, label: HunkLabel, at: int | None = None, detail: str = ""
    ) -> HunkResult:
        return HunkResult(fd.path, i + 1, label, h.old_start, at, detail, h.text)

    if fd.is_new:
        new = [ln for h in fd.hunks for ln in h.new]
        if lines is None:
            return FileOutcome(
                new, [result(i, h, HunkLabel.CLEAN, 1) for i, h in enumerate(fd.hunks)]
            )
        label = HunkLabel.ALREADY_APPLIED if lines == new else HunkLabel.CONFLICT
        detail = "" if label is HunkLabel.ALREADY_APPLIED else "file to be created already exists"
        return FileOutcome(
            lines, [result(i, h, label, None, detail) for i, h in enumerate(fd.hunks)]
        )
    if lines is None:
        label = HunkLabel.ALREADY_APPLIED if fd.is_deleted else HunkLabel.FILE_GONE
        detail = "" if fd.is_deleted else f"{fd.path} does not exist in this tree"
        return FileOutcome(
            None, [result(i, h, label, None, detail) for i, h in enumerate(fd.hunks)]
        )

    out = list(lines)
    results: list[HunkResult] = []
    delta = 0
    floor = 0  # hunks land in order and never overlap
    for i, h in enumerate(fd.hunks):
        base = h.old_start - 1 if h.old else h.old_start
        expected = max(base + delta, 0)
        label, pos, old, new, start = _place(out, h, expected, floor)
        if label is HunkLabel.CONFLICT:
            results.append(result(i, h, label, None, _mismatch(out, h.old, expected)))
            continue
        assert pos is not None
        results.append(result(i, h, label, pos + 1))
        delta = start - base + len(h.new) - len(h.old)
        if label is HunkLabel.ALREADY_APPLIED:
            floor = pos + len(h.new)
            continue
        out[pos : pos + len(old)] = new
        floor = pos + len(new)
    if fd.is_deleted and all(accepts(r.label) for r in results):
        return FileOutcome(None, results)
    return FileOutcome(out, results)


def _place(
    lines: list[str], h: Hunk, expected: int, floor: int
) -> tuple[HunkLabel, int | None, list[str], list[str], int]:
    """Find where a hunk goes: (label, position, preimage used, postimage used, hunk start).

    The hunk start differs from the position only under fuzz, where leading context is cut.
    """
    if expected >= floor and _matches(lines, h.old, expected):
        return HunkLabel.CLEAN, expected, h.old, h.new, expected
    changes = h.old != h.new
    if changes and expected >= floor and h.new and _matches(lines, h.new, expected):
        return HunkLabel.ALREADY_APPLIED, expected, h.new, h.new, expected
    pos = _nearest(lines, h.old, expected, floor) if h.old else None
    if pos is not None:
        return HunkLabel.OFFSET, pos, h.old, h.new, pos
    if changes and h.new:
        pos = _nearest(lines, h.new, expected, floor)
        if pos is not None:
            return HunkLabel.ALREADY_APPLIED, pos, h.new, h.new, pos
    for fuzz in range(1, MAX_FUZZ + 1):
        cut_lead = min(fuzz, h.lead)
        cut_trail = min(fuzz, h.trail)
        if cut_lead == 0 and cut_trail == 0:
            continue
        old = h.old[cut_lead : len(h.old) - cut_trail]
        new = h.new[cut_lead : len(h.new) - cut_trail]
        if not old:
            break
        pos = _nearest(lines, old, expected + cut_lead, floor)
        if pos is not None:
            return HunkLabel.FUZZ, pos, old, new, pos - cut_lead
    return HunkLabel.CONFLICT, None, h.old, h.new, expected
