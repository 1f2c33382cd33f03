"""Bad input: one clear line on stderr, a documented exit code, never a traceback."""

from __future__ import annotations

import os
import shutil
import sys

import pytest
from toyrepo import apply_argv, run

from megatron_rocm.main import build_parser, main

VERBS = ["apply", "check", "export", "list", "matrix", "install", "smoke", "doctor"]


@pytest.mark.parametrize("verb", VERBS)
def test_every_verb_has_help(verb, capsys):
    assert main([verb, "--help"]) == 0
    assert f"megatron-rocm {verb}" in capsys.readouterr().out


def test_parser_knows_exactly_these_verbs():
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    assert sorted(sub.choices) == sorted(VERBS)


def test_no_command_is_usage_error(capsys):
    assert main([]) == 2
    assert "no command given" in _err(capsys)


@pytest.mark.parametrize(
    "argv",
    [["bogus"], ["apply", "--dest"], ["check", "--nope"], ["matrix", "--format", "pdf"]],
)
def test_argparse_errors_are_one_line_exit_2(argv, capsys):
    assert main(argv) == 2
    assert "see --help" in _err(capsys)


def _err(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    return err


def test_unknown_ref(toy, capsys):
    _, upstream, series = toy
    assert (
        main(["check", "--source", str(upstream), "--series", str(series), "--ref", "core_v9.9.9"])
        == 2
    )
    assert "unknown ref 'core_v9.9.9'" in _err(capsys)


def test_missing_source_says_how_to_use_source(toy, tmp_path, capsys):
    assert (
        main(
            ["check", "--series", str(toy[2]), "--source", str(tmp_path / "nope"), "--ref", "main"]
        )
        == 3
    )
    assert "--source" in _err(capsys)


def test_source_not_a_git_repository(toy, tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["check", "--series", str(toy[2]), "--source", str(empty), "--ref", "main"]) == 3
    assert "not a git repository" in _err(capsys)


def test_unreachable_url(toy, tmp_path, capsys):
    url = "file://" + str(tmp_path / "missing.git")
    assert main(["check", "--series", str(toy[2]), "--source", url, "--ref", "main"]) == 3
    assert "cannot clone" in _err(capsys)


def test_corrupt_diff(toy, capsys):
    _, upstream, series = toy
    (series / "p-norm" / "v0.1.diff").write_text("this is not a diff\n")
    assert main(["check", "--source", str(upstream), "--series", str(series)]) == 2
    assert "p-norm/v0.1.diff" in _err(capsys)


def test_truncated_diff(toy, capsys):
    _, upstream, series = toy
    path = series / "p-norm" / "v0.1.diff"
    path.write_text("".join(path.read_text().splitlines(keepends=True)[:-3]))
    assert main(["check", "--source", str(upstream), "--series", str(series)]) == 2
    assert "malformed" in _err(capsys)


def test_series_naming_missing_patch(toy, capsys):
    _, upstream, series = toy
    (series / "series").write_text("p-softmax\np-ghost\n")
    assert main(["list", "--series", str(series)]) == 2
    assert "p-ghost" in _err(capsys)


def test_variant_naming_missing_diff(toy, capsys):
    _, _, series = toy
    (series / "p-norm" / "v0.1.diff").unlink()
    assert main(["list", "--series", str(series)]) == 2
    assert "does not exist" in _err(capsys)


def test_overlapping_version_ranges(toy, capsys):
    _, _, series = toy
    toml = series / "p-norm" / "patch.toml"
    toml.write_text(toml.read_text() + '\n[[variant]]\ndiff = "v0.1.diff"\nsince = "0.3.0"\n')
    assert main(["list", "--series", str(series)]) == 2
    assert "overlap" in _err(capsys)


def test_malformed_toml(toy, capsys):
    _, _, series = toy
    (series / "p-norm" / "patch.toml").write_text("id = [unclosed\n")
    assert main(["list", "--series", str(series)]) == 2
    assert "malformed TOML" in _err(capsys)


def test_destination_exists_and_is_not_ours(toy, capsys):
    root, upstream, series = toy
    dest = root / "mine"
    dest.mkdir()
    (dest / "notes.txt").write_text("keep me\n")
    assert (
        main(["apply", "--source", str(upstream), "--series", str(series), "--dest", str(dest)])
        == 2
    )
    assert "not a git clone of Megatron-LM" in _err(capsys)
    assert (dest / "notes.txt").read_text() == "keep me\n"


def test_permission_denied(toy, capsys, owner_permissions):
    root, upstream, series = toy
    locked = root / "locked"
    locked.mkdir(mode=0o500)
    assert (
        main(
            [
                "apply",
                "--source",
                str(upstream),
                "--series",
                str(series),
                "--dest",
                str(locked / "fork"),
            ]
        )
        == 3
    )
    err = _err(capsys)  # the lock beside the fork is the first file it cannot create
    assert "permission denied" in err.lower() and f"cannot take the lock {locked}/" in err
    assert not (locked / "fork").exists()


def test_missing_git_binary(toy, capsys, monkeypatch):
    _, upstream, series = toy
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert main(["check", "--source", str(upstream), "--series", str(series)]) == 3
    assert "git is not installed" in _err(capsys)


def test_export_not_a_repository(tmp_path, toy, capsys):
    _, _, series = toy
    assert main(["export", "--repo", str(tmp_path / "x"), "--series", str(series)]) == 2
    assert "not a git repository" in _err(capsys)


def test_internal_error_is_one_line_with_log(monkeypatch, capsys, tmp_path):
    import megatron_rocm.commands.list_series as ls

    monkeypatch.setattr(ls, "load_series", lambda *_: 1 / 0)
    assert main(["list"]) == 4
    err = _err(capsys)
    assert "internal error: ZeroDivisionError" in err and "megatron-rocm.log" in err


def test_branch_checkout_conflict_with_untracked_file_changes_nothing(toy, capsys):
    root, upstream, series = toy
    dest = root / "clone"
    run("clone", "-q", str(upstream), str(dest), cwd=root)
    # an untracked file where the fork would write (simulate a user's scratch copy)
    run("checkout", "-q", "core_v0.4.0", cwd=dest)  # norm.py absent at v0.4.0
    (dest / "megatron/core/norm.py").write_text("scratch\n")
    assert main(apply_argv(upstream, series, dest)) == 2
    assert (dest / "megatron/core/norm.py").read_text() == "scratch\n"
    assert "rocm/core_v0.2.0" not in run("branch", "--list", cwd=dest)


def test_unreachable_package_index(toy, monkeypatch, capsys):
    """--source pypi with no reachable index: exit 3 and how to proceed, nothing cloned."""
    monkeypatch.setenv("MEGATRON_ROCM_PYPI_URL", "http://127.0.0.1:9/pypi")
    _, _, series = toy
    assert main(["check", "--source", "pypi", "--ref", "0.14.0", "--series", str(series)]) == 3
    err = _err(capsys)
    assert "cannot reach PyPI" in err and "--source PATH" in err


def test_another_projects_git_repository_is_not_taken_over(toy, tmp_path, capsys):
    _, upstream, series = toy
    other = tmp_path / "other"
    other.mkdir()
    run("init", "-q", cwd=other)
    (other / "notes.txt").write_text("mine\n")
    run("add", "notes.txt", cwd=other)
    run("-c", "user.name=u", "-c", "user.email=u@x", "commit", "-q", "-m", "mine", cwd=other)
    head = run("rev-parse", "HEAD", cwd=other)
    assert main(apply_argv(upstream, series, other)) == 2
    assert "is a git repository but not a clone of Megatron-LM" in _err(capsys)
    assert run("rev-parse", "HEAD", cwd=other) == head
    assert run("branch", "--format=%(refname:short)", cwd=other).split() in (["main"], ["master"])
    assert sorted(p.name for p in other.iterdir()) == [".git", "notes.txt"]


def test_a_destination_inside_the_source_is_refused(toy, capsys):
    _, upstream, series = toy
    assert main(apply_argv(upstream, series, upstream / "inside")) == 2
    assert "is inside the source" in _err(capsys)
    assert not (upstream / "inside").exists()


@pytest.mark.parametrize("verb", ["apply", "export", "install"])
def test_a_symbolic_link_loop_is_a_usage_error(toy, tmp_path, capsys, verb):
    _, upstream, series = toy
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    loop = tmp_path / "a"
    argv = {
        "apply": apply_argv(upstream, series, loop),
        "export": ["export", "--repo", str(loop), "--series", str(tmp_path / "out")],
        "install": ["install", "--dry-run", str(loop)],
    }[verb]
    assert main(argv) == 2
    assert "symbolic links form a loop" in _err(capsys)


def test_a_branch_name_git_cannot_store_is_refused_before_any_clone(toy, tmp_path, capsys):
    _, upstream, series = toy
    dest = tmp_path / "new"
    assert main([*apply_argv(upstream, series, dest), "--branch", "rocm/" + "ü" * 140]) == 2
    assert "a path component is 280 bytes long" in _err(capsys)
    assert not dest.exists()


def test_sigterm_ends_any_verb_in_one_line_and_restores_the_handler(monkeypatch, capsys):
    import signal

    from megatron_rocm import main as main_module

    def terminated(_args):
        os.kill(os.getpid(), signal.SIGTERM)
        raise AssertionError("the signal should have ended the verb")

    monkeypatch.setattr(main_module, "_dispatch", terminated)
    before = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        assert main(["list"]) == 128 + signal.SIGTERM
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, before)
    assert _err(capsys).strip() == "megatron-rocm: interrupted"


