"""scripts/gpu_tests.py: the GPU tests in parallel processes, and a verdict that fails on a
failure, on a process that did not finish, and on a run where nothing ran. Run here on a
stand-in test folder of its own: its tests carry the ``gpu`` marker and touch no GPU, and
``CUDA_VISIBLE_DEVICES`` names a GPU for the tool to hand out."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from scripts import gpu_tests
from tests.script_run import REPO, run_module

INI = "[pytest]\nmarkers =\n    gpu: stand-in\n    cpu: a test that needs no GPU\n"
ONE_GPU = {"CUDA_VISIBLE_DEVICES": "0"}
NEEDS_PROC = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")


def folder(tmp_path: Path, **files: str) -> Path:
    root = tmp_path / "suite"
    root.mkdir(parents=True)
    (root / "pytest.ini").write_text(INI)
    for name, body in files.items():
        (root / f"{name}.py").write_text("import os, subprocess, time, pytest\n\n" + body)
    return root


def run(root: Path, out: Path, *args: str, env: dict[str, str] | None = None):  # noqa: ANN201
    done = run_module("scripts.gpu_tests", "--out", out, "--marker", "gpu", *args, root,
                      env={**ONE_GPU, **(env or {})})  # fmt: skip
    summary = json.loads((out / "summary.json").read_text()) if done.returncode != 2 else None
    return done, summary


def alive(pid: int) -> bool:
    """Running, not a zombie: an orphan killed here waits for a reaper that may be slow."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


PASS_TWO = "@pytest.mark.gpu\ndef test_one(): pass\n\n@pytest.mark.gpu\ndef test_two(): pass\n"
FAIL = "@pytest.mark.gpu\ndef test_bad():\n    assert 1 == 2, 'boom'\n"
SKIP = "@pytest.mark.gpu\ndef test_skips():\n    pytest.skip('no GPU here')\n"
UNMARKED = "def test_not_selected():\n    assert False\n"
# A class test, a parametrized one, and a test inherited from another file: their node ids
# must meet the results' (JUnit would name the inherited one after base_cases.py).
SHAPES = (
    "from base_cases import Base\n\n"
    "@pytest.mark.gpu\nclass TestKid(Base):\n    def test_own(self): pass\n\n"
    "@pytest.mark.gpu\n@pytest.mark.parametrize('n', [1, 2])\ndef test_p(n): pass\n"
)
BASE = "class Base:\n    def test_inherited(self): pass\n"
LEAVES_A_CHILD = (
    "@pytest.mark.gpu\ndef test_leaves_a_child():\n"
    "    p = subprocess.Popen(['sleep', '300'])\n"
    "    open(os.environ['PIDS'] + '/' + str(p.pid), 'w').close()\n"
)


def test_share_out_balances_the_test_counts() -> None:
    sizes = {"a": 10, "b": 7, "c": 5, "d": 3}
    groups = gpu_tests.share_out(sizes, 2)
    assert sorted(sum(sizes[f] for f in g) for g in groups) == [12, 13]
    assert sorted(f for g in groups for f in g) == ["a", "b", "c", "d"]
    assert gpu_tests.share_out({"a": 1, "b": 1}, 5) == [["a"], ["b"]]


def test_each_process_sees_every_gpu_from_a_different_first_one() -> None:
    assert gpu_tests.rotated(["0", "1"], 0) == "0,1"
    assert gpu_tests.rotated(["0", "1"], 1) == "1,0"
    assert gpu_tests.rotated(["3", "5", "7"], 4) == "5,7,3"


def test_rocms_list_comes_first(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "2,3")
    assert gpu_tests.visible_devices() == ("HIP_VISIBLE_DEVICES", ["2", "3"])
    monkeypatch.delenv("HIP_VISIBLE_DEVICES")
    assert gpu_tests.visible_devices() == ("CUDA_VISIBLE_DEVICES", ["0", "1"])


