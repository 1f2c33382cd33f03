"""export: zero diff when unchanged, updated diffs, new patches, new variants."""

from __future__ import annotations

import filecmp
import shutil
import subprocess

import pytest
from toyrepo import apply_argv, make_series, make_upstream, run

from megatron_rocm.main import main


def _tree_equal(a, b) -> bool:
    cmp = filecmp.dircmp(a, b)
    stack = [cmp]
    while stack:
        c = stack.pop()
        if c.left_only or c.right_only or c.diff_files or c.funny_files:
            return False
        stack.extend(c.subdirs.values())
    return True


@pytest.fixture
def fork(tmp_path):
    upstream = make_upstream(tmp_path)
    series = make_series(tmp_path, upstream)
    pristine = tmp_path / "pristine"
    shutil.copytree(series, pristine)
    dest = tmp_path / "fork"
    assert main(apply_argv(upstream, series, dest)) == 0
    return dest, series, pristine


def test_export_of_unchanged_fork_is_byte_identical(fork, capsys):
    dest, series, pristine = fork
    assert main(["export", "--repo", str(dest), "--series", str(series)]) == 0
    assert "0 changed" in capsys.readouterr().out
    assert _tree_equal(series, pristine)


def test_export_after_editing_a_patch_rewrites_only_that_diff(fork, capsys):
    dest, series, pristine = fork
    # the trailer stays in the amended message
    _edit_softmax_patch(dest)
    assert main(["export", "--repo", str(dest), "--series", str(series), "--json"]) == 0
    diff = (series / "p-softmax" / "v0.1.diff").read_text()
    assert "+softmax_30 = 'also'" in diff
    assert (series / "p-norm" / "v0.1.diff").read_bytes() == (
        pristine / "p-norm" / "v0.1.diff"
    ).read_bytes()
    # exporting again right away changes nothing more
    snapshot = (series / "p-softmax" / "v0.1.diff").read_bytes()
    assert main(["export", "--repo", str(dest), "--series", str(series)]) == 0
    assert (series / "p-softmax" / "v0.1.diff").read_bytes() == snapshot


def test_new_commit_on_top_becomes_a_new_patch(fork, capsys):
    dest, series, _ = fork
    (dest / "README.md").write_text("rocm readme\n")
    run("commit", "-qam", "Document ROCm usage", cwd=dest)
    assert main(["export", "--repo", str(dest), "--series", str(series)]) == 0
    assert "document-rocm-usage" in (series / "series").read_text()
    assert main(["list", "--series", str(series)]) == 0
    assert "Document ROCm usage" in capsys.readouterr().out


def _edit_softmax_patch(dest) -> None:
    """Amend the p-softmax commit (the first) and replay the rest, as with a rebase."""
    first = run("rev-list", "--reverse", "core_v0.2.0..HEAD", cwd=dest).splitlines()[0]
    run("checkout", "-q", first, cwd=dest)
    path = dest / "megatron/core/fusions/softmax.py"
    path.write_text(path.read_text().replace("softmax_30 = 30", "softmax_30 = 'also'"))
    run("commit", "-q", "-a", "--amend", "--no-edit", cwd=dest)
    amended = run("rev-parse", "HEAD", cwd=dest)
    run("checkout", "-q", "rocm/core_v0.2.0", cwd=dest)
    run("rebase", "-q", "--onto", amended, first, cwd=dest)


def test_export_new_variant_splits_the_range_of_the_changed_patch_only(fork, capsys):
    dest, series, pristine = fork
    _edit_softmax_patch(dest)
    assert main(["export", "--repo", str(dest), "--series", str(series), "--new-variant"]) == 0
    toml = (series / "p-softmax" / "patch.toml").read_text()
    assert 'until = "0.2.0"' in toml and 'diff = "v0.2.diff"' in toml
    assert "+softmax_30 = 'also'" in (series / "p-softmax" / "v0.2.diff").read_text()
    assert "+softmax_30 = 'also'" not in (series / "p-softmax" / "v0.1.diff").read_text()
    # an unchanged patch keeps its one variant: no copy of the same diff under a new name
    assert _tree_equal(series / "p-norm", pristine / "p-norm")


