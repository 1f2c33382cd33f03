"""install: planning and constraint logic as units, rollback with a scripted pip, and one slow
real ``pip install --no-deps --target`` of a fake tree."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rocm.commands import install as install_cmd
from megatron_rocm.envtools import installer
from megatron_rocm.errors import FatalError, SourceError, UsageError

HAVE = {
    "torch": "2.13.0+cpu",
    "torchvision": "0.28.0",
    "setuptools": "84.0",
    "packaging": "25.0",
    "megatron-rocm": "0.1.0",
    # the training-side imports upstream leaves undeclared (see TRAINING_RUNTIME)
    **{name: "1.0" for name in ("six", "regex", "pyyaml", "pydantic", "nltk", "psutil", "einops")},
}


def make_tree(
    root: Path, deps: list[str] | None = None, helpers: bool = False, build: str = '["setuptools"]'
) -> Path:
    """A minimal stand-in for a Megatron-LM checkout: package_info plus a pyproject."""
    core = root / "megatron" / "core"
    core.mkdir(parents=True)
    (root / "megatron" / "__init__.py").write_text("")
    (core / "__init__.py").write_text("")
    (core / "package_info.py").write_text("MAJOR, MINOR, PATCH = 0, 16, 0\n")
    if helpers:
        (core / "datasets").mkdir()
        (core / "datasets" / "helpers.cpp").write_text("// helpers\n")
    project = (
        f"dependencies = {json.dumps(deps)}\n"
        if deps is not None
        else 'dynamic = ["dependencies"]\n'
    )
    (root / "pyproject.toml").write_text(
        f'[build-system]\nrequires = {build}\nbuild-backend = "setuptools.build_meta"\n\n'
        f'[project]\nname = "fake-megatron-core"\nversion = "0.16.0"\n{project}\n'
        '[tool.setuptools.packages.find]\ninclude = ["megatron*"]\n'
    )
    return root


def test_plan_pins_torch_and_installs_tree_without_deps(tmp_path: Path) -> None:
    tree = make_tree(tmp_path / "t", ["torch>=2.6.0", "numpy", "packaging>=24.2"])
    p = installer.plan(tree, editable=True, workdir=tmp_path / "w", have=HAVE)
    assert p.pins == {"torch": "2.13.0+cpu", "torchvision": "0.28.0"}
    assert p.deps == ["numpy", "packaging>=24.2"]  # torch is never passed to pip
    assert not p.build_isolation  # setuptools is already here: build offline
    tree_step = p.steps[-2].argv
    assert tree_step[-2:] == ["-e", str(tree)]
    assert "--no-deps" in tree_step and tree_step[3:6] == ["install", "-c", str(p.constraints)]
    assert all("-c" in s.argv for s in p.steps if s.argv)
    assert not p.constraints.exists()  # planning writes nothing


def test_megatron_rocm_itself_is_installed_when_missing(tmp_path: Path) -> None:
    have = {k: v for k, v in HAVE.items() if k != "megatron-rocm"}
    p = installer.plan(make_tree(tmp_path / "t", []), True, tmp_path / "w", have=have)
    self_step = next(s for s in p.steps if "megatron-rocm" in s.title)
    assert self_step.argv[-1] == str(installer.PACKAGE_ROOT) and "-c" in self_step.argv


def test_constraints_file_content(tmp_path: Path) -> None:
    p = installer.plan(make_tree(tmp_path / "t", []), True, tmp_path / "w", have=HAVE)
    installer.write_constraints(p)
    assert p.constraints.read_text() == "torch==2.13.0+cpu\ntorchvision==0.28.0\n"


def test_torch_missing_says_how_to_install_rocm_torch(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match=r"--index-url https://download.pytorch.org/whl/rocm7"):
        installer.plan(make_tree(tmp_path / "t", []), True, tmp_path, have={"numpy": "2"})


def test_not_a_tree_is_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="not a Megatron-LM tree"):
        installer.plan(tmp_path, True, tmp_path, have=HAVE)


@pytest.mark.parametrize(
    "dep",
    ["transformer-engine[pytorch]>=2.9", "nvidia-modelopt[torch]", "apex", "nv-grouped-gemm~=1.1"],
)
def test_nvidia_only_dependencies_are_refused(tmp_path: Path, dep: str) -> None:
    with pytest.raises(SourceError, match="NVIDIA-only"):
        installer.plan(make_tree(tmp_path / "t", ["numpy", dep]), True, tmp_path, have=HAVE)


def test_marker_excluded_dependency_is_ignored(tmp_path: Path) -> None:
    tree = make_tree(tmp_path / "t", ['nvidia-modelopt; sys_platform == "nonexistent"', "numpy"])
    assert installer.plan(tree, True, tmp_path, have=HAVE).deps == ["numpy"]


def test_torch_requirement_not_met(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match="needs torch>=3.0"):
        installer.plan(make_tree(tmp_path / "t", ["torch>=3.0"]), True, tmp_path, have=HAVE)


@pytest.mark.parametrize("pin", ["torch==2.13.0+cpu", "torch===2.13.0+cpu", "torch==2.13.0"])
def test_a_pin_of_the_installed_torch_build_is_met(tmp_path: Path, pin: str) -> None:
    assert installer.plan(make_tree(tmp_path / "t", [pin]), True, tmp_path, have=HAVE).deps == []


@pytest.mark.parametrize("pin", ["torch==2.13.0+rocm6.4", "torch<2.13"])
def test_a_pin_of_another_torch_build_is_not(tmp_path: Path, pin: str) -> None:
    with pytest.raises(SourceError, match="the tree needs"):
        installer.plan(make_tree(tmp_path / "t", [pin]), True, tmp_path, have=HAVE)


def test_dynamic_dependencies_come_from_core_requirements(tmp_path: Path) -> None:
    tree = make_tree(tmp_path / "t", None)
    (tree / "megatron/core/requirements.txt").write_text("torch\npackaging  # comment\n\n")
    assert installer.plan(tree, True, tmp_path, have=HAVE).deps == ["packaging"]


def test_helpers_step_and_pybind11(tmp_path: Path) -> None:
    tree = make_tree(tmp_path / "t", [], helpers=True, build='["setuptools", "pybind11"]')
    p = installer.plan(tree, False, tmp_path, have=HAVE)
    assert p.deps == ["pybind11"] and p.build_isolation  # pybind11 is missing here
    assert [s.kind for s in p.steps] == ["pip", "helpers", "pip", "verify"]
    assert "-e" not in p.steps[2].argv


class ScriptedPip:
    """Plays pip: records commands, fails on the one containing ``fail_on``."""

    def __init__(self, fail_on: str) -> None:
        self.calls: list[list[str]] = []
        self.fail_on = fail_on
        self.packages = {"torch": "2.13.0+cpu", "numpy": "1.26.0"}

    def __call__(self, argv):
        argv = list(argv)
        self.calls.append(argv)
        if argv[3:5] == ["list", "--format=json"]:
            out = json.dumps([{"name": n, "version": v} for n, v in self.packages.items()])
            return subprocess.CompletedProcess(argv, 0, out, "")
        if self.fail_on in " ".join(argv):
            return subprocess.CompletedProcess(argv, 1, "", "error: boom")
        if argv[3] == "install" and "numpy" in argv:  # the deps step: upgrades and adds
            self.packages.update(numpy="2.0.0", pybind11="3.0.1")
        return subprocess.CompletedProcess(argv, 0, "", "")


def test_failed_step_rolls_back_and_names_the_step(tmp_path: Path) -> None:
    tree = make_tree(tmp_path / "t", ["numpy"])
    p = installer.plan(tree, True, tmp_path / "w", have=HAVE)
    pip = ScriptedPip(fail_on=str(tree))
    with pytest.raises(SourceError, match=r"step 2/3 \(install the tree.*exit 1: error: boom") as e:
        installer.execute(p, run=pip, log=lambda _: None)
    assert e.value.code == 3  # the environment (pip), not "checks failed"
    kept = tmp_path / "w" / "failed-step.log"  # the one line has no "see above": keep it all
    assert f"whole output: {kept}" in str(e.value)
    assert kept.read_text().startswith("$ ") and "error: boom" in kept.read_text()
    assert "uninstalled pybind11" in str(e.value) and "restored numpy==1.26.0" in str(e.value)
    assert [c[3:] for c in pip.calls if c[3] == "uninstall"] == [["uninstall", "-y", "pybind11"]]
    assert (tmp_path / "w" / "pip-list-before.json").is_file()


def test_dry_run_prints_steps_and_changes_nothing(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(installer, "installed", lambda: dict(HAVE))
    tree = make_tree(tmp_path / "t", ["numpy"])
    assert install_cmd.install(str(tree), dry_run=True) == 0
    out = capsys.readouterr().out
    assert "[1/3] install the tree's dependencies" in out and "--no-deps" in out
    assert not (tmp_path / "cache").exists()
    assert install_cmd.install(str(tree), dry_run=True, as_json=True) == 0
    assert json.loads(capsys.readouterr().out)["pins"]["torch"] == "2.13.0+cpu"


@pytest.mark.full
@pytest.mark.slow
def test_real_pip_installs_fake_tree_offline(tmp_path: Path) -> None:
    """The tree step's exact pip arguments, plus --target, against real pip (no network)."""
    tree = make_tree(tmp_path / "t", ["numpy"])
    have = installer.installed()
    if "setuptools" not in have:
        pytest.skip("needs setuptools for an offline build")
    p = installer.plan(tree, editable=False, workdir=tmp_path / "w", have={**HAVE, **have})
    if p.build_isolation:
        pytest.skip("this environment's setuptools cannot build without isolation (offline)")
    installer.write_constraints(p)
    argv = [*p.steps[-2].argv, "--target", str(tmp_path / "site"), "--no-index"]
    res = subprocess.run(argv, capture_output=True, text=True, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "site/megatron/core/package_info.py").is_file()
    assert not (tmp_path / "site/numpy").exists()  # --no-deps held
    assert sys.executable == argv[0]


