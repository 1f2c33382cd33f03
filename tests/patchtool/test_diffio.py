"""Diff files: one loader for files with and without the ``git am`` header; a byte-stable
header; ``git am`` of the series gives the same tree and messages as ``apply``."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from cache_paths import MIRROR
from toyrepo import apply_argv, run

from megatron_rocm.commands import normalize as normalize_cli
from megatron_rocm.errors import UsageError
from megatron_rocm.main import main
from megatron_rocm.patchtool import diffio, engine, gitcmd, normalize
from megatron_rocm.patchtool.series import default_series_dir, load_series


def test_render_is_byte_stable_and_idempotent(toy):
    _, _, series = toy
    path = series / "p-norm" / "v0.1.diff"
    raw = path.read_bytes()
    once = diffio.render("p-norm", "Norm without assertions", raw)
    assert once == diffio.render("p-norm", "Norm without assertions", once)
    text = once.decode()
    assert text.startswith(diffio.FROM_LINE + "\nFrom: megatron-rocm <")
    assert (
        "\nSubject: [PATCH] Norm without assertions\n\nMegatron-ROCm-Patch: p-norm\n---\n" in text
    )
    assert diffio.split(text)[1].encode() == raw  # the diff itself is untouched


def test_loader_reads_files_with_and_without_header(toy, tmp_path):
    _, _, series = toy
    plain = series / "p-norm" / "v0.1.diff"
    headed = tmp_path / "headed.diff"
    headed.write_bytes(diffio.render("p-norm", "Norm", plain.read_bytes()))
    a, b = diffio.load(plain, "p-norm"), diffio.load(headed, "p-norm")
    assert [(f.path, [h.text for h in f.hunks]) for f in a] == [
        (f.path, [h.text for h in f.hunks]) for f in b
    ]
    with pytest.raises(UsageError, match="names patch 'p-norm', not 'p-softmax'"):
        diffio.load(headed, "p-softmax")


def test_non_ascii_reasons_get_an_encoded_subject():
    head = diffio.header("p", "Norm für ROCm")
    assert "Subject: =?utf-8?" in head and "für" not in head


def test_normalize_then_check_changes_nothing_that_applies(toy, capsys):
    _, upstream, series = toy
    check = ["check", "--source", str(upstream), "--series", str(series), "--json", "--ref"]
    refs = ["core_v0.1.0", "core_v0.2.0", "core_v0.3.0", "core_v0.6.0"]
    main([*check, *refs])
    before = capsys.readouterr().out
    assert normalize_cli.main([str(series), "--check"]) == 1
    assert normalize_cli.main([str(series)]) == 0
    assert normalize_cli.main([str(series), "--check"]) == 0
    assert normalize.pending(load_series(series)) == []
    capsys.readouterr()
    main([*check, *refs])
    assert capsys.readouterr().out == before


def _am(repo: Path, diffs: list[Path]) -> None:
    for diff in diffs:
        run("am", "-q", "--keep-cr", str(diff), cwd=repo)


def test_git_am_of_the_series_builds_the_fork_apply_builds(toy):
    root, upstream, series = toy
    assert normalize_cli.main([str(series)]) == 0
    fork = root / "fork"
    assert main(apply_argv(upstream, series, fork, "core_v0.1.0")) == 0
    am = root / "am"
    run("clone", "-q", str(upstream), str(am), cwd=root)
    run("checkout", "-q", "-b", "am", "core_v0.1.0", cwd=am)
    _am(am, [series / p / "v0.1.diff" for p in ("p-softmax", "p-norm")])
    assert run("rev-parse", "HEAD^{tree}", cwd=am) == run("rev-parse", "HEAD^{tree}", cwd=fork)
    fmt = ["log", "--format=%an|%s|%(trailers:key=Megatron-ROCm-Patch,valueonly)", "-2"]
    assert run(*fmt, cwd=am) == run(*fmt, cwd=fork)


@pytest.mark.skipif(not (MIRROR / "HEAD").exists(), reason="needs a Megatron-LM mirror")
@pytest.mark.parametrize("tag", ["core_v0.12.0", "core_v0.19.0"])
def test_git_am_of_the_real_series_on_a_real_tag(tmp_path, tag, capsys):
    """``git am`` accepts every diff of the shipped series, and gives apply's tree."""
    series = tmp_path / "series"
    shutil.copytree(default_series_dir(), series)
    normalize_cli.main([str(series)])
    fork = tmp_path / "fork"
    argv = ["apply", "--source", str(MIRROR), "--ref", tag, "--dest", str(fork)]
    assert main([*argv, "--series", str(series), "--json"]) == 0
    capsys.readouterr()
    am = tmp_path / "am"
    subprocess.run(["git", "clone", "-q", "--no-checkout", str(MIRROR), str(am)], check=True)
    run("checkout", "-q", "-b", "am", tag, cwd=am)
    loaded = load_series(series)
    commit = run("rev-parse", tag + "^{commit}", cwd=am)
    with gitcmd.CatFile(am) as cat:
        tree_version = engine.tree_version(cat, commit)
        diffs = [  # chosen as apply chooses: content probes (`when`) read the tag's files
            p.diff_path(v)
            for p in loaded.patches
            if (v := p.variant_for(tree_version, lambda f: cat.read(f"{commit}:{f}"))) is not None
            and not v.skip
        ]
    _am(am, diffs)
    assert run("rev-parse", "HEAD^{tree}", cwd=am) == run("rev-parse", "HEAD^{tree}", cwd=fork)


def test_shipped_series_is_normalised():
    """Every shipped diff is a git am patch; after adding one, run
    ``python3 -m megatron_rocm.patchtool.normalize``."""
    assert [str(p) for p, _ in normalize.pending(load_series())] == []


def test_a_diff_file_is_read_byte_for_byte_crlf_included(tmp_path):
    path = tmp_path / "v.diff"
    path.write_bytes(
        b"diff --git a/x.txt b/x.txt\nnew file mode 100644\n--- /dev/null\n+++ b/x.txt\n"
        b"@@ -0,0 +1,2 @@\n+a\r\n+b\r\n"
    )
    (fd,) = diffio.load(path)
    assert fd.hunks[0].new == ["a\r\n", "b\r\n"]