def test_new_variant_keeps_the_developers_comments_in_patch_toml(fork, capsys):
    dest, series, _ = fork
    toml = series / "p-softmax" / "patch.toml"
    lines = toml.read_text().split("\n")
    lines.insert(3, "# why this patch exists, in the developer's words")
    at = next(i for i, ln in enumerate(lines) if ln.startswith("diff = "))
    lines[at] += "  # what this variant is for"
    toml.write_text("\n".join(lines))
    _edit_softmax_patch(dest)
    assert main(["export", "--repo", str(dest), "--series", str(series), "--new-variant"]) == 0
    text = toml.read_text()
    assert "# why this patch exists, in the developer's words" in text
    assert "  # what this variant is for" in text
    assert 'diff = "v0.2.diff"' in text and 'until = "0.2.0"' in text
    # the series still applies to both ranges
    assert (
        main(
            [
                "check",
                "--source",
                str(dest),
                "--series",
                str(series),
                "--ref",
                "core_v0.1.0",
                "core_v0.2.0",
            ]
        )
        == 0
    )


def test_export_outside_a_fork_is_a_clear_error(tmp_path, capsys):
    repo = make_upstream(tmp_path)
    series = make_series(tmp_path, repo)
    assert main(["export", "--repo", str(repo), "--series", str(series)]) == 2
    assert "not a megatron-rocm fork" in capsys.readouterr().err


def _series_bytes(series) -> dict:
    return {
        p.relative_to(series).as_posix(): p.read_bytes() for p in series.rglob("*") if p.is_file()
    }


def _rewrite(dest, index: int, message: str | None = None, edit: bool = True) -> None:
    """Amend the index-th fork commit (0 = oldest) and replay the rest, as rebase -i would."""
    commits = run("rev-list", "--reverse", "core_v0.2.0..HEAD", cwd=dest).splitlines()
    target, rest = commits[index], commits[index + 1 :]
    run("checkout", "-q", target, cwd=dest)
    if edit:
        path = dest / "README.md"
        path.write_text(path.read_text() + "an edit\n")
    args = ["commit", "-q", "-a", "--amend"]
    args += ["-m", message] if message is not None else ["--no-edit"]
    run(*args, cwd=dest)
    for c in rest:
        run("cherry-pick", "--allow-empty", c, cwd=dest)
    run("checkout", "-q", "-B", "rocm/core_v0.2.0", cwd=dest)


@pytest.mark.parametrize("index", [0, 1])
def test_a_patch_commit_that_lost_its_trailer_is_refused_not_lost(fork, capsys, index):
    """The edit of a trailer-less amend was silently dropped ("0 changed"): now it is named."""
    dest, series, _ = fork
    _rewrite(dest, index, message="Softmax without the vendor kernel" if index == 0 else "norm")
    before = _series_bytes(series)
    assert main(["export", "--repo", str(dest), "--series", str(series)]) == 2
    err = capsys.readouterr().err
    assert "lost its 'Megatron-ROCm-Patch: <id>' trailer" in err
    if index == 0:
        assert "(it looks like patch p-softmax)" in err
    assert _series_bytes(series) == before


def test_a_user_commit_below_a_patch_commit_is_refused(fork, capsys):
    dest, series, _ = fork
    first = run("rev-list", "--reverse", "core_v0.2.0..HEAD", cwd=dest).splitlines()[0]
    tip = run("rev-parse", "HEAD", cwd=dest)
    run("checkout", "-q", "core_v0.2.0", cwd=dest)
    (dest / "README.md").write_text("mine\n")
    run("commit", "-qam", "my change under the patches", cwd=dest)
    for c in run("rev-list", "--reverse", f"{first}^..{tip}", cwd=dest).splitlines():
        run("cherry-pick", c, cwd=dest)
    before = _series_bytes(series)
    assert main(["export", "--repo", str(dest), "--series", str(series)]) == 2
    assert "sits below a patch commit" in capsys.readouterr().err
    assert _series_bytes(series) == before


def test_export_during_a_rebase_is_refused(fork, capsys):
    dest, series, _ = fork
    run("rebase", "-q", "--exec", "false", "HEAD~1", cwd=dest, check=False)
    assert (dest / ".git" / "rebase-merge").exists()
    before = _series_bytes(series)
    assert main(["export", "--repo", str(dest), "--series", str(series)]) == 2
    assert "a rebase is in progress" in capsys.readouterr().err
    assert _series_bytes(series) == before


def test_export_with_uncommitted_edits_is_refused(fork, capsys):
    dest, series, _ = fork
    path = dest / "megatron/core/norm.py"
    path.write_text(path.read_text() + "# not committed\n")
    before = _series_bytes(series)
    assert main(["export", "--repo", str(dest), "--series", str(series)]) == 2
    assert "uncommitted changes (megatron/core/norm.py)" in capsys.readouterr().err
    assert _series_bytes(series) == before


