"""scripts/training/example_summary.py on logs written here in Megatron's format: the warm-up left
out, medians (not means) reported, memory and failures read, and the exit codes."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Sequence
from pathlib import Path

import megatron_log
from megatron_log import iteration_line
from script_run import run_module


def write_log(path: Path, steps: list[tuple[float, float]], extra: Sequence[str] = ()) -> Path:
    """A log with one iteration line per (ms, TFLOP/s), losses falling from 10."""
    lines = [
        iteration_line(i, 16, 10 - i / 10, ms=ms, tflops=tflops, nan=0)
        for i, (ms, tflops) in enumerate(steps, 1)
    ]
    return megatron_log.write_log(path, lines, ["some start-up line", *extra])


def run(*args: Path | str) -> subprocess.CompletedProcess:
    return run_module("scripts.training.example_summary", *args)


def test_the_warm_up_is_left_out_and_the_median_reported(tmp_path: Path) -> None:
    # three slow warm-up steps, then 6000, 6100, 5900 and one 9000 outlier: median 6050
    steps = [(14857.1, 227.0), (10451.7, 322.7), (8000.0, 400.0)]
    steps += [(6000.0, 562.0), (6100.0, 553.0), (5900.0, 571.0), (9000.0, 375.0)]
    memory = [
        "[Rank 0] (after 1 iterations) memory (MB) | allocated: 1.0 | max reserved: 96766.00",
        "[Rank 0] (after 2 iterations) memory (MB) | allocated: 1.0 | max reserved: 127436.00",
    ]
    done = run(write_log(tmp_path / "a.log", steps, memory), "--peak-tflops", "1000")
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    assert got["iterations"] == 7 and got["timed"] == 4
    assert got["median_iter_ms"] == 6050.0
    assert got["mean_iter_ms"] == 6750.0
    assert got["megatron_tflops_per_gpu"] == 557.5  # the median of the timed steps' figures
    assert got["mfu"] == 0.5575
    assert got["max_reserved_mib"] == 127436.0
    assert got["first_loss"] == 9.9 and got["last_loss"] == 9.3
    assert got["exception"] is None and got["problems"] == [] and got["ok"] is True


def test_a_run_that_stopped_before_a_timed_step_exits_1_saying_why(tmp_path: Path) -> None:
    crash = ["torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"]
    done = run(write_log(tmp_path / "a.log", [(14857.1, 227.0)], crash))
    assert done.returncode == 1
    got = json.loads(done.stdout)
    assert got["ok"] is False and got["timed"] == 0 and "median_iter_ms" not in got
    assert got["problems"] == ["no timed iteration (after the first 3)"]
    assert got["exception"].startswith("torch.OutOfMemoryError: CUDA out of memory")


def test_a_missing_log_is_one_line_and_exit_2(tmp_path: Path) -> None:
    done = run(tmp_path / "nope.log")
    assert done.returncode == 2
    assert done.stdout == "" and len(done.stderr.strip().splitlines()) == 1


def test_a_run_whose_loss_went_nan_is_not_ok(tmp_path: Path) -> None:
    """An FP8 run that diverged must not be recorded as a speed-up: Megatron prints no loss
    for a NaN iteration and counts it."""
    log = write_log(tmp_path / "a.log", [(6000.0, 560.0)] * 5)
    text = log.read_text().splitlines()
    text[-1] = (
        text[-1]
        .replace("lm loss: 9.500000E+00 | ", "")
        .replace("number of nan iterations:   0", "number of nan iterations:   1")
    )
    log.write_text("\n".join(text) + "\n")
    done = run(log)
    assert done.returncode == 1
    got = json.loads(done.stdout)
    assert got["problems"] == ["loss is not finite"] and got["median_iter_ms"] == 6000.0
