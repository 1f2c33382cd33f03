"""The developer loop under edits that export or apply used to get wrong without a word.

Found by probing ``export`` and ``apply`` on a fork: file names git quotes in a diff header,
binary files and attributes that make a text file binary, a fork's diff settings, empty
commits, mode changes, a cherry-pick of several commits still running, a series write that
fails half way, a second export of a new patch, a patch commit that lost its trailer in an
amend, a variant replaced whole, an ignored file in the switch's way, a patched fork's branch
given to ``check``, ``--json`` on arguments argparse refuses, a type change (file <-> symlink)
and a path holding " b/".
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
from toyrepo import apply_argv, make_series, make_upstream, run, snapshot

from megatron_rocm.main import main

pytestmark = pytest.mark.full


@pytest.fixture
def fork(tmp_path):
    upstream = make_upstream(tmp_path)
    series = make_series(tmp_path, upstream)
    dest = tmp_path / "fork"
    assert main(apply_argv(upstream, series, dest)) == 0
    return tmp_path, upstream, series, dest


def _export(dest, series, *extra) -> int:
    return main(["export", "--repo", str(dest), "--series", str(series), *extra])


def _one_line(capsys) -> str:
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    assert len(captured.err.strip().splitlines()) == 1, captured.err
    return captured.err


def _series_files(series) -> dict[str, bytes]:
    return {
        str(p.relative_to(series)): p.read_bytes() for p in sorted(series.rglob("*")) if p.is_file()
    }


@pytest.mark.parametrize("name", ["a\nb.py", 't\tab "q" \\x.py', "café.py"])
def test_a_quoted_file_name_round_trips_through_export_and_apply(fork, capsys, name):
    root, upstream, series, dest = fork
    (dest / "megatron" / name).write_text("y\n")
    run("add", "-A", cwd=dest)
    run("commit", "-qm", "Odd names", cwd=dest)
    assert _export(dest, series) == 0
    again = root / "again"
    assert main(apply_argv(upstream, series, again)) == 0
    assert (again / "megatron" / name).read_text() == "y\n"
    assert sorted(p.name for p in (again / "megatron").iterdir() if p.is_file()) == [name]


def test_an_attribute_that_makes_a_text_file_binary_is_refused(fork, capsys):
    _, _, series, dest = fork
    before = _series_files(series)
    (dest / ".git" / "info" / "attributes").write_text("*.py -diff\n")
    path = dest / "megatron/core/fusions/softmax.py"
    path.write_text(path.read_text() + "tweak = 1\n")
    run("commit", "-qam", "Tweak softmax", cwd=dest)
    assert _export(dest, series) == 2
    err = _one_line(capsys)
    assert "binary" in err and ".git/info/attributes" in err
    assert _series_files(series) == before


def test_the_forks_diff_settings_do_not_change_the_exported_bytes(fork, capsys):
    _, _, series, dest = fork
    pristine = _series_files(series)
    for key, value in (
        ("diff.interHunkContext", "50"),
        ("diff.suppressBlankEmpty", "true"),
        ("diff.orderFile", str(dest / "order")),
        ("diff.up.textconv", "tr a-z A-Z <"),
    ):
        run("config", key, value, cwd=dest)
    (dest / "order").write_text("megatron/core/norm.py\n")
    (dest / ".git" / "info" / "attributes").write_text("*.py diff=up\n")
    # export rewrites a diff only when it changed: amend both patches so both are written
    for rel, old, new in (
        ("megatron/core/fusions/softmax.py", "softmax_30 = 30", "softmax_30 = 'x'"),
        ("megatron/core/norm.py", "norm_25 = 25", "norm_25 = 'x'"),
    ):
        path = dest / rel
        path.write_text(path.read_text().replace(old, new))
    run("commit", "-qam", "Both", cwd=dest)
    assert _export(dest, series) == 0
    text = (series / "both" / "v0.2.diff").read_text()
    assert "SOFTMAX" not in text  # no textconv
    assert text.index("softmax.py") < text.index("norm.py")  # no order file
    assert _series_files(series).keys() - pristine.keys() == {"both/patch.toml", "both/v0.2.diff"}


def _binary_file(dest) -> None:
    (dest / "blob.bin").write_bytes(b"\x00\x01\x02binary")
    run("add", "blob.bin", cwd=dest)
    run("commit", "-qm", "Add binary blob", cwd=dest)


def _mode_change(dest) -> None:
    os.chmod(dest / "README.md", 0o755)
    run("commit", "-qam", "Make readme executable", cwd=dest)


def _empty_commit(dest) -> None:
    run("commit", "-q", "--allow-empty", "-m", "Empty one", cwd=dest)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (_binary_file, "binary changes are not supported"),
        (_mode_change, "mode changes are not supported"),
        (_empty_commit, "changes nothing"),
    ],
)
def test_what_apply_could_not_read_back_is_refused_and_the_series_kept(fork, capsys, edit, message):
    _, _, series, dest = fork
    before = _series_files(series)
    edit(dest)
    assert _export(dest, series) == 2
    assert message in _one_line(capsys)
    assert _series_files(series) == before


def test_a_cherry_pick_sequence_in_progress_is_refused(fork, capsys):
    _, _, series, dest = fork
    (dest / ".git" / "sequencer").mkdir()
    assert _export(dest, series) == 2
    assert "cherry-pick or revert of several commits" in _one_line(capsys)


def test_a_write_that_fails_half_way_leaves_the_series_as_it_was(fork, capsys, monkeypatch):
    _, _, series, dest = fork
    before = _series_files(series)
    (dest / "README.md").write_text("rocm readme\n")
    run("commit", "-qam", "Document ROCm usage", cwd=dest)
    real = os.replace

    def failing(src, dst):
        if os.path.basename(dst) == "series":
            raise PermissionError(1, "Operation not permitted", str(dst))
        return real(src, dst)

    monkeypatch.setattr(os, "replace", failing)  # the series journal renames through os
    assert _export(dest, series) == 3
    _one_line(capsys)
    assert _series_files(series) == before
    assert not (series / "document-rocm-usage").exists()


def test_exporting_a_new_patch_twice_changes_nothing_the_second_time(fork, capsys):
    _, _, series, dest = fork
    (dest / "README.md").write_text("rocm readme\n")
    run("commit", "-qam", "Document ROCm usage", cwd=dest)
    assert _export(dest, series) == 0
    after_first = _series_files(series)
    capsys.readouterr()
    assert _export(dest, series, "--json") == 0
    document = json.loads(capsys.readouterr().out)
    assert {"patch_id": "document-rocm-usage", "action": "unchanged", "diff": "v0.2.diff"} in (
        document["patches"]
    )
    assert _series_files(series) == after_first


def test_a_patch_commit_that_lost_its_trailer_is_refused_whoever_amended_it(fork, capsys):
    _, _, series, dest = fork
    before = _series_files(series)
    subject = run("log", "-1", "--format=%s", cwd=dest)
    run("commit", "-q", "--amend", "--reset-author", "-m", subject, cwd=dest)
    assert _export(dest, series) == 2
    err = _one_line(capsys)
    assert "patch p-norm's reason" in err and "put the trailer" in err
    assert _series_files(series) == before


def test_a_variant_replaced_whole_leaves_no_orphan_diff(fork, capsys):
    root, upstream, series, dest = fork
    (series / "p-norm" / "patch.toml").write_text(
        'id = "p-norm"\nreason = "Norm without assertions"\nupstream = "not-submitted"\n\n'
        '[[variant]]\ndiff = "v0.1.diff"\nsince = "0.1.0"\nuntil = "0.2.0"\n\n'
        '[[variant]]\ndiff = "old.diff"\nsince = "0.2.0"\n'
    )
    shutil.copy(series / "p-norm" / "v0.1.diff", series / "p-norm" / "old.diff")
    path = dest / "megatron/core/norm.py"
    first = run("rev-list", "--reverse", "core_v0.2.0..HEAD", cwd=dest).splitlines()
    assert len(first) == 2
    path.write_text(path.read_text().replace("norm_25 = 25", "norm_25 = 'x'"))
    run("commit", "-q", "-a", "--amend", "--no-edit", cwd=dest)
    assert _export(dest, series, "--new-variant") == 0
    names = sorted(p.name for p in (series / "p-norm").iterdir())
    toml = (series / "p-norm" / "patch.toml").read_text()
    assert "old.diff" not in toml and "old.diff" not in names
    assert [n for n in names if n.endswith(".diff") and n not in toml] == []


def test_apply_never_overwrites_an_ignored_file(fork, capsys):
    root, upstream, series, dest = fork
    clone = root / "clone"
    run("clone", "-q", str(upstream), str(clone), cwd=root)
    run("checkout", "-q", "core_v0.4.0", cwd=clone)  # norm.py does not exist at v0.4.0
    (clone / "megatron/core/norm.py").write_text("my local notes\n")
    (clone / ".git" / "info" / "exclude").write_text("megatron/core/norm.py\n")
    before = snapshot(clone)
    assert main(apply_argv(upstream, series, clone)) == 2
    assert "would overwrite megatron/core/norm.py" in _one_line(capsys)
    assert (clone / "megatron/core/norm.py").read_text() == "my local notes\n"
    assert snapshot(clone) == before


def test_check_refuses_a_patched_forks_branch(fork, capsys):
    _, _, series, dest = fork
    argv = ["check", "--source", str(dest), "--series", str(series), "--ref", "rocm/core_v0.2.0"]
    assert main(argv) == 2
    assert "patched fork's commit" in _one_line(capsys)


@pytest.mark.parametrize(
    "argv",
    [
        ["list", "--json", "--bogus"],
        ["export", "--json", "--megatron-version"],
        ["check", "--json", "--nope"],
        ["doctor", "--json", "extra"],
    ],
)
def test_json_on_arguments_argparse_refuses(capsys, argv):
    assert main(argv) == 2
    captured = capsys.readouterr()
    document = json.loads(captured.out)
    assert document == {"ok": False, "error": document["error"], "exit_code": 2}
    assert document["error"] in captured.err


def test_list_takes_no_megatron_version(capsys):
    assert main(["list", "--megatron-version", "0.12.0"]) == 2
    assert "unrecognized arguments" in _one_line(capsys)


def test_export_in_a_bare_repository_is_bad_input(fork, capsys):
    root, _, series, dest = fork
    bare = root / "bare.git"
    run("clone", "-q", "--bare", str(dest), str(bare), cwd=root)
    assert main(["export", "--repo", str(bare), "--series", str(series)]) == 2
    assert "bare repository" in _one_line(capsys)


def _file_to_symlink(dest) -> str:
    (dest / "README.md").unlink()
    os.symlink("megatron/core/norm.py", dest / "README.md")
    run("commit", "-qam", "Link the readme", cwd=dest)
    return "README.md"


def _symlink_to_file(dest) -> str:
    os.symlink("README.md", dest / "docs")
    run("add", "docs", cwd=dest)
    run("commit", "-qm", "Link the docs", cwd=dest)
    (dest / "docs").unlink()
    (dest / "docs").write_text("docs\n")
    run("commit", "-qam", "Write the docs", cwd=dest)
    return "docs"


@pytest.mark.parametrize("edit", [_file_to_symlink, _symlink_to_file])
def test_a_typechange_round_trips_and_a_second_export_is_unchanged(fork, capsys, edit):
    # a type change is a deletion and a creation of one path: apply replays both, and export
    # compared the two against one changed file, so it reported "updated" every time
    root, upstream, series, dest = fork
    path = edit(dest)
    assert _export(dest, series) == 0
    exported = _series_files(series)
    again = root / "again"
    assert main(apply_argv(upstream, series, again)) == 0
    assert (
        run("ls-tree", "HEAD", path, cwd=again).split()[0]
        == run("ls-tree", "HEAD", path, cwd=dest).split()[0]
    )
    assert os.path.islink(again / path) == os.path.islink(dest / path)
    capsys.readouterr()
    assert _export(again, series, "--json") == 0
    document = json.loads(capsys.readouterr().out)
    assert {i["action"] for i in document["patches"]} == {"unchanged"}
    assert _series_files(series) == exported


@pytest.mark.parametrize("name", ["docs/a b/c.txt", "a b/b b/c", "x b/"])
def test_a_path_holding_space_b_slash_round_trips_through_export_and_apply(fork, capsys, name):
    root, upstream, series, dest = fork
    path = dest / name.rstrip("/") / "f.txt" if name.endswith("/") else dest / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("y\n")
    run("add", "-A", cwd=dest)
    run("commit", "-qm", "Spaced names", cwd=dest)
    assert _export(dest, series) == 0, capsys.readouterr().err
    rel = str(path.relative_to(dest))
    assert f"+++ b/{rel}" in (series / "spaced-names" / "v0.2.diff").read_text()
    again = root / "again"
    assert main(apply_argv(upstream, series, again)) == 0
    assert (again / rel).read_text() == "y\n"