def test_tree_requiring_newer_python_is_refused_before_any_step(tmp_path):
    """megatron-core 0.17+ says requires-python >=3.12; refuse up front, change nothing."""
    import sys

    from megatron_rocm.envtools.installer import plan
    from megatron_rocm.errors import SourceError

    tree = tmp_path / "tree"
    (tree / "megatron" / "core").mkdir(parents=True)
    (tree / "megatron" / "core" / "__init__.py").write_text("")
    (tree / "megatron" / "core" / "package_info.py").write_text("MAJOR = 0\nMINOR = 17\n")
    nxt = f"{sys.version_info[0]}.{sys.version_info[1] + 1}"
    (tree / "pyproject.toml").write_text(
        f'[project]\nname = "megatron-core"\nrequires-python = ">={nxt}"\n'
    )
    with pytest.raises(SourceError, match=f"requires Python >={nxt}") as refused:
        plan(tree, editable=True, workdir=tmp_path, have={"torch": "2.13.0"})
    assert "megatron-rocm apply --ref <tag>" in str(refused.value)  # the way out, named


def test_training_imports_upstream_leaves_undeclared_are_added():
    from megatron_rocm.envtools.installer import training_requirements

    assert training_requirements({"six": "1.16", "regex": "2024.1"}) == [
        "pyyaml",
        "pydantic",
        "nltk",
        "psutil",
        "einops",
    ]
    assert (
        training_requirements(
            {n: "1" for n in ("six", "regex", "pyyaml", "pydantic", "nltk", "psutil", "einops")}
        )
        == []
    )


