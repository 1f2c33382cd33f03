"""Triton tests: where they run, their marker, and running them under the CPU interpreter.

A kernel's Triton tests carry ``@triton_test`` (or, for parameters, ``TRITON_CASE``): they run
in-process on a GPU or under ``TRITON_INTERPRET=1``. ``TRITON_INTERPRET`` must be set before
Triton compiles anything, so on a CPU-only machine with Triton installed (``VIA_CHILD``) a
child pytest runs them with it set, once per test file, and each of them reports the child's
outcome for itself (``outcome_from_child``, called from ``tests/conftest.py``): every child test
is one line of the parent's report and counts in its summary; a skip there fails the test in a
file that sets ``TRITON_SKIPS_ALLOWED = False``. Without Triton they skip.
``run_triton_tests_under_interpreter`` judges a file's child run as a whole: it fails if the
child failed, ran nothing, or (``allow_skips=False``) skipped anything.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
MARKER = "triton_interpreted"
_HERE = Path(__file__).resolve().parent


def _triton_device() -> str | None:
    """ "cuda" (a CUDA or ROCm GPU), "cpu" under the interpreter, None where Triton can't run."""
    if importlib.util.find_spec("triton") is None or importlib.util.find_spec("torch") is None:
        return None
    import torch

    if torch.cuda.is_available():
        return "cuda"
    return "cpu" if INTERPRETER else None


TRITON_DEVICE = _triton_device()
VIA_CHILD = (
    TRITON_DEVICE is None
    and not INTERPRETER
    and importlib.util.find_spec("triton") is not None
    and importlib.util.find_spec("torch") is not None
)
needs_triton = pytest.mark.skipif(
    TRITON_DEVICE is None and not VIA_CHILD,
    reason="needs triton and a GPU, or TRITON_INTERPRET=1 on CPU",
)
TRITON_CASE = [
    pytest.mark.triton,
    getattr(pytest.mark, MARKER),
    needs_triton,
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]


def quick_few(values: Sequence[Any], keep: int = 1, unpack: bool = False) -> list[Any]:
    """Parameter values with all but the first ``keep`` in the full tier: the quick tier runs a
    kernel under the interpreter on a few small cases, the full tier on every one. ``unpack``:
    each value is the tuple of several parameters."""
    out: list[Any] = []
    for i, v in enumerate(values):
        if i < keep:
            out.append(v)
        elif hasattr(v, "marks"):  # a pytest.param already
            out.append(pytest.param(*v.values, marks=[*v.marks, pytest.mark.full], id=v.id))
        else:
            out.append(pytest.param(*(v if unpack else (v,)), marks=pytest.mark.full))
    return out


def triton_test(fn: Callable[..., None]) -> Callable[..., None]:
    """Marks ``triton`` and ``triton_interpreted``, skips where Triton can't run, silences the
    interpreter's numpy deprecation noise."""
    for mark in reversed(TRITON_CASE):
        fn = mark(fn)
    return fn


@dataclass
class ChildRun:
    """One child pytest over one test file's Triton tests."""

    returncode: int
    tail: str
    results: dict[str, dict[str, str]] = field(default_factory=dict)


_runs: dict[Path, ChildRun] = {}


def _child_run(test_file: Path, session: pytest.Session | None) -> ChildRun:
    """The file's child run, started on first use: over the Triton tests of that file the
    session selected (its tier, ``-k``, node ids), else over all of them."""
    test_file = test_file.resolve()
    if test_file in _runs:
        return _runs[test_file]
    chosen = [
        item.nodeid
        for item in (session.items if session is not None else [])
        if item.path.resolve() == test_file and item.get_closest_marker(MARKER)
    ]
    rootdir = session.config.rootpath if session is not None else _HERE.parent
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env.pop("MEGATRON_ROCM_KERNELS", None)  # a forced reference path would test nothing
    env.pop("MEGATRON_ROCM_TRITON_NORMS", None)  # the tests pick the norms' routing themselves
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_HERE), env.get("PYTHONPATH")]))
    with tempfile.TemporaryDirectory(prefix="triton-child-") as tmp:
        report = Path(tmp) / "results.json"
        env["TRITON_CHILD_REPORT"] = str(report)
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
        cmd += ["-p", "triton_child_report", f"--rootdir={rootdir}", "-m", MARKER]
        cmd += chosen or [str(test_file)]
        proc = subprocess.run(
            cmd, cwd=rootdir, env=env, capture_output=True, text=True, timeout=900
        )
        results = json.loads(report.read_text()) if report.exists() else {}
    tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-15:])
    _runs[test_file] = run = ChildRun(proc.returncode, tail, results)
    return run


def outcome_from_child(item: pytest.Function) -> bool | None:
    """For a ``triton_interpreted`` test on a CPU-only machine: the child's outcome as this
    test's own (True: passed, and the body must not run here); None: run it here as usual."""
    if not VIA_CHILD or item.get_closest_marker(MARKER) is None:
        return None
    run = _child_run(item.path, item.session)
    got = run.results.get(item.nodeid)
    if got is None:
        pytest.fail(
            f"the interpreter's child pytest did not report this test (exit {run.returncode}):\n"
            f"{run.tail}",
            pytrace=False,
        )
    if got["outcome"] == "failed":
        pytest.fail(f"under TRITON_INTERPRET=1 (child pytest), {got['detail']}", pytrace=False)
    if got["outcome"] == "skipped":
        if not getattr(item.module, "TRITON_SKIPS_ALLOWED", True):
            pytest.fail(
                f"skipped under TRITON_INTERPRET=1, where {item.path.name} allows no skip: "
                f"{got['detail']}",
                pytrace=False,
            )
        pytest.skip(f"under TRITON_INTERPRET=1: {got['detail']}")
    if got["outcome"] == "xfailed":
        pytest.xfail(got["detail"])
    return True


def run_triton_tests_under_interpreter(
    test_file: Path, session: pytest.Session | None = None, *, allow_skips: bool = True
) -> None:
    """The file's child run as a whole (the run its tests reported from, if they ran): it
    exited cleanly, ran something, and skipped nothing unless ``allow_skips``."""
    run = _child_run(test_file, session)
    outcomes = [r["outcome"] for r in run.results.values()]
    assert run.returncode == 0, run.tail
    assert outcomes and "failed" not in outcomes, run.tail
    assert "passed" in outcomes, run.tail
    assert allow_skips or "skipped" not in outcomes, run.tail