def test_exported_diffs_carry_the_git_am_header(fork):
    dest, series, _ = fork
    _rewrite(dest, 0)  # keeps the trailer: an ordinary edit of p-softmax
    assert main(["export", "--repo", str(dest), "--series", str(series)]) == 0
    text = (series / "p-softmax" / "v0.1.diff").read_text()
    assert text.startswith("From 0000000000000000000000000000000000000000 ")
    assert "Megatron-ROCm-Patch: p-softmax\n---\ndiff --git" in text
    assert "+an edit" in text


def _variant_headers_with_comments(toml) -> None:  # noqa: ANN001
    toml.write_text(toml.read_text().replace("[[variant]]\n", "[[variant]]   # a note\n"))


def test_variant_headers_with_a_comment_are_rewritten_in_place(fork, capsys):
    dest, series, _ = fork
    toml = series / "p-softmax" / "patch.toml"
    _variant_headers_with_comments(toml)
    _edit_softmax_patch(dest)
    assert main(["export", "--repo", str(dest), "--series", str(series), "--new-variant"]) == 0
    text = toml.read_text()
    assert text.count("[[variant]]") == 2 and "[[variant]]   # a note" in text
    assert main(["list", "--series", str(series)]) == 0


def test_a_patch_toml_export_cannot_edit_in_place_is_refused_untouched(fork, capsys):
    dest, series, pristine = fork
    toml = series / "p-softmax" / "patch.toml"
    head, _, _ = toml.read_text().partition("[[variant]]")
    toml.write_text(head + 'variant = [{diff = "v0.1.diff", since = "0.1.0"}]\n')
    before = toml.read_bytes()
    assert main(["list", "--series", str(series)]) == 0  # valid TOML, the same series
    _edit_softmax_patch(dest)
    assert main(["export", "--repo", str(dest), "--series", str(series), "--new-variant"]) == 2
    assert "cannot update its variants in place" in capsys.readouterr().err
    assert toml.read_bytes() == before
    assert _tree_equal(series / "p-norm", pristine / "p-norm")
    assert (series / "p-softmax" / "v0.1.diff").read_bytes() == (
        pristine / "p-softmax" / "v0.1.diff"
    ).read_bytes()


def test_a_chmod_amended_into_a_patch_commit_is_exported(fork, capsys):
    dest, series, _ = fork
    (dest / "tool.sh").write_text("#!/bin/sh\necho hi\n")
    run("add", "tool.sh", cwd=dest)
    run("commit", "-qm", "Add tool", cwd=dest)
    assert main(["export", "--repo", str(dest), "--series", str(series)]) == 0
    run(
        "commit", "-q", "--amend", "-m", "Add tool", "-m", "Megatron-ROCm-Patch: add-tool", cwd=dest
    )
    (dest / "tool.sh").chmod(0o755)
    run("commit", "-q", "-a", "--amend", "--no-edit", cwd=dest)
    capsys.readouterr()
    assert main(["export", "--repo", str(dest), "--series", str(series)]) == 0
    assert "1 changed" in capsys.readouterr().out
    assert "new file mode 100755" in (series / "add-tool" / "v0.2.diff").read_text()


@pytest.mark.parametrize(
    ("message", "problem"),
    [
        (b"", "has no subject"),
        (b"Add thing \x1b[1m", "has a control character in its subject"),
        (b"Caf\xe9 fix", "has a subject that is not UTF-8 text"),
    ],
)
def test_a_new_commit_whose_subject_cannot_be_a_reason_is_refused(fork, capsys, message, problem):  # noqa: ANN001
    dest, series, pristine = fork
    (dest / "README.md").write_text("rocm readme\n")
    run("add", "README.md", cwd=dest)
    tree = run("write-tree", cwd=dest)
    parent = run("rev-parse", "HEAD", cwd=dest)
    body = (
        (
            f"tree {tree}\nparent {parent}\nauthor A <a@x> 0 +0000\ncommitter A <a@x> 0 +0000\n\n"
        ).encode()
        + message
        + b"\n"
    )
    commit = (
        subprocess.run(
            ["git", "hash-object", "-t", "commit", "-w", "--stdin"],
            input=body,
            cwd=dest,
            capture_output=True,
            check=True,
        )
        .stdout.decode()
        .strip()
    )
    run("reset", "-q", "--hard", commit, cwd=dest)
    assert main(["export", "--repo", str(dest), "--series", str(series)]) == 2
    assert problem in capsys.readouterr().err
    assert _tree_equal(series, pristine)