def test_megatron_rocm_dependency_is_never_resolved_from_an_index(tmp_path):
    """The patched tree declares megatron-rocm; it must come from this package, installed first."""
    have = {k: v for k, v in HAVE.items() if k != "megatron-rocm"}
    p = installer.plan(
        make_tree(tmp_path / "t", ["numpy", "megatron-rocm"]), True, tmp_path, have=have
    )
    assert "megatron-rocm" not in p.deps
    assert p.steps[0].title.startswith("install megatron-rocm")
    assert str(installer.PACKAGE_ROOT) in p.steps[0].argv


def test_offline_install_skips_build_isolation_when_backend_is_installed(tmp_path):
    """An offline GPU box has setuptools; pip must not try to fetch it into a build env."""
    have = {k: v for k, v in HAVE.items() if k != "megatron-rocm"}
    p = installer.plan(make_tree(tmp_path / "t", ["numpy"]), True, tmp_path, have=have)
    assert "--no-build-isolation" in p.steps[0].argv  # megatron-rocm itself (setuptools>=64)
    old = {**have, "setuptools": "40.0"}
    p = installer.plan(make_tree(tmp_path / "u", ["numpy"]), True, tmp_path, have=old)
    assert "--no-build-isolation" not in p.steps[0].argv


def test_old_setuptools_without_wheel_keeps_build_isolation(tmp_path):
    tree = make_tree(tmp_path / "t", ["numpy"])
    old = {**HAVE, "setuptools": "65.5.0"}
    assert installer.plan(tree, True, tmp_path, have=old).build_isolation
    assert not installer.plan(tree, True, tmp_path, have={**old, "wheel": "0.45"}).build_isolation


