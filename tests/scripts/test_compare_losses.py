"""scripts/compare_losses.py on logs written here in Megatron's format: which iterations are
compared, the two spans, and the one-line refusals."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts/compare_losses.py"


def write_log(path: Path, losses: dict[int, str]) -> Path:
    lines = ["some start-up line"]
    for i, loss in losses.items():
        lines.append(
            f" [2026-11-26 01:00:00] iteration {i:>8}/      30 | consumed samples: {8 * i} | "
            f"elapsed time per iteration (ms): 900.0 | lm loss: {loss} | loss scale: 1.0 |"
        )
    path.write_text("\n".join(lines) + "\n")
    return path


def run(*args: Path | str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True
    )


def test_the_early_span_and_the_whole_run_are_reported_apart(tmp_path: Path) -> None:
    ref = write_log(tmp_path / "a.log", {1: "10.0", 2: "9.0", 3: "8.0", 4: "4.0"})
    # iteration 4 drifts by 25%; the first two agree to 1e-4; 5 is only in one log
    other = write_log(tmp_path / "b.log", {1: "10.001", 2: "9.0", 3: "8.0", 4: "5.0", 5: "1.0"})
    done = run(ref, other, "--first", "2")
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    assert got["iterations"] == 4 and got["first"] == 2
    assert got["max_rel_diff_first"] == pytest.approx(1e-4)
    assert got["max_rel_diff_all"] == pytest.approx(0.25)
    assert got["reference_losses"] == [10.0, 9.0] and got["other_losses"] == [10.001, 9.0]


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
