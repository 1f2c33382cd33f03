"""The one git layer: sanitised environment, pinned config, values never read as options."""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

import pytest
from toyrepo import apply_argv, run

from megatron_rocm.main import main
from megatron_rocm.patchtool import gitcmd

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_rocm"


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_only_the_git_layer_starts_processes_in_the_patch_tool():
    spawners = {
        p.relative_to(PACKAGE).as_posix()
        for p in (PACKAGE / "patchtool").rglob("*.py")
        if "subprocess" in _imports(p)
    }
    assert spawners == {"patchtool/gitcmd.py"}


def test_gitpython_is_only_the_progress_parser():
    users = {
        p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py") if "git" in _imports(p)
    }
    assert users == {"progress.py"}


def test_a_leaked_git_dir_does_not_redirect_commands(toy, monkeypatch):
    _, upstream, _ = toy
    tagged = run("rev-parse", "core_v0.1.0^{commit}", cwd=upstream)
    other = upstream.parent / "other"
    run("init", "-q", str(other), cwd=upstream.parent)
    run("commit", "-q", "--allow-empty", "-m", "other", cwd=other)
    run("tag", "core_v0.1.0", cwd=other)  # the same name, another commit
    monkeypatch.setenv("GIT_DIR", str(other / ".git"))  # e.g. inherited from a git hook
    assert gitcmd.rev_parse(upstream, "core_v0.1.0") == tagged


def test_repo_hooks_and_fsmonitor_never_run(toy):
    """A fork's own config cannot make our git calls run a program."""
    root, upstream, series = toy
    dest = root / "fork"
    run("clone", "-q", str(upstream), str(dest), cwd=root)
    canary = root / "ran"
    script = root / "hook.sh"
    script.write_text(f"#!/bin/sh\ntouch {canary}\n")
    script.chmod(0o755)
    hooks = dest / ".git" / "hooks"
    for name in ("reference-transaction", "post-checkout", "post-index-change"):
        (hooks / name).write_text(script.read_text())
        (hooks / name).chmod(0o755)
    run("config", "core.fsmonitor", str(script), cwd=dest)
    assert main(apply_argv(upstream, series, dest)) == 0
    assert not canary.exists()


def test_ext_transport_is_refused_by_pinned_config(tmp_path):
    canary = tmp_path / "ran"
    with pytest.raises(gitcmd.GitError):
        gitcmd.clone(f"ext::sh -c touch% {canary}", tmp_path / "dest", quiet=True)
    assert not canary.exists()


def test_values_after_end_of_options_are_never_options(toy, tmp_path):
    """Even a value that skipped validation is a refspec to git, not --upload-pack."""
    root, upstream, _ = toy
    canary = tmp_path / "ran"
    with pytest.raises(gitcmd.GitError):
        gitcmd.fetch(upstream, str(upstream), [f"--upload-pack=touch {canary};"], quiet=True)
    assert not canary.exists()
    assert gitcmd.rev_parse(upstream, "--output=x") is None


def test_clone_failure_names_gits_reason(tmp_path):
    with pytest.raises(gitcmd.GitError) as e:
        gitcmd.clone(str(tmp_path / "missing"), tmp_path / "dest", quiet=True)
    assert "does not exist" in e.value.reason and e.value.code == 3
    assert not (tmp_path / "dest").exists()


def test_clone_and_fetch_with_progress(toy, tmp_path):
    _, upstream, _ = toy
    dest = tmp_path / "clone"
    gitcmd.clone(str(upstream), dest, quiet=True)
    assert gitcmd.rev_parse(dest, "core_v0.6.0") == run(
        "rev-parse", "core_v0.6.0^{commit}", cwd=upstream
    )
    run("tag", "extra", "core_v0.1.0", cwd=upstream)
    gitcmd.fetch(dest, str(upstream), ["+refs/tags/*:refs/tags/*"], quiet=True)
    assert gitcmd.rev_parse(dest, "extra") == gitcmd.rev_parse(upstream, "core_v0.1.0")


def test_merge_file(tmp_path):
    base = b"a\nb\nc\nd\ne\n"
    ours = b"A\nb\nc\nd\ne\n"
    theirs = b"a\nb\nc\nd\nE\n"
    assert gitcmd.merge_file(tmp_path, ours, base, theirs) == b"A\nb\nc\nd\nE\n"
    assert gitcmd.merge_file(tmp_path, b"x\nb\nc\nd\ne\n", base, b"y\nb\nc\nd\ne\n") is None


def test_too_old_git_is_one_clear_line(monkeypatch, tmp_path):
    fake = tmp_path / "git"
    fake.write_text("#!/bin/sh\necho 'git version 2.20.1'\n")
    fake.chmod(0o755)
    monkeypatch.setattr(gitcmd.shutil, "which", lambda _name: str(fake))
    with pytest.raises(gitcmd.SourceError, match="needs git 2.30"):
        gitcmd.git_binary()


def test_sanitized_env_keeps_transport_settings_only(monkeypatch):
    monkeypatch.setenv("GIT_SSH_COMMAND", "ssh -i key")
    monkeypatch.setenv("GIT_WORK_TREE", "/elsewhere")
    env = gitcmd.sanitized_env()
    assert env["GIT_SSH_COMMAND"] == "ssh -i key"
    assert "GIT_WORK_TREE" not in env
    assert env["GIT_CONFIG_NOSYSTEM"] == "1" and env["GIT_TERMINAL_PROMPT"] == "0"


def test_plain_git_sees_the_pinned_config_values():
    out = subprocess.run(
        [*gitcmd.argv("config", "--get", "protocol.ext.allow")],
        capture_output=True,
        text=True,
        env=gitcmd.sanitized_env(),
        check=True,
    ).stdout.strip()
    assert out == "never"


def test_a_work_tree_root_is_told_apart_from_a_folder_inside_it(tmp_path: Path) -> None:
    """``apply`` (an existing fork) and ``install`` (egg-info) both ask; a root ending in a space
    is still its own root: only git's newline is cut from its answer."""
    root = tmp_path / "fork "
    (root / "inside").mkdir(parents=True)
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    assert gitcmd.toplevel(root) == root.resolve()
    assert gitcmd.is_work_tree_root(root)
    assert not gitcmd.is_work_tree_root(root / "inside")
    assert not gitcmd.is_work_tree_root(tmp_path / "plain")