def test_a_torch_that_cannot_count_the_gpus_fails_the_run(tmp_path: Path) -> None:
    fake = tmp_path / "fake" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('no torch in this test')\n")
    root = folder(tmp_path, test_a=PASS_TWO)
    env = {"PYTHONPATH": f"{tmp_path / 'fake'}{os.pathsep}{REPO}"}
    done = run_module("scripts.gpu_tests", "--out", tmp_path / "out", "--marker", "gpu", root,
                      env=env)  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    assert "torch could not count the GPUs: ImportError: no torch in this test" in done.stdout


def test_a_rank_in_the_environment_does_not_hide_the_results(tmp_path: Path) -> None:
    done, summary = run(folder(tmp_path, test_a=PASS_TWO), tmp_path / "out", env={"RANK": "1"})
    assert done.returncode == 0 and summary["counts"]["passed"] == 2, done.stdout + done.stderr


def test_a_failure_fails_the_run_and_is_named(tmp_path: Path) -> None:
    root = folder(tmp_path, test_a=PASS_TWO, test_b=FAIL, test_c=SKIP, test_d=UNMARKED)
    done, summary = run(root, tmp_path / "out", "--procs", "2")
    assert done.returncode == 1, done.stdout + done.stderr
    assert summary["counts"] == {"passed": 2, "failed": 1, "error": 0, "skipped": 1}
    assert summary["collected"] == 4 and summary["unfinished"] == 0
    assert [p for p in summary["problems"] if "test_b.py::test_bad" in p and "boom" in p]
    assert len(summary["processes"]) == 2 and "2 passed, 1 failed" in done.stdout


def test_class_parametrized_and_inherited_tests_all_get_their_results(tmp_path: Path) -> None:
    root = folder(tmp_path, test_k=SHAPES, base_cases=BASE, test_c=SKIP)
    done, summary = run(root, tmp_path / "out")
    assert done.returncode == 0, done.stdout + done.stderr
    assert summary["counts"]["passed"] == 4 and summary["gpu_marked_passed"] == 4
    assert summary["problems"] == [] and summary["unfinished"] == 0


def test_folders_without_a_pytest_ini_outside_the_working_directory(tmp_path: Path) -> None:
    root = tmp_path / "plain"
    for sub in ("a", "b"):
        (root / sub).mkdir(parents=True)
        (root / sub / f"test_{sub}.py").write_text("import pytest\n\n" + PASS_TWO)
    done = run_module("scripts.gpu_tests", "--out", tmp_path / "out", "--marker", "gpu",
                      "--procs", "2", root, env=ONE_GPU)  # fmt: skip
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert done.returncode == 0, done.stdout + done.stderr
    assert summary["counts"]["passed"] == 4 and summary["unfinished"] == 0


def test_nothing_ran_is_not_a_pass(tmp_path: Path) -> None:
    done, summary = run(folder(tmp_path, test_c=SKIP), tmp_path / "out")
    assert done.returncode == 3 and "no test marked gpu passed" in done.stderr
    assert summary["counts"]["skipped"] == 1
    cpu_only = SKIP + "\n@pytest.mark.cpu\ndef test_cpu(): pass\n"
    done, summary = run(
        folder(tmp_path / "w", test_c=cpu_only), tmp_path / "o1", "--marker", "gpu or cpu"
    )
    assert done.returncode == 3 and summary["counts"]["passed"] == 1, done.stdout + done.stderr
    done, _ = run(folder(tmp_path / "x", test_d=UNMARKED), tmp_path / "o2")
    assert done.returncode == 3 and "no test matches" in done.stderr
    done, summary = run(folder(tmp_path / "y", test_a=PASS_TWO), tmp_path / "o3",
                        env={"CUDA_VISIBLE_DEVICES": ""})  # fmt: skip
    assert done.returncode == 3 and "no GPU visible" in done.stderr
    assert summary["nothing_ran"] == "no GPU visible"


