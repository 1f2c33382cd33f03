"""install puts back the tracked ``*.egg-info`` files its build rewrote, and nothing else.

Unit cases on a git repository built here, the install command with a stand-in for the pip
steps, and one slow case on a real megatron-core sdist that ``apply --source pypi`` made: the
three files pip's build rewrites there get the line it adds (``megatron-rocm``, from the
patched ``pyproject.toml``; running the build itself needs pybind11 on ``PATH``), and
``export`` of the tree must still be a zero diff afterwards."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from megatron_rocm.commands import install as install_cmd
from megatron_rocm.envtools import build_byproducts, installer
from megatron_rocm.errors import FatalError

META = "megatron_core.egg-info"


def git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
        cwd=repo, check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip


def sdist_like_repo(root: Path) -> Path:
    """A tree laid out as ``apply --source pypi`` leaves one: the egg-info folder tracked."""
    (root / META).mkdir(parents=True)
    (root / "megatron/core").mkdir(parents=True)
    (root / "megatron/core/package_info.py").write_text("MAJOR, MINOR, PATCH = 0, 16, 1\n")
    for name in ("PKG-INFO", "requires.txt", "SOURCES.txt"):
        (root / META / name).write_text(f"{name} as shipped\n")
    git(root, "init", "-q")
    git(root, "add", "-A")
    git(root, "commit", "-qm", "sdist")
    return root


def rewrite(root: Path, *names: str) -> None:
    for name in names:
        path = root / name
        path.write_text(path.read_text() + "megatron-rocm\n")


def test_only_files_the_build_changed_and_that_were_clean_are_put_back(tmp_path: Path) -> None:
    tree = sdist_like_repo(tmp_path / "t")
    rewrite(tree, f"{META}/SOURCES.txt")  # the user's own edit, before the build
    clean = build_byproducts.clean_tracked_metadata(tree)
    assert clean == {f"{META}/PKG-INFO", f"{META}/requires.txt"}
    rewrite(tree, f"{META}/PKG-INFO", f"{META}/requires.txt", f"{META}/SOURCES.txt")
    rewrite(tree, "megatron/core/package_info.py")  # not build metadata: never touched
    restored = build_byproducts.restore_tracked_metadata(tree, clean)
    assert restored == [f"{META}/PKG-INFO", f"{META}/requires.txt"]
    status = git(tree, "status", "--porcelain").splitlines()
    assert sorted(status) == [" M megatron/core/package_info.py", f" M {META}/SOURCES.txt"]
    assert (tree / META / "requires.txt").read_text() == "requires.txt as shipped\n"
    assert (tree / META / "SOURCES.txt").read_text().endswith("megatron-rocm\n")  # kept


def test_trees_that_are_not_their_own_checkout_are_left_alone(tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    (plain / META).mkdir(parents=True)
    assert build_byproducts.clean_tracked_metadata(plain) == set()
    outer = sdist_like_repo(tmp_path / "outer")
    inner = outer / "inner"
    inner.mkdir()
    assert build_byproducts.clean_tracked_metadata(inner) == set()
    assert build_byproducts.restore_tracked_metadata(inner, set()) == []


@pytest.mark.parametrize("fails", [False, True])
def test_install_puts_them_back_whether_or_not_the_build_succeeds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, fails: bool
) -> None:
    tree = sdist_like_repo(tmp_path / "t")

    def fake_plan(tree_dir: str, editable: bool, workdir: Path) -> installer.Plan:
        return installer.Plan(
            Path(tree_dir).resolve(), editable, "2.13.0", {}, [], False, None, False, workdir
        )

    def fake_execute(p: installer.Plan, log=print):  # noqa: ANN001, ANN202
        rewrite(p.tree, f"{META}/PKG-INFO", f"{META}/requires.txt")
        if fails:
            raise FatalError("step 3/4 (install the tree) failed: exit 1")
        return ["install the tree"], []

    monkeypatch.setattr(installer, "plan", fake_plan)
    monkeypatch.setattr(installer, "execute", fake_execute)
    if fails:
        with pytest.raises(FatalError):
            install_cmd.install(str(tree), as_json=True)
    else:
        assert install_cmd.install(str(tree), as_json=True) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["restored"] == [f"{META}/PKG-INFO", f"{META}/requires.txt"]
    assert git(tree, "status", "--porcelain") == ""


@pytest.mark.upstream
@pytest.mark.full
@pytest.mark.slow
def test_a_real_sdist_tree_exports_a_zero_diff_after_its_metadata_is_rebuilt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    from cache_paths import DOWNLOAD_CACHE

    from megatron_rocm.main import main
    from megatron_rocm.patchtool.series import default_series_dir

    monkeypatch.setenv("MEGATRON_ROCM_CACHE", str(DOWNLOAD_CACHE))
    series, tree = tmp_path / "series", tmp_path / "fork"
    shutil.copytree(default_series_dir(), series)
    assert main(["apply", "--source", "pypi", "--ref", "0.16.1", "--dest", str(tree),
                 "--series", str(series)]) == 0  # fmt: skip
    clean = build_byproducts.clean_tracked_metadata(tree)
    assert f"{META}/requires.txt" in clean
    rewrite(tree, f"{META}/PKG-INFO", f"{META}/requires.txt", f"{META}/SOURCES.txt")
    capsys.readouterr()
    assert main(["export", "--repo", str(tree), "--series", str(series)]) == 2  # as it was
    assert build_byproducts.restore_tracked_metadata(tree, clean)
    assert git(tree, "status", "--porcelain", "--untracked-files=no") == ""
    capsys.readouterr()
    assert main(["export", "--repo", str(tree), "--series", str(series), "--json"]) == 0
    exported = json.loads(capsys.readouterr().out)
    assert {p["action"] for p in exported["patches"]} <= {"unchanged", "no-change"}


def test_a_machine_without_git_installs_as_before(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tree = sdist_like_repo(tmp_path / "t")
    monkeypatch.setenv("PATH", str(tmp_path / "no-git-here"))
    assert build_byproducts.clean_tracked_metadata(tree) == set()


def test_a_root_ending_in_a_space_is_still_its_own_checkout(tmp_path: Path) -> None:
    tree = sdist_like_repo(tmp_path / "tree ")
    clean = build_byproducts.clean_tracked_metadata(tree)
    assert f"{META}/requires.txt" in clean
    rewrite(tree, f"{META}/requires.txt")
    assert build_byproducts.restore_tracked_metadata(tree, clean) == [f"{META}/requires.txt"]


def test_a_failure_to_put_them_back_is_one_warning_not_the_installs_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    tree = sdist_like_repo(tmp_path / "t")
    clean = build_byproducts.clean_tracked_metadata(tree)
    rewrite(tree, f"{META}/requires.txt")

    def broken(*args: str, **kw: object) -> bytes:
        raise build_byproducts.gitcmd.GitError("git checkout-index failed: index.lock exists")

    monkeypatch.setattr(build_byproducts.gitcmd, "git", broken)
    assert build_byproducts.put_back(tree, clean) == []
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "could not put back" in err[0] and "index.lock" in err[0]
