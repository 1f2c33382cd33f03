"""scripts/validate_distopt_resume.py's verdict: run B's printed losses against run A's, with
upstream's first-iteration logging rule (from 0.16 the second line a process prints is the
mean of its first two iterations). Numbers are of the shape Megatron prints (7 digits)."""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
STRAIGHT = [5.716166, 5.302709, 5.309906, 4.979735]


@pytest.fixture(scope="module")
def vd():
    sys.path.insert(0, str(SCRIPTS))  # the script imports train_small from its folder
    spec = importlib.util.spec_from_file_location(
        "validate_distopt_resume", SCRIPTS / "validate_distopt_resume.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_identical_prints_are_bit_exact(vd) -> None:
    assert vd.judge(STRAIGHT, list(STRAIGHT), averaged=False) == (
        "pass",
        "iterations 5-8 bit-exact as printed",
    )


def test_the_averaged_second_line_passes_within_the_printed_digits(vd) -> None:
    # mean(5.716166, 5.302709) = 5.5094375, printed with 7 digits
    resumed = [5.716166, 5.509438, 5.309906, 4.979735]
    status, detail = vd.judge(STRAIGHT, resumed, averaged=True)
    assert status == "pass" and "mean(5, 6)" in detail
    # the same prints judged without the rule: a real difference
    assert vd.judge(STRAIGHT, resumed, averaged=False)[0] == "fail"


@pytest.mark.parametrize("position", range(4))
def test_a_lost_optimizer_state_is_caught_at_every_position(vd, position: int) -> None:
    """A lost Adam step count moves a loss by ~1e-3 relative, the size perturbed here."""
    resumed = [5.716166, 5.509438, 5.309906, 4.979735]
    resumed[position] *= 1.001
    status, detail = vd.judge(STRAIGHT, resumed, averaged=True)
    assert status == "fail" and "max rel" in detail


def test_the_rule_is_read_from_the_tree(vd, tmp_path: Path) -> None:
    training = tmp_path / "megatron/training/training.py"
    training.parent.mkdir(parents=True)
    training.write_text("def training_log():\n    should_reset = True\n")
    assert not vd.averages_second_log(tmp_path)
    training.write_text("def training_log():\n    should_reset = not is_first_iteration\n")
    assert vd.averages_second_log(tmp_path)


@pytest.mark.torch
def test_a_hung_run_is_stopped_and_reported_with_its_last_line(vd, tmp_path: Path) -> None:
    """A rank stuck in a collective must not hang the validation: torchrun and its ranks
    are killed after the timeout and the verdict names the last line printed."""
    pytest.importorskip("torch")
    (tmp_path / "pretrain_gpt.py").write_text(
        "import os, time\n"
        "open('rank.pid', 'w').write(str(os.getpid()))\n"
        "print('saving checkpoint at iteration 4', flush=True)\n"
        "time.sleep(600)\n"
    )
    rc, lines = vd.run(tmp_path, 1, [], {}, tmp_path / "run.log", timeout=15)
    assert rc == vd.HUNG
    assert vd._why(rc, lines) == (
        "hung: no end after 15 s; last line: saving checkpoint at iteration 4"
    )
    rank = int((tmp_path / "rank.pid").read_text())
    for _ in range(50):  # the rank is gone too, not left sleeping
        try:
            os.kill(rank, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"rank process {rank} outlived the timeout")