def test_a_run_overwrites_what_an_earlier_run_left(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    earlier = {"ev": "result", "id": "test_b.py::test_bad", "outcome": "passed", "t": 1}
    (out / "progress-0.rank0.jsonl").write_text(json.dumps(earlier) + "\n")
    crash = "@pytest.mark.gpu\ndef test_bad():\n    os._exit(4)  # dies before its result\n"
    done, summary = run(folder(tmp_path, test_b=crash), out)
    assert done.returncode == 1 and summary["counts"]["passed"] == 0, done.stdout
    assert "process 0 exited 4 in test_b.py::test_bad" in summary["problems"]
    assert summary["unfinished"] == 1


def test_bad_usage_is_one_line_and_exit_2(tmp_path: Path) -> None:
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    root = folder(tmp_path, test_a=PASS_TWO)
    cases = (
        ["--out", tmp_path / "o", "--procs", "0", root],
        ["--out", tmp_path / "o", "--timeout", "nan", root],
        ["--out", tmp_path / "o", "no/such/path"],
        ["--out", a_file, root],
        ["--out", tmp_path / "o", "--marker", "gpu or", root],
    ) + ((["--out", "/proc/self", root],) if Path("/proc/self").is_dir() else ())  # unwritable
    for args in cases:
        done = run_module("scripts.gpu_tests", *args, env=ONE_GPU)
        assert done.returncode == 2, (args, done.stdout, done.stderr)
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr


@pytest.mark.full
@NEEDS_PROC
def test_a_process_past_its_time_is_killed_with_its_children(tmp_path: Path) -> None:
    slow = LEAVES_A_CHILD.replace("test_leaves_a_child", "test_slow") + "    time.sleep(60)\n"
    (tmp_path / "pids").mkdir()
    started = time.monotonic()
    done, summary = run(folder(tmp_path, test_a=PASS_TWO, test_s=slow), tmp_path / "out",
                        "--timeout", "8", env={"PIDS": str(tmp_path / "pids")})  # fmt: skip
    assert time.monotonic() - started < 45
    assert done.returncode == 1
    assert [
        p
        for p in summary["problems"]
        if p.endswith("killed at the time limit in test_s.py::test_slow")
    ]
    assert summary["unfinished"] == 1 and summary["counts"]["passed"] == 2
    (pid,) = (int(p.name) for p in (tmp_path / "pids").iterdir())
    time.sleep(0.5)
    assert not alive(pid)


@pytest.mark.full
@NEEDS_PROC
def test_what_a_passing_test_leaves_running_is_stopped(tmp_path: Path) -> None:
    (tmp_path / "pids").mkdir()
    done, _ = run(folder(tmp_path, test_l=LEAVES_A_CHILD), tmp_path / "out",
                  env={"PIDS": str(tmp_path / "pids")})  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    (pid,) = (int(p.name) for p in (tmp_path / "pids").iterdir())
    time.sleep(0.5)
    assert not alive(pid)


@pytest.mark.full
@NEEDS_PROC
@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_a_stopped_run_stops_its_pytest_processes(tmp_path: Path, stop: signal.Signals) -> None:
    slow = LEAVES_A_CHILD.replace("test_leaves_a_child", "test_slow") + "    time.sleep(60)\n"
    pids, out = tmp_path / "pids", tmp_path / "out"
    pids.mkdir()
    root = folder(tmp_path, test_s=slow)
    env = {**os.environ, **ONE_GPU, "PIDS": str(pids)}
    tool = subprocess.Popen([sys.executable, "-m", "scripts.gpu_tests", "--out", str(out),
                             "--marker", "gpu", str(root)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    deadline = time.monotonic() + 60
    while not any(pids.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.2)
    tool.send_signal(stop)
    _, err = tool.communicate(timeout=30)
    assert tool.returncode == 130 and err.strip().splitlines() == [
        "gpu_tests: interrupted; every pytest process was stopped"
    ]
    (pid,) = (int(p.name) for p in pids.iterdir())
    time.sleep(0.5)
    assert not alive(pid)


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
