"""Hostile or broken input found by probing the CLI: each is refused with one line and exit 2
(or reported as one JSON document), and nothing the user has is changed.

The cases: a ``--ref`` that names a patched fork's commit (it would be patched twice), diffs
whose hunk header or paths the reader would have skipped without a word, series files that
are not what the format says, a detached HEAD whose commits only the reflog would keep, an
empty ``--dest``, ``--json`` on errors, and a signal landing while the error handler exits.
"""

from __future__ import annotations

import contextlib
import json

import pytest
from toyrepo import apply_argv, commit_all, run, snapshot, write

from megatron_rocm import main as main_module
from megatron_rocm.error_handler import Result
from megatron_rocm.main import main


def _one_line(capsys) -> str:
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    assert len(captured.err.strip().splitlines()) == 1, captured.err
    return captured.err


def _fork(toy, capsys):
    root, upstream, series = toy
    dest = root / "fork"
    assert main(apply_argv(upstream, series, dest)) == 0
    capsys.readouterr()
    return dest


def test_a_ref_naming_the_forks_own_commit_is_refused(toy, capsys):
    _, _, series = toy
    dest = _fork(toy, capsys)
    before = snapshot(dest)
    assert main(["apply", "--series", str(series), "--dest", str(dest), "--ref", "HEAD"]) == 2
    assert "patched fork's commit" in _one_line(capsys)
    assert snapshot(dest) == before


def test_a_fresh_apply_from_a_fork_branch_is_refused(toy, capsys):
    root, _, series = toy
    fork = _fork(toy, capsys)
    dest = root / "again"
    argv = apply_argv(fork, series, dest, ref="rocm/core_v0.2.0")
    assert main(argv) == 2
    assert "patched fork's commit" in _one_line(capsys)
    assert not dest.exists()
    assert not list(root.glob(".again.*"))


def _diff(series, patch_id="p-norm"):
    return series / patch_id / "v0.1.diff"


@pytest.mark.parametrize("verb", ["check", "apply"])
def test_an_unreadable_hunk_header_is_a_malformed_diff(toy, capsys, verb):
    root, upstream, series = toy
    path = _diff(series)
    text = path.read_text()
    assert text.count("\n@@ -") == 1
    path.write_text(text.replace("\n@@ -", "\n@@ -x", 1))
    dest = root / "fork"
    argv = (
        apply_argv(upstream, series, dest)
        if verb == "apply"
        else ["check", "--source", str(upstream), "--series", str(series), "--ref", "core_v0.2.0"]
    )
    assert main(argv) == 2
    err = _one_line(capsys)
    assert "malformed" in err and "hunk header" in err and "p-norm/v0.1.diff" in err
    assert not dest.exists()


@pytest.mark.parametrize(
    "target",
    [".git/hooks/post-checkout", "/tmp/outside", "../outside", "megatron/./core/x.py", "a//b"],
)
def test_a_diff_path_outside_the_tree_is_a_malformed_diff(toy, capsys, target):
    _, upstream, series = toy
    _diff(series).write_text(
        f"diff --git a/{target} b/{target}\nnew file mode 100644\n--- /dev/null\n"
        f"+++ b/{target}\n@@ -0,0 +1 @@\n+echo hi\n"
    )
    argv = ["check", "--source", str(upstream), "--series", str(series), "--ref", "core_v0.2.0"]
    assert main(argv) == 2
    assert "is not a file inside the tree" in _one_line(capsys)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda s: (s / "series").write_bytes(b"p-softmax\n\xff\xfe bad\n"), "not UTF-8"),
        (lambda s: _toml(s, 'upstream = "not-submitted"', 'upstream = ""'), "upstream must"),
        (lambda s: _toml(s, "[[variant]]", "variant = [1]\n[[other]]"), "must be a table"),
        (lambda s: _toml(s, 'since = "0.1.0"', 'since = "0.1.0"\nskip = "no"'), "'skip' must"),
        (lambda s: _toml(s, 'diff = "v0.1.diff"', 'diff = "../p-softmax/v0.1.diff"'), "file name"),
    ],
)
def test_a_malformed_series_is_bad_input(toy, capsys, edit, message):
    _, _, series = toy
    edit(series)
    assert main(["list", "--series", str(series)]) == 2
    assert message in _one_line(capsys)


def _toml(series, old: str, new: str) -> None:
    path = series / "p-norm" / "patch.toml"
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))


def test_overlapping_ranges_name_the_series_actually_read(toy, capsys):
    _, _, series = toy
    _toml(
        series,
        'since = "0.1.0"',
        'since = "0.1.0"\n\n[[variant]]\ndiff = "v0.1.diff"\nsince = "0.3.0"',
    )
    assert main(["list", "--series", str(series)]) == 2
    assert str(series / "p-norm" / "patch.toml") in _one_line(capsys)


def test_commits_on_a_detached_head_are_not_left_behind(toy, capsys):
    _, _, series = toy
    dest = _fork(toy, capsys)
    run("checkout", "-q", "--detach", cwd=dest)
    write(dest, "notes.txt", ["my precious work\n"])
    precious = commit_all(dest, "my precious work")
    before = snapshot(dest)
    argv = ["apply", "--series", str(series), "--dest", str(dest), "--ref", "core_v0.1.0"]
    assert main(argv) == 2
    assert "detached" in _one_line(capsys)
    assert snapshot(dest) == before
    assert run("rev-parse", "HEAD", cwd=dest) == precious


