"""Validation of every user-supplied git name before git sees it (refs, branches, patterns).

Why here and not in git: a value such as ``--upload-pack=touch X;`` or ``-D`` must never reach
git's option parser, and ``@{-1}`` or ``HEAD~1`` must not silently name something else than
the user meant. The rules are git's own ``check-ref-format`` rules (so every name git would
store is accepted), plus: no leading ``-``, no ``@{`` reflog syntax, no revision operators.
A commit id is a valid name too. Rejections are usage errors (exit 2) raised before any clone.
"""

from __future__ import annotations

import re
from pathlib import Path

from megatron_rocm.errors import UsageError

_FORBIDDEN = re.compile(r"[\x00-\x20\x7f~^:?*\[\\]")
_GLOB = re.compile(r"[*?\[]")


def ref_problem(name: str) -> str | None:
    """Why ``name`` is not a ref name we pass to git, or None when it is fine."""
    if not name:
        return "it is empty"
    if name.startswith("-"):
        return "it starts with '-'"
    m = _FORBIDDEN.search(name)
    if m:
        return (
            f"it contains {m.group()!r} (spaces, control characters and ~^:?*[\\ are not allowed)"
        )
    if ".." in name:
        return "it contains '..'"
    if "@{" in name:
        return "it contains '@{'"
    if name == "@":
        return "it is '@'"
    if name.startswith("/") or name.endswith("/") or "//" in name:
        return "it has an empty path component"
    if name.endswith("."):
        return "it ends with '.'"
    for part in name.split("/"):
        if part.startswith("."):
            return f"component {part!r} starts with '.'"
        if part.endswith(".lock"):
            return f"component {part!r} ends with '.lock'"
    return None


def check_ref(name: str, option: str = "--ref") -> str:
    """``name`` when it is a tag, branch or commit name git cannot misread; else UsageError."""
    problem = ref_problem(name)
    if problem:
        raise UsageError(
            f"{option} {name!r} is not a valid ref name: {problem}; give a tag, branch or commit id"
        )
    return name


# git stores a branch as a file named after each path component, and writes ``<name>.lock``
# first: a component longer than the file system's 255 bytes less that suffix fails late.
_MAX_COMPONENT_BYTES = 250


def check_branch(name: str, option: str = "--branch") -> str:
    """A new branch name: a valid ref name that is not ``HEAD`` and not a full ref path."""
    problem = ref_problem(name)
    if problem is None and name == "HEAD":
        problem = "'HEAD' is reserved"
    if problem is None and name.startswith("refs/"):
        problem = "give the short name (without refs/)"
    if problem is None:
        longest = max(len(part.encode()) for part in name.split("/"))
        if longest > _MAX_COMPONENT_BYTES:
            problem = (
                f"a path component is {longest} bytes long (git can store at most "
                f"{_MAX_COMPONENT_BYTES})"
            )
    if problem:
        raise UsageError(f"{option} {name!r} is not a valid branch name: {problem}")
    return name


def is_glob(pattern: str) -> bool:
    return bool(_GLOB.search(pattern))


def check_pattern(pattern: str, option: str = "--tags") -> str:
    """A ref name, or a glob over ref names (``*?[]`` allowed, nothing else of the above)."""
    if not is_glob(pattern):
        return check_ref(pattern, option)
    problem = ref_problem(_GLOB.sub("x", pattern).replace("]", "x"))
    if problem:
        raise UsageError(f"{option} {pattern!r} is not a valid tag pattern: {problem}")
    return pattern


def user_path(value: str | Path, option: str) -> Path:
    """``value`` with ``~`` expanded, made absolute and its links followed. Links that form a
    loop are a usage error here rather than an internal one wherever the path is first used
    (Python 3.11 raises ``RuntimeError`` for them, later versions ``OSError``)."""
    try:
        return Path(value).expanduser().resolve()
    except RuntimeError:
        raise UsageError(f"{option} {value}: its symbolic links form a loop") from None
    except OSError as e:
        raise UsageError(f"{option} {value}: {(e.strerror or str(e)).lower()}") from None


def check_text(value: str, option: str) -> str:
    """A free value (a path, a URL) that ends up in messages and git's argv: one line, and
    not an option. Control characters would break the one-line error contract."""
    if not value:
        raise UsageError(f"{option} is empty")
    if re.search(r"[\x00-\x1f\x7f]", value):
        raise UsageError(f"{option} {value!r} contains a control character")
    return value
