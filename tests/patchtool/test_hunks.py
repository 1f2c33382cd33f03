"""The in-memory applier on the cases git diffs produce."""

from __future__ import annotations

import re
import subprocess

import pytest

from megatron_rocm.errors import UsageError
from megatron_rocm.patchtool.hunks import apply_file, parse_diff, split_lines
from megatron_rocm.patchtool.results import HunkLabel


def _diff(tmp_path, old: str | None, new: str | None) -> str:
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    for path, text in ((a, old), (b, new)):
        if text is not None:
            path.write_text(text)
    args = [str(a) if old is not None else "/dev/null", str(b) if new is not None else "/dev/null"]
    out = subprocess.run(
        ["git", "diff", "--no-index", "--full-index", *args], capture_output=True, text=True
    ).stdout
    return out


def _apply(text: str | None, diff: str):
    (fd,) = parse_diff(diff)
    return apply_file(None if text is None else split_lines(text), fd)


def test_no_newline_at_end_of_file(tmp_path):
    old, new = "a\nb\nc", "a\nB\nc"
    out = _apply(old, _diff(tmp_path, old, new))
    assert "".join(out.lines) == new
    assert [r.label for r in out.results] == [HunkLabel.CLEAN]


def test_adding_a_trailing_newline(tmp_path):
    old, new = "a\nb", "a\nb\n"
    assert "".join(_apply(old, _diff(tmp_path, old, new)).lines) == new


def test_new_file_and_already_created(tmp_path):
    diff = _diff(tmp_path, None, "x = 1\n")
    out = _apply(None, diff)
    assert out.lines == ["x = 1\n"] and out.results[0].label is HunkLabel.CLEAN
    assert _apply("x = 1\n", diff).results[0].label is HunkLabel.ALREADY_APPLIED
    assert _apply("y = 2\n", diff).results[0].label is HunkLabel.CONFLICT


def test_deleted_file(tmp_path):
    diff = _diff(tmp_path, "x = 1\n", None)
    assert _apply("x = 1\n", diff).lines is None
    assert _apply(None, diff).results[0].label is HunkLabel.ALREADY_APPLIED


def test_two_hunks_track_offsets(tmp_path):
    old = "".join(f"l{i}\n" for i in range(40))
    new = old.replace("l5\n", "L5\n").replace("l30\n", "L30\n")
    diff = _diff(tmp_path, old, new)
    drifted = "extra\n" * 3 + old.replace("l20\n", "l20\nmore\nmore\n")
    out = _apply(drifted, diff)
    assert [r.label for r in out.results] == [HunkLabel.OFFSET, HunkLabel.OFFSET]
    assert "L5\n" in out.lines and "L30\n" in out.lines and out.results[1].found_at == 28 + 5


def test_repeated_context_picks_nearest_occurrence(tmp_path):
    block = "".join(f"same{i}\n" for i in range(7))
    old = block + "x\n" * 20 + block
    new = old[: len(old) - len(block)] + block.replace("same3", "CHANGED")
    out = _apply(old, _diff(tmp_path, old, new))
    assert "".join(out.lines) == new


def test_malformed_hunk_is_usage_error():
    with pytest.raises(UsageError, match="my.diff"):
        parse_diff("--- a/x\n+++ b/x\n@@ -1,3 +1,3 @@\n a\n", origin="my.diff")


def test_empty_diff_is_usage_error():
    with pytest.raises(UsageError, match="no file changes"):
        parse_diff("", origin="e.diff")


RENAME = """diff --git a/README.md b/README2.md
similarity index 100%
rename from README.md
rename to README2.md
"""

GITLINK = """diff --git a/sub b/sub
new file mode 160000
index 0000000000000000000000000000000000000000..0a89ff9b1b3f5e5d8f3b8d3c2a1b0f9e8d7c6b5a
--- /dev/null
+++ b/sub
@@ -0,0 +1 @@
+Subproject commit 0a89ff9b1b3f5e5d8f3b8d3c2a1b0f9e8d7c6b5a
"""


@pytest.mark.parametrize(
    ("diff", "says"),
    [(RENAME, "renames and copies are not supported"), (GITLINK, "submodule (gitlink)")],
)
def test_what_the_reader_would_drop_or_misapply_is_refused(diff, says):
    with pytest.raises(UsageError, match=re.escape(says)):
        parse_diff(diff, origin="x.diff")


def _git(repo, *args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=repo, check=True, capture_output=True, text=True
    ).stdout


@pytest.mark.parametrize(
    "name", ["docs/a b/c.txt", "a b/b b/c", "q\tb b/x", 'é "b/ z b/', "one space.txt"]
)
def test_a_path_holding_space_b_slash_is_read_as_git_wrote_it(tmp_path, name):
    # unidiff splits "diff --git a/x b/y b/x b/y" at the wrong space: a new file's "+++" line
    # was refused as "Target without source", a deleted file got the path "x b/y b/x"
    name = name.rstrip("/") + "/f" if name.endswith("/") else name
    _git(tmp_path, "init", "-q")
    edited, gone, empty = tmp_path / name, tmp_path / (name + ".old"), tmp_path / (name + ".e")
    edited.parent.mkdir(parents=True, exist_ok=True)
    edited.write_text("a\nb\n")
    gone.write_text("x\n")
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    edited.write_text("a\nB\n")
    gone.unlink()
    empty.write_text("")
    (tmp_path / (name + ".new")).write_text("n\n")
    _git(tmp_path, "add", "-A")
    diff = _git(tmp_path, "-c", "core.quotepath=false", "diff", "--cached", "--full-index")
    got = {fd.path: (fd.is_new, fd.is_deleted) for fd in parse_diff(diff)}
    assert got == {
        name: (False, False),
        name + ".old": (False, True),
        name + ".e": (True, False),
        name + ".new": (True, False),
    }
    (fd,) = [fd for fd in parse_diff(diff) if fd.path == name]
    assert "".join(apply_file(["a\n", "b\n"], fd).lines) == "a\nB\n"
