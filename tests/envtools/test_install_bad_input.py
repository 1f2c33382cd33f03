"""install/smoke on a tree whose pyproject.toml is malformed, and ``install ""``: one line on
stderr and exit 2, never an internal error (exit 4) or a plan built from garbage."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_install import HAVE, make_tree

from megatron_rocm.envtools import installer
from megatron_rocm.errors import UsageError
from megatron_rocm.main import main

PROJECT = '[project]\nname = "fake-megatron-core"\nversion = "0.16.0"\n'

# (pyproject.toml text, what the one error line must say)
MALFORMED = {
    "toml-syntax": (PROJECT + "garbage = [\n", "malformed TOML"),
    "not-utf8": (None, "malformed TOML"),
    "project-not-table": ('project = "x"\n', "[project] must be a table"),
    "deps-int": (
        PROJECT + "dependencies = 5\n",
        "[project] dependencies must be a list of strings",
    ),
    "deps-int-item": (
        PROJECT + "dependencies = [5]\n",
        "[project] dependencies must be a list of strings",
    ),
    "deps-string": (
        PROJECT + 'dependencies = "numpy"\n',
        "[project] dependencies must be a list of strings",
    ),
    "dynamic-int": (
        PROJECT + 'dynamic = 5\ndependencies = ["numpy"]\n',
        "[project] dynamic must be a list of strings",
    ),
    "requires-python-int": (
        PROJECT + "requires-python = 3\n",
        "[project] requires-python must be a string",
    ),
    "requires-python-garbage": (
        PROJECT + 'requires-python = "three"\n',
        "[project] requires-python is not a version range",
    ),
    "build-system-int": ("build-system = 5\n" + PROJECT, "[build-system] must be a table"),
    "build-requires-string": (
        '[build-system]\nrequires = "setuptools"\n' + PROJECT,
        "[build-system] requires must be a list of strings",
    ),
    "build-requires-garbage": (
        '[build-system]\nrequires = ["set tools !!"]\n' + PROJECT,
        "[build-system] requires has an unreadable entry",
    ),
}


def _bad_tree(root: Path, text: str | None) -> Path:
    """A fake tree whose pyproject.toml is ``text`` (None: bytes that are not UTF-8)."""
    tree = make_tree(root, ["numpy"])
    pyproject = tree / "pyproject.toml"
    if text is None:
        pyproject.write_bytes(b"\xff\xfe[project]\n")
    else:
        pyproject.write_text(text)
    return tree


def _one_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err and "internal error" not in err, err
    assert len(err.strip().splitlines()) == 1, err
    return err


@pytest.fixture
def have(monkeypatch: pytest.MonkeyPatch) -> None:
    """The environment install plans against: torch present, whatever this venv holds."""
    monkeypatch.setattr(installer, "installed", lambda: dict(HAVE))


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_install_dry_run_on_malformed_pyproject_is_exit_2(
    case: str, tmp_path: Path, have: None, capsys: pytest.CaptureFixture[str]
) -> None:
    text, says = MALFORMED[case]
    tree = _bad_tree(tmp_path / "t", text)
    assert main(["install", "--dry-run", str(tree)]) == 2
    err = _one_line(capsys)
    assert f"{tree / 'pyproject.toml'}: " in err and says in err, err


def test_dependencies_as_a_string_is_never_split_into_letters(tmp_path: Path) -> None:
    """``dependencies = "numpy"`` once planned ``pip install n u m p y``."""
    tree = _bad_tree(tmp_path / "t", PROJECT + 'dependencies = "numpy"\n')
    with pytest.raises(UsageError, match="dependencies must be a list of strings"):
        installer.plan(tree, True, tmp_path / "w", have=dict(HAVE))


def test_well_formed_pyproject_still_plans(tmp_path: Path) -> None:
    """The checks refuse only wrong types: lists of strings and a real range still work."""
    tree = _bad_tree(
        tmp_path / "t",
        '[build-system]\nrequires = ["setuptools"]\n'
        + PROJECT
        + 'requires-python = ">=3.8"\ndynamic = []\ndependencies = ["numpy"]\n',
    )
    assert installer.plan(tree, True, tmp_path / "w", have=dict(HAVE)).deps == ["numpy"]


def test_requirements_txt_not_utf8_is_exit_2(
    tmp_path: Path, have: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """setup.py-era trees declare their dependencies in megatron/core/requirements.txt."""
    tree = make_tree(tmp_path / "t")  # dynamic dependencies: falls back to requirements.txt
    (tree / "megatron" / "core" / "requirements.txt").write_bytes(b"numpy\n\xff\n")
    assert main(["install", "--dry-run", str(tree)]) == 2
    assert "requirements.txt: not UTF-8 text" in _one_line(capsys)


@pytest.mark.parametrize(
    "case", ["toml-syntax", "not-utf8", "requires-python-int", "requires-python-garbage"]
)
def test_smoke_on_malformed_pyproject_is_exit_2(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """smoke reads requires-python through installer.check_python before running a check."""
    pytest.importorskip("torch")  # smoke refuses earlier (exit 3) without torch
    text, says = MALFORMED[case]
    tree = _bad_tree(tmp_path / "t", text)
    assert main(["smoke", str(tree), "--only", "imports"]) == 2
    err = _one_line(capsys)
    assert f"{tree / 'pyproject.toml'}: " in err and says in err, err


def test_install_empty_dir_is_exit_2_not_the_current_folder(
    tmp_path: Path, have: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``install ""`` once meant ``.``: here that is a valid tree, so only the check refuses."""
    monkeypatch.chdir(make_tree(tmp_path / "t", []))
    assert main(["install", "--dry-run", ""]) == 2
    assert "DIR is empty" in _one_line(capsys)