class PipWithVerify(ScriptedPip):
    """ScriptedPip that also answers the verify step, from the tree it was given, and can hold
    an editable megatron-core and be interrupted at one command."""

    def __init__(self, fail_on: str, tree: Path, interrupt_on: str = "\0") -> None:
        super().__init__(fail_on)
        self.tree = tree
        self.interrupt_on = interrupt_on
        self.editable: dict[str, str] = {}

    def __call__(self, argv):
        argv = list(argv)
        if argv[1] == "-c":
            self.calls.append(argv)
            where = self.tree / "megatron/core/__init__.py"
            return subprocess.CompletedProcess(argv, 0, f"2.13.0+cpu\n{where}\n", "")
        if self.interrupt_on in " ".join(argv):
            raise KeyboardInterrupt
        if argv[3:5] == ["list", "--format=json"]:
            self.calls.append(argv)
            listing = [
                {"name": n, "version": v}
                | ({"editable_project_location": self.editable[n]} if n in self.editable else {})
                for n, v in self.packages.items()
            ]
            return subprocess.CompletedProcess(argv, 0, json.dumps(listing), "")
        if argv[3] == "install" and "-e" in argv and self.fail_on not in " ".join(argv):
            self.packages["fake-megatron-core"] = "0.16.0"
            self.editable["fake-megatron-core"] = argv[-1]
        return super().__call__(argv)


def test_a_tree_path_with_spaces_installs(tmp_path: Path) -> None:
    tree = make_tree(tmp_path / "sp ace" / "t", ["numpy"])
    p = installer.plan(tree, True, tmp_path / "w", have=HAVE)
    done, _ = installer.execute(p, run=PipWithVerify("\0", tree), log=lambda _: None)
    assert done[-1].startswith("verify")


def test_an_editable_install_moved_to_another_tree_is_moved_back(tmp_path: Path) -> None:
    old, tree = tmp_path / "old", make_tree(tmp_path / "t", ["numpy"])
    p = installer.plan(tree, True, tmp_path / "w", have=HAVE)
    pip = PipWithVerify("verify-never", tree)
    pip.packages["fake-megatron-core"] = "0.16.0"
    pip.editable["fake-megatron-core"] = str(old)
    pip.tree = tmp_path / "elsewhere"  # the verify step sees the wrong tree: it fails
    with pytest.raises(FatalError, match="restored fake-megatron-core 0.16.0 \\(editable"):
        installer.execute(p, run=pip, log=lambda _: None)
    assert any(c[-2:] == ["-e", str(old)] for c in pip.calls if "install" in c)


def test_an_interrupt_rolls_back_like_a_failure(tmp_path: Path) -> None:
    from megatron_rocm.errors import Interrupted

    tree = make_tree(tmp_path / "t", ["numpy"])
    p = installer.plan(tree, True, tmp_path / "w", have=HAVE)
    pip = PipWithVerify("\0", tree, interrupt_on=str(tree))  # Ctrl-C in the tree's step
    with pytest.raises(Interrupted, match="interrupted at step 2/3; rolled back: ") as e:
        installer.execute(p, run=pip, log=lambda _: None)
    assert e.value.code == 130
    assert "uninstalled pybind11" in str(e.value) and "restored numpy==1.26.0" in str(e.value)


def test_a_bug_of_ours_in_a_step_stays_an_internal_error(tmp_path: Path) -> None:
    """Not "environment" (exit 3): the CLI reports an internal error (exit 4), after the same
    rollback, which the exception's note names."""
    tree = make_tree(tmp_path / "t", ["numpy"])
    p = installer.plan(tree, True, tmp_path / "w", have=HAVE)

    class Buggy(ScriptedPip):
        def __call__(self, argv):
            if str(tree) in " ".join(argv):
                raise KeyError("a bug")
            return super().__call__(argv)

    pip = Buggy(fail_on="\0")
    with pytest.raises(KeyError) as e:
        installer.execute(p, run=pip, log=lambda _: None)
    assert not isinstance(e.value, FatalError)
    assert "rolled back: uninstalled pybind11" in " ".join(e.value.__notes__)


def test_a_failed_rebuild_puts_the_earlier_helpers_library_back(tmp_path: Path) -> None:
    tree = make_tree(tmp_path / "t", [], helpers=True)
    p = installer.plan(tree, True, tmp_path / "w", have=HAVE)
    target = installer.helpers_target(p.helpers)
    target.write_bytes(b"the working library")
    import os

    os.utime(target, (1, 1))  # older than helpers.cpp: a rebuild is due
    pip = PipWithVerify("-shared", tree)  # the compiler's command fails
    with pytest.raises(FatalError, match="put back the earlier"):
        installer.execute(p, run=pip, log=lambda _: None)
    assert target.read_bytes() == b"the working library"


def test_no_pip_is_an_environment_error(tmp_path: Path) -> None:
    tree = make_tree(tmp_path / "t", [])
    p = installer.plan(tree, True, tmp_path / "w", have=HAVE)

    def no_pip(argv):
        return subprocess.CompletedProcess(argv, 1, "", "/usr/bin/python3: No module named pip")

    with pytest.raises(SourceError, match="pip cannot list what is installed.*No module named pip"):
        installer.execute(p, run=no_pip, log=lambda _: None)