def test_matrix_with_its_json_report_on_stdout_gives_a_json_error(toy, capsys):
    import json

    _, upstream, series = toy
    argv = ["matrix", "--source", str(upstream), "--series", str(series), "--format", "json"]
    assert main([*argv, "--tags", "nomatch*"]) == 2
    captured = capsys.readouterr()
    document = json.loads(captured.out)
    assert document["ok"] is False and document["exit_code"] == 2
    assert "Traceback" not in captured.err and len(captured.err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("words", "document"),
    [
        (["--format", "json", "--bogus"], True),
        (["--format=json", "--tags"], True),  # --tags without its value
        (["--format", "json", "--format", "md", "--bogus"], False),  # stdout holds no report
        (["--format", "json", "--out", "r.json", "--bogus"], False),
        (["--format", "yaml"], False),  # not a json report either
    ],
)
def test_a_refused_matrix_line_is_a_json_document_when_its_report_was_to_be(
    words, document, capsys
):  # noqa: ANN001
    import json

    assert main(["matrix", *words]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("megatron-rocm: error: ") and captured.err.count("\n") == 1
    if document:
        parsed = json.loads(captured.out)
        assert parsed == {"ok": False, "error": captured.err.strip()[15:], "exit_code": 2}
    else:
        assert captured.out == ""


def test_a_cache_folder_that_cannot_be_found_is_one_line_and_exit_3(monkeypatch, capsys):
    from megatron_rocm.cache import cache_dir
    from megatron_rocm.error_handler import error_handler
    from megatron_rocm.errors import SourceError

    monkeypatch.setenv("MEGATRON_ROCM_CACHE", "~no-such-user-megatron-rocm/c")
    with pytest.raises(SourceError, match="cannot find the cache folder"):
        cache_dir()
    with error_handler() as result:  # a bug's traceback still goes somewhere: a temp file
        raise ValueError("boom")
    assert result.code == 4
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "traceback in /" in err and "Traceback" not in err


def test_a_json_flag_given_a_value_still_gets_a_json_error_document(capsys):
    import json

    assert main(["doctor", "--json=1"]) == 2
    captured = capsys.readouterr()
    assert json.loads(captured.out)["exit_code"] == 2
    assert captured.err.count("\n") == 1


def test_the_console_prints_a_non_utf8_path_escaped_under_a_strict_locale(monkeypatch):
    import io

    from megatron_rocm import main as cli_module

    raw = io.BytesIO()
    strict = io.TextIOWrapper(raw, encoding="utf-8", errors="strict")
    monkeypatch.setattr(sys, "stdout", strict)
    cli_module._tolerant_output()
    print("tree /tmp/T\udcff", file=strict)
    strict.flush()
    assert raw.getvalue() == b"tree /tmp/T\\udcff\n"


@pytest.mark.parametrize(
    "extra",
    [
        ["check", "--ref", "r" * 5000],  # an unknown ref, echoed in the error
        ["apply", "--ref", "core_v0.2.0", "--branch", "b" * 5000],  # a refused branch name
        ["check", "--ref", "core_v0.2.0", "--megatron-version", "9" * 5000 + "x"],
        ["matrix", "--format", "f" * 5000],  # argparse's own refusal
        ["check", "--ref", "core_v0.2.0", "--json", "--megatron-version", "v" * 5000],
    ],
)
def test_an_overlong_user_value_is_shown_cut_in_the_error(toy, tmp_path, capsys, extra):
    """A 5,000-character value is shown as its first 80 characters and "…", on stderr and in
    the --json error document alike."""
    _, upstream, series = toy
    argv = [*extra, "--source", str(upstream), "--series", str(series)]
    if extra[0] == "apply":
        argv += ["--dest", str(tmp_path / "fork")]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert len(err) < 400 and "…" in err, err
    assert len(out) < 600, out


def test_a_home_folder_that_does_not_exist_is_never_created(toy, tmp_path, monkeypatch, capsys):
    """HOME=/nonexistent: a command that needs the cache (a URL source's mirror) refuses in
    one line (exit 3) rather than creating the home folder; an internal error's log goes to
    a temporary file instead."""
    from megatron_rocm.error_handler import error_handler

    _, upstream, series = toy
    home = tmp_path / "nonexistent"
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("MEGATRON_ROCM_CACHE")
    monkeypatch.delenv("XDG_CACHE_HOME")
    argv = ["check", "--source", f"file://{upstream}", "--series", str(series)]
    assert main([*argv, "--ref", "core_v0.2.0"]) == 3
    err = _err(capsys)
    assert f"the home folder {home} does not exist" in err and "MEGATRON_ROCM_CACHE" in err
    with error_handler() as result:
        raise ValueError("boom")
    assert result.code == 4
    assert not home.exists()
