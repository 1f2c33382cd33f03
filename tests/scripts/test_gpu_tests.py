"""scripts/gpu_tests.py: the GPU tests in parallel processes, and a verdict that fails on a
failure, on a process that did not finish, and on a run where nothing ran. Run here on a
stand-in test folder of its own (no GPU needed: its tests carry the ``gpu`` marker only)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from scripts import gpu_tests
from tests.script_run import run_module

INI = "[pytest]\nmarkers =\n    gpu: stand-in\n"


def folder(tmp_path: Path, **files: str) -> Path:
    root = tmp_path / "suite"
    root.mkdir(parents=True)
    (root / "pytest.ini").write_text(INI)
    for name, body in files.items():
        (root / f"{name}.py").write_text("import os, time, pytest\n\n" + body)
    return root


def run(root: Path, out: Path, *args: str, env: dict[str, str] | None = None):  # noqa: ANN201
    done = run_module("scripts.gpu_tests", "--out", out, "--marker", "gpu", *args, root, env=env)
    summary = json.loads((out / "summary.json").read_text()) if done.returncode != 2 else None
    return done, summary


PASS_TWO = "@pytest.mark.gpu\ndef test_one(): pass\n\n@pytest.mark.gpu\ndef test_two(): pass\n"
FAIL = "@pytest.mark.gpu\ndef test_bad():\n    assert 1 == 2, 'boom'\n"
SKIP = "@pytest.mark.gpu\ndef test_skips():\n    pytest.skip('no GPU here')\n"
UNMARKED = "def test_not_selected():\n    assert False\n"


def test_share_out_balances_the_test_counts() -> None:
    groups = gpu_tests.share_out({"a": 10, "b": 7, "c": 5, "d": 3}, 2)
    loads = sorted(sum({"a": 10, "b": 7, "c": 5, "d": 3}[f] for f in g) for g in groups)
    assert loads == [12, 13]
    assert sorted(f for g in groups for f in g) == ["a", "b", "c", "d"]
    assert gpu_tests.share_out({"a": 1, "b": 1}, 5) == [["a"], ["b"]]


def test_each_process_sees_every_gpu_from_a_different_first_one() -> None:
    assert gpu_tests.rotated(["0", "1"], 0) == "0,1"
    assert gpu_tests.rotated(["0", "1"], 1) == "1,0"
    assert gpu_tests.rotated(["3", "5", "7"], 4) == "5,7,3"


def test_a_failure_fails_the_run_and_is_named(tmp_path: Path) -> None:
    root = folder(tmp_path, test_a=PASS_TWO, test_b=FAIL, test_c=SKIP, test_d=UNMARKED)
    done, summary = run(root, tmp_path / "out", "--procs", "2")
    assert done.returncode == 1, done.stdout + done.stderr
    assert summary["counts"] == {"passed": 2, "failed": 1, "error": 0, "skipped": 1}
    assert summary["collected"] == 4 and summary["unfinished"] == 0
    assert [p for p in summary["problems"] if "test_b.py::test_bad" in p and "boom" in p]
    assert len(summary["processes"]) == 2 and "2 passed, 1 failed" in done.stdout


def test_all_passing_exits_zero(tmp_path: Path) -> None:
    done, summary = run(folder(tmp_path, test_a=PASS_TWO, test_c=SKIP), tmp_path / "out")
    assert done.returncode == 0, done.stdout + done.stderr
    assert summary["counts"]["passed"] == 2 and summary["problems"] == []


def test_nothing_ran_is_not_a_pass(tmp_path: Path) -> None:
    done, summary = run(folder(tmp_path, test_c=SKIP), tmp_path / "out")
    assert done.returncode == 3 and "nothing ran" in done.stderr
    assert summary["counts"]["skipped"] == 1
    done = run_module("scripts.gpu_tests", "--out", tmp_path / "o2", "--marker", "gpu",
                      folder(tmp_path / "x", test_d=UNMARKED))  # fmt: skip
    assert done.returncode == 3 and "no test" in done.stderr


@pytest.mark.full
def test_a_process_past_its_time_is_killed_and_fails_the_run(tmp_path: Path) -> None:
    slow = "@pytest.mark.gpu\ndef test_slow():\n    time.sleep(60)\n"
    started = time.monotonic()
    done, summary = run(folder(tmp_path, test_a=PASS_TWO, test_s=slow), tmp_path / "out",
                        "--timeout", "8")  # fmt: skip
    assert time.monotonic() - started < 45
    assert done.returncode == 1
    assert [p for p in summary["problems"] if p.endswith("killed at the time limit")]
    assert summary["unfinished"] >= 1


@pytest.mark.full
def test_a_result_left_by_an_earlier_run_does_not_count(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    stale = '<testsuite><testcase classname="test_b" name="test_bad" file="test_b.py"/></testsuite>'
    (out / "junit-0.xml").write_text(stale)
    crash = "@pytest.mark.gpu\ndef test_bad():\n    os._exit(4)  # dies before writing its JUnit\n"
    done, summary = run(folder(tmp_path, test_b=crash), out)
    assert done.returncode == 1 and summary["counts"]["passed"] == 0, done.stdout
    assert "process 0 exited 4" in summary["problems"] and summary["unfinished"] == 1


@pytest.mark.full
def test_the_processes_gpu_lists_are_rotations_of_the_visible_ones(tmp_path: Path) -> None:
    record = (
        "@pytest.mark.gpu\ndef test_record():\n"
        "    open(os.environ['RECORD'] + '/' + __name__, 'w').write("
        "os.environ['CUDA_VISIBLE_DEVICES'])\n"
    )
    root = folder(tmp_path, test_a=record, test_b=record)
    (tmp_path / "seen").mkdir()
    env = {"CUDA_VISIBLE_DEVICES": "4,6", "RECORD": str(tmp_path / "seen")}
    done, _ = run(root, tmp_path / "out", "--procs", "2", env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(p.read_text() for p in (tmp_path / "seen").iterdir()) == ["4,6", "6,4"]


def test_bad_usage_is_one_line_and_exit_2(tmp_path: Path) -> None:
    for args in (["--procs", "0", "tests"], ["no/such/path"]):
        done = run_module("scripts.gpu_tests", "--out", tmp_path / "o", *args)
        assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
