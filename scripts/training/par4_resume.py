"""validate_par4.py's resume checks: staging run A's checkpoint for run B, and the verdicts on
each run's exit status and printed losses (run B's against run A's, by
validate_distopt_resume.judge)."""

from __future__ import annotations

import shutil
from pathlib import Path

from scripts.training.par4_report import summary_line
from scripts.training.validate_distopt_resume import failure_reason, judge, losses


def stage(out: Path, name: str, save_at: int) -> str | None:
    """Copy run A's checkpoint of ``save_at`` alone into B's folder; the reason if it can't."""
    saved = out / f"{name}-ckpt-A" / f"iter_{save_at:07d}"
    staged = out / f"{name}-ckpt-B"
    if not saved.is_dir():
        return f"no checkpoint {saved}"
    shutil.rmtree(staged, ignore_errors=True)
    staged.mkdir(parents=True)
    shutil.copytree(saved, staged / saved.name)
    (staged / "latest_checkpointed_iteration.txt").write_text(str(save_at))
    return None


def run_problem(rc: int, lines: list[str], resumed: bool = False) -> str | None:
    """Why a train_small.py run of a resume check failed, or None. Any non-zero exit fails
    it (a rank that crashed or a watchdog that fired after the last loss line too), except,
    for the resumed run (``resumed``), train_small's own verdict that its loss did not fall:
    half a run may not, and what that run must do is match run A, which the verdict checks."""
    if rc == 0:
        return None
    problems = (summary_line(lines) or {}).get("problems", [])
    if resumed and problems and all(p.startswith("loss did not decrease") for p in problems):
        return None
    return failure_reason(rc, lines) or (problems or [f"train_small.py exited {rc}"])[0]


def compare_resumed(
    straight: dict[int, float], rc: int, lines: list[str], save_at: int, averaged: bool
) -> dict:
    """Run B's verdict from its exit status and output, against run A's losses."""
    span = range(save_at + 1, max(straight) + 1)
    resumed = losses(lines)
    result: dict = {
        "straight": [straight[i] for i in span],
        "resumed": [resumed.get(i) for i in span],
    }
    why = run_problem(rc, lines, resumed=True)
    if why or None in result["resumed"] or min(resumed, default=0) != save_at + 1:
        why = why or f"exit {rc}, iterations {sorted(resumed)}"
        return {**result, "status": "fail", "detail": f"run B (fresh process, load): {why}"}
    status, detail = judge(result["straight"], result["resumed"], averaged, first=save_at + 1)
    return {**result, "status": status, "detail": detail}
