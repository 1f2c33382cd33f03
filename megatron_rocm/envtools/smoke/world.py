"""Start a world of training ranks (``_train_worker``) for a list of jobs and collect verdicts.

One process per GPU with a torchrun-like environment (``MASTER_ADDR=127.0.0.1``, a free port,
``NCCL_NVLS_ENABLE=0``: NVLink multicast is off on the lent machines and absent on AMD). All
jobs of a call share one world, so Python, torch and Megatron start once. A job that fails
stops its world; the jobs after it run in a fresh one, so one broken mode cannot take the
others down with it. A rank that dies or hangs fails the job it was running, with its output.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_rocm.envtools.smoke.engine import Job

PACKAGE_ROOT = Path(__file__).resolve().parents[3]  # the folder holding megatron_rocm/
GRACE_S = 20.0  # once one rank has exited, how long the others may take to follow
RENDEZVOUS_TRIES = 3  # worlds started afresh when rank 0 finds its port taken
# upstream's --deterministic-mode environment (megatron/training/determinism.py)
DETERMINISM_ENV = {
    "NCCL_ALGO": "Ring",
    "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
    "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0",
}


@dataclass
class JobResult:
    name: str
    ok: bool
    losses: list[float] | None = None
    error: str = ""
    seconds: float = 0.0
    detail: dict[str, Any] = field(default_factory=dict)


def free_port() -> int:
    """A free TCP port on the loopback, for a world's rendezvous."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, world: int, port: int, extra: dict[str, str | None]) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        NCCL_NVLS_ENABLE="0",
    )
    for key, value in extra.items():  # None removes the variable
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PACKAGE_ROOT), env.get("PYTHONPATH")) if p)
    return env


def tail(log: Path, lines: int = 4) -> str:
    """The last useful lines of a rank's log, on one line."""
    try:
        text = log.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "no output"
    useful = [t for t in text if t.strip() and not t.startswith(("  warnings.warn", "W1", "I1"))]
    return " | ".join(useful[-lines:]) or "no output"


def port_was_taken(output: str) -> bool:
    """Rank 0's store could not listen on its port: ``free_port`` finds a port free, it cannot
    reserve it, and another process (a concurrent smoke run, NCCL's own sockets) bound it
    before the store did. torch's store says so in one error, with either of its socket
    layers; a mere bind warning on one address family is not it."""
    text = output.lower()
    return "failed to listen on any local network address" in text and (
        "eaddrinuse" in text or "address already in use" in text
    )


def start_world(
    cmd: list[str],
    world: int,
    extra_env: dict[str, str | None],
    logs: list[Path],
    timeout: float,
    results: Sequence[Path] = (),
) -> bool:
    """Run ``cmd`` as ranks 0..world-1 on a free port, each writing to its log, until all exit.

    Once one rank has exited the others get ``GRACE_S`` to follow (a rank whose peer died
    waits on it forever), then they are killed, as all are at ``timeout``. When rank 0 failed
    because its port was taken, the world starts again on a new port, up to
    ``RENDEZVOUS_TRIES`` times; ``results`` (the ranks' result files) are removed before each
    start, so no attempt is judged by an earlier one's files. True when it timed out.
    """
    for attempt in range(1, RENDEZVOUS_TRIES + 1):
        for path in results:
            path.unlink(missing_ok=True)
        port, procs = free_port(), []
        try:
            for r, path in enumerate(logs):
                with path.open("w") as log:
                    env = rank_env(r, world, port, extra_env)
                    procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=log))
            timed_out = _wait_for_ranks(procs, time.monotonic() + timeout)
        finally:  # an interrupt, or a rank that could not start, leaves no rank behind
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
        retry = procs[0].returncode != 0 and port_was_taken(logs[0].read_text(errors="replace"))
        if not (retry and attempt < RENDEZVOUS_TRIES):
            return timed_out
    return timed_out


def _wait_for_ranks(procs: list[subprocess.Popen], deadline: float) -> bool:
    first_exit, timed_out = None, False
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        if first_exit is None and any(p.poll() is not None for p in procs):
            first_exit = now
        if now > deadline or (first_exit is not None and now - first_exit > GRACE_S):
            timed_out = now > deadline
            break
        time.sleep(0.2)
    return timed_out


def _one_world(
    world: int, jobs: list[Job], tree: Path | None, backend: str, env: dict, timeout: float
) -> list[JobResult]:
    """Run ``jobs`` in one world until they are done or one fails; results in job order."""
    with tempfile.TemporaryDirectory(prefix="megatron-rocm-smoke-") as tmp:
        jobs_file = Path(tmp, "jobs.json")
        jobs_file.write_text(json.dumps([j.to_dict() for j in jobs]))
        cmd = [sys.executable, "-m", "megatron_rocm.envtools.smoke._train_worker"]
        cmd += ["--jobs", str(jobs_file), "--out", tmp, "--backend", backend]
        cmd += ["--tree", str(tree)] if tree else []
        logs = [Path(tmp, f"rank{r}.log") for r in range(world)]
        outputs = [Path(tmp, f"rank{r}.json") for r in range(world)]
        timed_out = start_world(cmd, world, env, logs, timeout, outputs)
        per_rank = [json.loads(f.read_text()) if f.is_file() else [] for f in outputs]
        return _merge(jobs, per_rank, [tail(log) for log in logs], timed_out, timeout)


def _merge(
    jobs: list[Job], per_rank: list[list[dict]], tails: list[str], timed_out: bool, timeout: float
) -> list[JobResult]:
    """Combine the ranks' verdicts job by job; stop at the first job not every rank finished."""
    results = []
    for i, job in enumerate(jobs):
        entries = [rank[i] if i < len(rank) else None for rank in per_rank]
        if all(e is not None for e in entries):
            bad = [(r, e) for r, e in enumerate(entries) if not e["ok"]]
            losses = next((e["losses"] for e in entries if e.get("losses")), None)
            detail = next((e.get("detail", {}) for e in entries if e.get("losses")), {})
            seconds = max(e.get("seconds", 0.0) for e in entries)
            if bad:
                r, e = bad[0]
                results.append(
                    JobResult(job.name, False, losses, f"rank {r}: {e['error']}", seconds)
                )
                return results
            results.append(JobResult(job.name, True, losses, "", seconds, detail))
            continue
        errors = [f"rank {r}: {e['error']}" for r, e in enumerate(entries) if e and not e["ok"]]
        if not errors:
            missing = [r for r, e in enumerate(entries) if e is None]
            why = f"timed out after {timeout:.0f}s" if timed_out else "died"
            errors = [f"rank {r} {why} during this job: {tails[r]}" for r in missing[:1]]
        results.append(JobResult(job.name, False, None, "; ".join(errors)))
        return results
    return results


def run_jobs(
    world: int,
    jobs: list[Job],
    tree: Path | None,
    *,
    backend: str = "nccl",
    env: dict[str, str | None] | None = None,
    timeout: float = 120.0,
) -> dict[str, JobResult]:
    """Every job's result; after a failure the remaining jobs get a fresh world. A world may
    take ``timeout`` seconds plus 30 s per job before its ranks are killed."""
    results: dict[str, JobResult] = {}
    todo = list(jobs)
    while todo:  # _one_world always reports at least the job it stopped at
        done = _one_world(world, todo, tree, backend, env or {}, timeout + 30.0 * len(todo))
        for r in done:
            results[r.name] = r
        todo = todo[len(done) :]
    return results