def test_a_detached_head_that_a_tag_holds_may_move(toy, capsys):
    _, upstream, series = toy
    dest = _fork(toy, capsys)
    run("checkout", "-q", "--detach", "core_v0.2.0", cwd=dest)
    assert main(apply_argv(upstream, series, dest, ref="core_v0.1.0")) == 0
    assert run("rev-parse", "--abbrev-ref", "HEAD", cwd=dest) == "rocm/core_v0.1.0"


def test_an_empty_dest_is_refused(toy, capsys, tmp_path, monkeypatch):
    _, upstream, series = toy
    monkeypatch.chdir(tmp_path)
    assert main([*apply_argv(upstream, series, tmp_path / "x")[:-1], ""]) == 2
    assert "--dest is empty" in _one_line(capsys)
    assert not (tmp_path / "Megatron-LM").exists()


def test_a_source_starting_with_a_dash_is_bad_input(toy, capsys):
    argv = ["check", "--series", str(toy[2]), "--source", "--upload-pack=touch x", "--ref", "main"]
    assert main(argv) == 2
    assert "starts with '-'" in _one_line(capsys)


@pytest.mark.parametrize(
    ("argv", "code"),
    [
        (lambda up, s, d: ["check", "--source", str(up), "--series", str(s), "--ref", "nope"], 2),
        (lambda up, s, d: ["check", "--source", str(d / "missing"), "--series", str(s)], 3),
        (lambda up, s, d: [*apply_argv(up, s, d / "fork", ref="nope")], 2),
        (lambda up, s, d: ["list", "--series", str(d / "missing")], 2),
        (lambda up, s, d: ["install", str(d / "missing"), "--dry-run"], 2),
    ],
)
def test_json_errors_are_one_json_document(toy, capsys, argv, code):
    root, upstream, series = toy
    assert main([*argv(upstream, series, root), "--json"]) == code
    captured = capsys.readouterr()
    document = json.loads(captured.out)
    assert document["ok"] is False and document["exit_code"] == code
    assert document["error"].strip() in captured.err


def test_a_failed_apply_prints_its_report_and_no_second_document(toy, capsys):
    root, upstream, series = toy
    path = _diff(series)
    text = path.read_text()
    assert "\n-norm_10 = 10\n" in text
    path.write_text(text.replace("\n-norm_10 = 10\n", "\n-norm_10 = 1000\n"))
    assert main([*apply_argv(upstream, series, root / "fork"), "--json"]) == 1
    document = json.loads(capsys.readouterr().out)
    assert document["ok"] is False and "report" in document


def test_a_signal_while_the_handler_exits_is_one_line_and_130(monkeypatch, capsys):
    @contextlib.contextmanager
    def interrupted_on_exit(as_json: bool = False):
        yield Result()
        raise KeyboardInterrupt  # as if SIGINT landed after the verb, inside the handler

    monkeypatch.setattr(main_module, "error_handler", interrupted_on_exit)
    assert main(["list"]) == 130
    assert "interrupted" in _one_line(capsys)


def test_a_dest_below_a_file_says_which_file(toy, capsys):
    root, upstream, series = toy
    (root / "afile").write_text("keep\n")
    assert main(apply_argv(upstream, series, root / "afile" / "sub")) == 3
    assert f"{root / 'afile'} is a file" in _one_line(capsys)
    assert (root / "afile").read_text() == "keep\n"


def test_apply_builds_a_branch_the_source_clone_only_tracks_as_check_reads_it(toy, capsys):
    """A user's clone of upstream has upstream's release branches as ``origin/<name>`` only;
    ``check --source CLONE --ref <name>`` reads them, so ``apply`` from the same clone must
    build them too (a clone of the clone would not copy them)."""
    root, upstream, series = toy
    run("branch", "core_r0.2.0", "core_v0.2.0", cwd=upstream)
    clone = root / "users-clone"
    run("clone", "-q", str(upstream), str(clone), cwd=root)
    assert "core_r0.2.0" not in run("branch", "--list", cwd=clone)
    check = ["check", "--source", str(clone), "--series", str(series), "--ref", "core_r0.2.0"]
    assert main(check) == 0
    dest = root / "fork"
    assert main(apply_argv(clone, series, dest, ref="core_r0.2.0")) == 0
    assert run("rev-parse", "--abbrev-ref", "HEAD", cwd=dest) == "rocm/core_r0.2.0"
    base = run("rev-parse", "core_v0.2.0", cwd=upstream)
    assert run("merge-base", "HEAD", base, cwd=dest) == base
    capsys.readouterr()
    assert main(apply_argv(clone, series, root / "other", ref="core_r9.9.9")) == 2
    assert "unknown ref 'core_r9.9.9'" in _one_line(capsys)


def test_smoke_only_repeated_keeps_every_name():
    from megatron_rocm.main import build_parser

    args = build_parser().parse_args(["smoke", "x", "--only", "imports", "--only", "kernels"])
    assert args.only == ["imports", "kernels"] and args.dir == "x"


def test_a_corrupt_diff_is_bad_input_before_anything_is_cloned(toy, capsys):
    root, upstream, series = toy
    _diff(series).write_text("this is not a diff\n")
    argv = apply_argv(upstream, series, root / "fork")
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert "cloning" not in captured.out and "p-norm/v0.1.diff" in captured.err
    assert not (root / "fork").exists() and not list(root.glob(".fork.*"))
