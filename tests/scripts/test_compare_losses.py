"""scripts/training/compare_losses.py on logs written here in Megatron's format: which iterations are
compared, the two spans, and the one-line refusals."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import megatron_log
import pytest
from megatron_log import iteration_line
from script_run import run_module


def write_log(path: Path, losses: dict[int, str]) -> Path:
    lines = (iteration_line(i, 30, loss, ms=900.0, batch=8) for i, loss in losses.items())
    return megatron_log.write_log(path, lines)


def run(*args: Path | str) -> subprocess.CompletedProcess:
    return run_module("scripts.training.compare_losses", *args)


def test_the_early_span_and_the_whole_run_are_reported_apart(tmp_path: Path) -> None:
    ref = write_log(tmp_path / "a.log", {1: "10.0", 2: "9.0", 3: "8.0", 4: "4.0"})
    # iteration 4 drifts by 25%; the first two agree to 1e-4; 5 is only in one log
    other = write_log(tmp_path / "b.log", {1: "10.001", 2: "9.0", 3: "8.0", 4: "5.0", 5: "1.0"})
    done = run(ref, other, "--first", "2")
    assert done.returncode == 1, done.stderr  # iteration 5 is in one log only
    got = json.loads(done.stdout)
    assert got["iterations"] == 4 and got["first"] == 2
    assert got["only_in_reference"] == [] and got["only_in_other"] == [5]
    assert got["max_rel_diff_first"] == pytest.approx(1e-4)
    assert got["max_rel_diff_all"] == pytest.approx(0.25)
    assert got["reference_losses"] == [10.0, 9.0] and got["other_losses"] == [10.001, 9.0]


def test_where_the_runs_end_is_compared_on_means_of_the_last_span(tmp_path: Path) -> None:
    # the last two: 4 and 6 against 5 and 5, means equal although each iteration differs by 25%
    ref = write_log(tmp_path / "a.log", {1: "10.0", 2: "8.0", 3: "4.0", 4: "6.0"})
    other = write_log(tmp_path / "b.log", {1: "10.0", 2: "9.0", 3: "5.0", 4: "5.0"})
    got = json.loads(run(ref, other, "--last", "2").stdout)
    assert got["last"] == 2 and got["last_iterations"] == [3, 4]
    assert got["reference_last_mean"] == 5.0 and got["other_last_mean"] == 5.0
    assert got["rel_diff_last_mean"] == 0.0
    # over the last three, 6.0 against 6.333...: 5.6%
    got = json.loads(run(ref, other, "--last", "3").stdout)
    assert got["rel_diff_last_mean"] == pytest.approx(1 / 18, abs=1e-6)


@pytest.mark.parametrize("second", ["missing", "empty", "disjoint"])
def test_logs_without_shared_losses_are_refused_in_one_line(tmp_path: Path, second: str) -> None:
    ref = write_log(tmp_path / "a.log", {1: "10.0", 2: "9.0"})
    other = tmp_path / "b.log"
    if second == "empty":
        write_log(other, {})
    elif second == "disjoint":
        write_log(other, {7: "1.0"})
    done = run(ref, other)
    assert done.returncode == 2 and done.stdout == ""
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr


def test_a_run_that_stopped_early_is_not_a_match(tmp_path: Path) -> None:
    ref = write_log(tmp_path / "a.log", {i: str(10.0 - i) for i in range(1, 21)})
    short = write_log(tmp_path / "b.log", {i: str(10.0 - i) for i in range(1, 4)})
    done = run(ref, short)
    assert done.returncode == 1
    got = json.loads(done.stdout)
    assert got["max_rel_diff_all"] == 0.0 and got["only_in_reference"] == list(range(4, 21))


def test_non_finite_losses_are_an_infinite_difference_in_strict_json(tmp_path: Path) -> None:
    ref = write_log(tmp_path / "a.log", {1: "1.000000E+01", 2: "9.000000E+00"})
    other = write_log(tmp_path / "b.log", {1: "1.000000E+01", 2: "NAN"})  # Megatron's {:.6E}
    done = run(ref, other)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout, parse_constant=lambda c: pytest.fail(f"not strict JSON: {c}"))
    assert got["max_rel_diff_all"] == "inf" and got["other_losses"] == [10.0, "nan"]


def test_an_empty_early_span_is_refused_in_one_line(tmp_path: Path) -> None:
    ref = write_log(tmp_path / "a.log", {1: "10.0"})
    done = run(ref, ref, "--first", "0")
    assert done.returncode == 2 and "must be at least 1" in done.stderr
    assert "Traceback" not in done.stderr
