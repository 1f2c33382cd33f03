"""Exit codes that mean one thing, through ``main()`` (or the installed entry point):
environment problems are 3 with one line (before the work where they can be foreseen), a
closed pipe ends the output quietly with the verb's own code, nothing escapes as exit 4."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from toyrepo import apply_argv

from megatron_rocm.errors import EXIT_BUSY, EXIT_ENVIRONMENT, EXIT_INTERNAL, EXIT_USAGE
from megatron_rocm.main import EXIT_CODES, main

CLI_DOC = Path(__file__).resolve().parents[2] / "docs" / "cli.md"


def one_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


def closed_stdout(argv: list[str]) -> subprocess.CompletedProcess:
    """Run the CLI with a stdout whose reader is already gone (``| head`` after it quit)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run(
            [sys.executable, "-m", "megatron_rocm", *argv],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
        )
    finally:
        os.close(write_end)


def test_documented_codes_agree_everywhere():
    """docs/cli.md, ``--help`` and errors.py state the same codes (lock contention: 5)."""
    import megatron_rocm.errors as errors

    table = {
        0: "0 ok",
        1: "1 patches do not apply",
        EXIT_USAGE: "2 usage or bad input",
        EXIT_ENVIRONMENT: "3 source or environment",
        EXIT_INTERNAL: "4 internal error",
        EXIT_BUSY: "5 busy",
    }
    readme = " ".join(CLI_DOC.read_text(encoding="utf-8").split())  # markdown may rewrap
    for code, phrase in table.items():
        assert phrase.startswith(f"{code} ") and phrase in readme, phrase
        assert phrase in EXIT_CODES, phrase
        assert f"- {phrase}" in (errors.__doc__ or ""), phrase
    assert "130/143 interrupted" in readme and "130/143 interrupted" in EXIT_CODES


@pytest.mark.parametrize(
    ("argv", "code"),
    [
        (["list"], 0),
        (["list", "--json"], 0),
        (["check", "--ref", "core_v0.2.0"], 0),
        (["check", "--ref", "core_v0.3.0"], 1),  # failing check: its own code, still quiet
        (["matrix", "--no-scan", "--tags", "core_v0.[12].0"], 0),
    ],
)
def test_closed_pipe_exits_quietly_with_the_verbs_own_code(toy, argv, code):
    _, upstream, series = toy
    if argv[0] in ("check", "matrix"):
        argv = [argv[0], "--source", str(upstream), *argv[1:]]
    proc = closed_stdout([*argv, "--series", str(series)])
    assert (proc.returncode, proc.stderr) == (code, "")


def test_export_through_a_closed_pipe(toy):
    root, upstream, series = toy
    assert main(apply_argv(upstream, series, root / "fork")) == 0
    proc = closed_stdout(["export", "--repo", str(root / "fork"), "--series", str(series)])
    assert (proc.returncode, proc.stderr) == (0, "")


def test_matrix_out_that_cannot_be_written_fails_before_the_work(toy, capsys, matrix_runs):
    _, upstream, series = toy
    blocker = upstream.parent / "a-file"
    blocker.write_text("x")
    argv = ["matrix", "--source", str(upstream), "--series", str(series), "--no-scan"]
    assert main([*argv, "--out", str(blocker / "m.md")]) == EXIT_ENVIRONMENT
    assert "is not a folder" in one_line(capsys)
    assert matrix_runs == []  # refused before any work