def test_export_refuses_a_reordered_history_the_series_would_not_rebuild(fork, capsys):
    """After ``rebase -i`` moves a later patch below the others, each commit's diff still
    applies to its own parent ("0 changed"), but the series, in its order, makes other
    commits: export proves the round trip first and refuses, naming the commit."""
    dest, series, _ = fork
    path = dest / "megatron/core/fusions/softmax.py"
    path.write_text(path.read_text().replace("softmax_26 = 26", "softmax_26 = 'tuned'"))
    run("commit", "-qam", "Tune softmax", cwd=dest)
    assert main(["export", "--repo", str(dest), "--series", str(series)]) == 0
    assert "tune-softmax" in (series / "series").read_text()
    run(
        "commit",
        "-q",
        "--amend",
        "-m",
        "Tune softmax\n\nMegatron-ROCm-Patch: tune-softmax",
        cwd=dest,
    )
    softmax, norm, tune = run("rev-list", "--reverse", "core_v0.2.0..HEAD", cwd=dest).split()
    run("checkout", "-q", "-B", "reordered", "core_v0.2.0", cwd=dest)
    for commit in (tune, softmax, norm):  # what `git rebase -i` makes of a moved line
        run("cherry-pick", commit, cwd=dest)
    before = {p.relative_to(series): p.read_bytes() for p in series.rglob("*") if p.is_file()}
    capsys.readouterr()

    assert main(["export", "--repo", str(dest), "--series", str(series)]) == 1
    err = capsys.readouterr().err
    assert run("rev-parse", "--short=12", "HEAD~2", cwd=dest) in err  # the moved commit
    assert "'Tune softmax'" in err and "nothing was written" in err
    assert len(err.strip().splitlines()) == 1
    after = {p.relative_to(series): p.read_bytes() for p in series.rglob("*") if p.is_file()}
    assert after == before


def test_export_refuses_a_hand_resolved_reorder_whose_diffs_no_longer_chain(fork, capsys):
    """Two patches on neighbouring lines, moved past each other with the conflicts resolved
    by hand: each commit's new diff is right for its own parent, but written in the series'
    order the first no longer applies. Export refuses instead of breaking every apply."""
    dest, series, _ = fork
    path = dest / "megatron/core/fusions/softmax.py"
    path.write_text(path.read_text().replace("softmax_21 = 21", "softmax_21 = 'tuned'"))
    run("commit", "-qam", "Tune softmax", cwd=dest)
    assert main(["export", "--repo", str(dest), "--series", str(series)]) == 0
    run(
        "commit",
        "-q",
        "--amend",
        "-m",
        "Tune softmax\n\nMegatron-ROCm-Patch: tune-softmax",
        cwd=dest,
    )
    softmax, norm, tune = run("rev-list", "--reverse", "core_v0.2.0..HEAD", cwd=dest).split()
    run("checkout", "-q", "-B", "reordered", "core_v0.2.0", cwd=dest)
    base = path.read_text()
    resolved = {  # by hand, as the conflicts of `rebase -i` ask
        tune: base.replace("softmax_21 = 21", "softmax_21 = 'tuned'"),
        softmax: base.replace("softmax_21 = 21", "softmax_21 = 'tuned'").replace(
            "softmax_20 = 20", "softmax_20 = 'rocm'"
        ),
    }
    for commit in (tune, softmax, norm):
        run("cherry-pick", commit, cwd=dest, check=False)
        if commit in resolved:
            path.write_text(resolved[commit])
            run("add", "-A", cwd=dest)
            run("commit", "-q", "--no-edit", cwd=dest)
    assert run("status", "--porcelain", "--untracked-files=no", cwd=dest) == ""
    assert len(run("rev-list", "core_v0.2.0..HEAD", cwd=dest).split()) == 3
    before = {p.relative_to(series): p.read_bytes() for p in series.rglob("*") if p.is_file()}
    capsys.readouterr()

    assert main(["export", "--repo", str(dest), "--series", str(series)]) == 1
    err = capsys.readouterr().err
    assert "would not apply" in err and "nothing was written" in err
    after = {p.relative_to(series): p.read_bytes() for p in series.rglob("*") if p.is_file()}
    assert after == before
