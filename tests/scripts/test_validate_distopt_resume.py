"""scripts/training/validate_distopt_resume.py's verdict: run B's printed losses against run A's, with
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
    return importlib.import_module("scripts.training.validate_distopt_resume")


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


def test_a_whole_unit_off_in_the_averaged_line_passes(vd) -> None:
    """Printed 5.524282 where the mean of the two printed losses is 5.524281 (a GPU run's
    losses): one unit of the 7th digit, whose float difference is a hair above 1e-6."""
    straight = [5.723296, 5.325266, 5.31009, 4.971187]
    resumed = [5.723296, 5.524282, 5.31009, 4.971187]
    assert vd.judge(straight, resumed, averaged=True)[0] == "pass"
    resumed[1] = 5.524283  # two units: more than the roundings make
    assert vd.judge(straight, resumed, averaged=True)[0] == "fail"


@pytest.mark.parametrize("position", range(4))
def test_a_lost_optimizer_state_is_caught_at_every_position(vd, position: int) -> None:
    """A lost Adam step count moves a loss by ~1e-3 relative, the size perturbed here."""
    resumed = [5.716166, 5.509438, 5.309906, 4.979735]
    resumed[position] *= 1.001
    status, detail = vd.judge(STRAIGHT, resumed, averaged=True)
    assert status == "fail" and "max rel" in detail


def test_within_passes_close_losses_and_still_fails_far_ones(vd) -> None:
    """``--within`` (a checkpoint without all of a run's state, as FP8 parameters saved
    dequantized): differing losses pass inside the bound, fail outside it, and say which."""
    resumed = [x * (1 + 0.004 * (-1) ** i) for i, x in enumerate(STRAIGHT)]
    assert vd.judge(STRAIGHT, resumed, averaged=False)[0] == "fail"
    assert vd.judge(STRAIGHT, resumed, averaged=False, within=0.01) == (
        "pass",
        "resumed losses within 0.01 (max rel 4.0e-03)",
    )
    assert vd.judge(STRAIGHT, resumed, averaged=False, within=0.001) == (
        "fail",
        "resumed losses differ (max rel 4.0e-03)",
    )
    # identical prints still say so
    assert vd.judge(STRAIGHT, list(STRAIGHT), averaged=False, within=0.01)[1].endswith("as printed")


@pytest.mark.parametrize("value", ["-0.1", "1", "2.5", "nan"])
def test_a_within_outside_zero_to_one_is_a_usage_error(vd, capsys, tmp_path, value) -> None:
    (tmp_path / "pretrain_gpt.py").write_text("")
    assert vd.main([str(tmp_path), "--within", value]) == 2
    assert capsys.readouterr().err.strip() == f"error: --within {value}: expected 0 <= REL < 1"


def test_extra_and_within_reach_every_format_as_given(vd, monkeypatch, tmp_path) -> None:
    (tmp_path / "pretrain_gpt.py").write_text("")
    seen = []

    def check(tree, name, nproc, out, timeout, extra, within):  # noqa: ANN001, ANN202
        seen.append((name, extra, within))
        return {"format": name, "status": "pass"}

    monkeypatch.setattr(vd, "check_format", check)
    argv = [str(tmp_path), "--formats", "torch,torch_dist", "--within", "0.002",
            "--extra", "--fp8-format hybrid --data-path '/data/my corpus'"]  # fmt: skip
    assert vd.main([*argv, "--out", str(tmp_path / "out")]) == 0
    flags = ["--fp8-format", "hybrid", "--data-path", "/data/my corpus"]
    assert seen == [("torch", flags, 0.002), ("torch_dist", flags, 0.002)]


def test_an_unbalanced_extra_is_a_usage_error(vd, capsys, tmp_path) -> None:
    (tmp_path / "pretrain_gpt.py").write_text("")
    assert vd.main([str(tmp_path), "--extra", "--fp8-format 'hybrid"]) == 2
    assert capsys.readouterr().err.strip() == (
        'error: --extra "--fp8-format \'hybrid": No closing quotation'
    )


def test_the_rule_is_read_from_the_tree(vd, tmp_path: Path) -> None:
    training = tmp_path / "megatron/training/training.py"
    training.parent.mkdir(parents=True)
    training.write_text("def training_log():\n    should_reset = True\n")
    assert not vd.averages_second_log(tmp_path)
    training.write_text("def training_log():\n    should_reset = not is_first_iteration\n")
    assert vd.averages_second_log(tmp_path)


@pytest.mark.full  # waits out the hang it stops (~18 s)
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
    assert vd.failure_reason(rc, lines) == (
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


def test_the_verdict_names_the_iterations_it_compared(vd) -> None:
    """validate_par4.py resumes at 15 of 30: the same rule, other iteration numbers."""
    straight = [5.0 - 0.01 * i for i in range(15)]
    resumed = [straight[0], (straight[0] + straight[1]) / 2, *straight[2:]]
    assert vd.judge(straight, list(straight), averaged=False, first=16) == (
        "pass",
        "iterations 16-30 bit-exact as printed",
    )
    status, detail = vd.judge(straight, resumed, averaged=True, first=16)
    assert status == "pass"
    assert detail.startswith("iterations 16, 18-30 bit-exact as printed; 17 equals mean(16, 17)")
    assert vd.judge(straight[:1], straight[:1], averaged=True, first=16) == (
        "pass",
        "iteration 16 bit-exact as printed",
    )


@pytest.mark.full  # starts and stops a process group (~5 s)
def test_a_stopped_wrapper_takes_its_children_along(vd, tmp_path: Path) -> None:
    """train_small.py runs torchrun as a child: a hang stops the whole process group, not
    only the wrapper (which would leave torchrun and its ranks running)."""
    wrapper = tmp_path / "wrapper.py"
    wrapper.write_text(
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        "open('child.pid', 'w').write(str(child.pid))\n"
        "print('started', flush=True)\n"
        "time.sleep(600)\n"
    )
    cmd = [sys.executable, str(wrapper)]
    rc, lines = vd.run_logged(cmd, tmp_path, dict(os.environ), tmp_path / "w.log", timeout=3)
    assert rc == vd.HUNG and vd.failure_reason(rc, lines).endswith("last line: started")
    child = int((tmp_path / "child.pid").read_text())
    for _ in range(50):
        if gone(child):
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"child {child} of the stopped wrapper is still running")


def gone(pid: int) -> bool:
    """Ended: no such process, or a zombie waiting for a reaper that is not ours."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True