def test_matrix_write_failure_after_the_work_is_one_line(toy, capsys, monkeypatch):
    _, upstream, series = toy
    out = upstream.parent / "m.md"

    def full_disk(*_a, **_k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_text", full_disk)
    argv = ["matrix", "--source", str(upstream), "--series", str(series), "--no-scan"]
    assert main([*argv, "--tags", "core_v0.1.0", "--out", str(out)]) == EXIT_ENVIRONMENT
    assert "No space left on device" in one_line(capsys)


def test_stray_os_error_is_environment_not_internal(monkeypatch, capsys):
    import megatron_rocm.commands.list_series as ls

    def denied(*_a, **_k):
        raise PermissionError(13, "Permission denied", "/some/file")

    monkeypatch.setattr(ls, "load_series", denied)
    assert main(["list"]) == EXIT_ENVIRONMENT
    err = one_line(capsys)
    assert "Permission denied: /some/file" in err and "megatron-rocm.log" in err


@pytest.mark.torch
def test_smoke_json_that_cannot_be_written_fails_before_the_run(tmp_path, capsys):
    pytest.importorskip("torch")
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    assert main(["smoke", "--only", "kernels", "--json", str(blocker / "r.json")]) == 3
    assert "cannot write --json" in one_line(capsys)
    assert main(["smoke", "--only", "kernels", "--junit", str(tmp_path)]) == 2
    assert "is a folder" in one_line(capsys)


@pytest.mark.torch
def test_smoke_checks_requires_python_like_install(tmp_path, capsys):
    """A tree this Python cannot import (megatron-core 0.17+ on 3.11): one line, exit 3,
    instead of a raw ImportError from the imports check."""
    pytest.importorskip("torch")
    tree = tmp_path / "tree"
    (tree / "megatron/core").mkdir(parents=True)
    (tree / "megatron/core/package_info.py").write_text("MAJOR, MINOR, PATCH = 0, 17, 0\n")
    (tree / "pyproject.toml").write_text('[project]\nname = "x"\nrequires-python = ">=3.99"\n')
    assert main(["smoke", str(tree), "--only", "imports"]) == EXIT_ENVIRONMENT
    assert "requires Python >=3.99" in one_line(capsys)


@pytest.fixture
def sigint_restored():
    import signal

    saved = signal.getsignal(signal.SIGINT)
    yield signal
    signal.signal(signal.SIGINT, saved)


def test_a_ctrl_c_after_the_work_cannot_print_a_traceback(monkeypatch, sigint_restored):
    """The console command ignores SIGINT once ``main`` has decided the exit code: a late
    Ctrl-C would otherwise surface as Python's KeyboardInterrupt traceback at exit."""
    from megatron_rocm import main as cli_module

    monkeypatch.setattr(cli_module, "main", lambda: 0)
    assert cli_module.cli() == 0
    assert sigint_restored.getsignal(sigint_restored.SIGINT) is sigint_restored.SIG_IGN


def test_a_ctrl_c_in_mains_last_lines_is_one_line(monkeypatch, capsys, sigint_restored):
    from megatron_rocm import main as cli_module

    def interrupted_late() -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_module, "main", interrupted_late)
    assert cli_module.cli() == 130
    assert one_line(capsys) == "megatron-rocm: interrupted\n"
    assert sigint_restored.getsignal(sigint_restored.SIGINT) is sigint_restored.SIG_IGN


# A Ctrl-C that lands while the CLI's modules load: the import of megatron_rocm.main sends
# SIGINT to its own process, as a user's Ctrl-C at that instant would.
_INTERRUPTED_IMPORT = """
import importlib.abc, os, signal, sys
class Interrupt(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "megatron_rocm.main":
            os.kill(os.getpid(), signal.SIGINT)
        return None
sys.meta_path.insert(0, Interrupt())
sys.argv = ["megatron-rocm", "list"]
from megatron_rocm.console import cli
sys.exit(cli())
"""


def test_a_ctrl_c_while_the_cli_loads_is_one_line():
    done = subprocess.run(
        [sys.executable, "-c", _INTERRUPTED_IMPORT], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 130
    assert done.stderr == "megatron-rocm: interrupted while starting; nothing was changed\n"
    assert done.stdout == ""


@pytest.mark.parametrize("closed", ["stdout", "stderr"])
def test_a_closed_stream_is_a_null_device_not_a_traceback(closed):
    """``megatron-rocm list >&-``: Python sets the stream to None; the run behaves as with
    ``>/dev/null`` (exit 0) instead of an AttributeError traceback."""
    fd = 1 if closed == "stdout" else 2
    done = subprocess.run(
        [sys.executable, "-m", "megatron_rocm", "list"],
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=lambda: os.close(fd),  # noqa: PLW1509 - the child's own fd, before exec
    )
    assert done.returncode == 0, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr + done.stdout
