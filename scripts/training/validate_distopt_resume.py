#!/usr/bin/env python3
"""Issue 12 as a user meets it: ``pretrain_gpt.py`` with the distributed optimizer saves, and a
fresh ``pretrain_gpt.py`` resumes, in every checkpoint format the tree offers (2 GPUs).

    python -m scripts.training.validate_distopt_resume TREE [--out DIR] [--nproc 2]
        [--formats torch_dist,torch_dist_fully_reshardable,torch,fsdp_dtensor]
        [--extra "FLAGS"] [--within REL]

Per format: run A trains 8 iterations of a small Llama (mock data, bf16, DP over --nproc GPUs,
``--use-distributed-optimizer``, upstream's ``--deterministic-mode`` with ``NCCL_ALGO=Ring``
and ``CUBLAS_WORKSPACE_CONFIG=:4096:8``) and saves every 4; its iteration-4 checkpoint is
staged alone in a second folder; run B, a fresh torchrun, loads it and trains iterations 5-8.
The verdict compares B's losses with A's as Megatron prints them (7 significant digits):
``bit-exact`` when equal, else the largest relative difference. From 0.16 a process's second
printed loss is the mean of its first two iterations (``training_log``), so B's iteration 6 is
compared with mean(A5, A6) to the printed digits (``judge``). ``fsdp_dtensor`` runs
Megatron-FSDP (``--use-megatron-fsdp``, optim_grads_params) with CUDA_DEVICE_MAX_CONNECTIONS
unset; formats a tree does not have are reported as skipped. ``--extra``: more
``pretrain_gpt.py`` flags for both runs (``"--fp8-format hybrid --fp8-param-gather"``);
``--within``: a resume whose losses are not the straight run's passes when each is within
this relative difference, for a run whose checkpoint does not hold all of its state. A lost
Adam step moves a loss by about 1e-3, so a bound near that cannot tell the two apart.

A torchrun that has not ended after ``--run-timeout`` seconds (240) is stopped, ranks
included, and the format fails as ``hung`` with the last line it printed.

Prints one JSON line per format and exits 1 when any format failed. Needs a patched tree with
``pretrain_gpt.py``, the tree's dependencies and psutil (Megatron's torch_dist writer); no
network. Takes ~30 s per run on an H100 pair.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from scripts.training.train_small import REPO_ROOT, last_exception, parse_log

ITERS, SAVE_AT = 8, 4
RUN_TIMEOUT = 240  # seconds per torchrun; --run-timeout
HUNG = 124
# A stopped torchrun gives its ranks 30 s between SIGTERM and SIGKILL; a little more here.
STOP_GRACE = 45
# What upstream's --deterministic-mode asks of the environment (NCCL_ALGO is required up to
# 0.16; from 0.19 megatron/training/determinism.py sets these same defaults itself).
DETERMINISTIC_ENV = {"NCCL_ALGO": "Ring", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
MODEL = [
    "--num-layers=2",
    "--hidden-size=256",
    "--ffn-hidden-size=688",
    "--num-attention-heads=8",
    "--group-query-attention",
    "--num-query-groups=2",
    "--seq-length=256",
    "--max-position-embeddings=256",
    "--micro-batch-size=2",
    "--normalization=RMSNorm",
    "--swiglu",
    "--position-embedding-type=rope",
    "--untie-embeddings-and-output-weights",
    "--disable-bias-linear",
    "--attention-dropout=0.0",
    "--hidden-dropout=0.0",
    "--bf16",
    "--lr=1e-3",
    "--min-lr=1e-4",
    "--lr-decay-style=cosine",
    "--lr-warmup-iters=2",
    "--weight-decay=0.1",
    "--clip-grad=1.0",
    "--mock-data",
    "--tokenizer-type=NullTokenizer",
    "--vocab-size=1023",
    "--split=949,50,1",
    "--eval-iters=1",
    "--eval-interval=1000000",
    "--log-interval=1",
    f"--train-iters={ITERS}",
    "--use-distributed-optimizer",
    "--deterministic-mode",
    "--seed=1234",
]
FORMATS = {
    # name: (extra pretrain_gpt flags, arguments.py text the tree must have, environment)
    "torch_dist": (["--ckpt-format=torch_dist"], "torch_dist", {}),
    "torch_dist_fully_reshardable": (
        ["--ckpt-format=torch_dist", "--dist-ckpt-optim-fully-reshardable"],
        "dist_ckpt_optim_fully_reshardable",
        {},
    ),
    "torch": (["--ckpt-format=torch"], "'torch'", {}),
    "fsdp_dtensor": (
        ["--ckpt-format=fsdp_dtensor", "--use-megatron-fsdp"],
        "fsdp_dtensor",
        {"CUDA_DEVICE_MAX_CONNECTIONS": None},
    ),
}


def has_text(tree: Path, text: str) -> bool:
    """Does the tree's argument parser (or its generated config, on main) know ``text``?"""
    places = [tree / "megatron/training/arguments.py", *tree.glob("megatron/training/config/*.py")]
    return any(text in p.read_text(errors="replace") for p in places if p.is_file())


def start(cmd: list[str], cwd: Path, env: dict[str, str], log: Path) -> subprocess.Popen:
    """Start ``cmd`` in a process group of its own, its output (both streams) to ``log``."""
    with log.open("w") as f:
        return subprocess.Popen(
            cmd, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )


def stop(proc: subprocess.Popen, grace: float = STOP_GRACE) -> None:
    """SIGTERM to ``proc``'s whole group (a wrapper such as train_small.py and the torchrun
    under it: torchrun passes it on to its ranks, which have sessions of their own), then
    SIGKILL to whatever of the group is left after ``grace`` seconds."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    end = time.monotonic() + grace
    while time.monotonic() < end:
        proc.poll()  # reap the leader: a zombie still counts as a member of the group
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.2)
    else:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def finish(
    proc: subprocess.Popen, log: Path, timeout: float, limit: float | None = None
) -> tuple[int, list[str]]:
    """Wait for a process from ``start``; one not ended after ``timeout`` more seconds is
    stopped and reported as ``HUNG`` with the last line it printed and ``limit`` (the time
    it was given since its start, default ``timeout``). Ctrl-C stops it too."""
    try:
        rc = proc.wait(timeout=max(timeout, 0))
    except subprocess.TimeoutExpired:  # a hung collective: stop the run, ranks included
        lines = log.read_text(errors="replace").splitlines()  # what it said before we did
        last = next((line.strip() for line in reversed(lines) if line.strip()), "")
        stop(proc)
        given = timeout if limit is None else limit
        return HUNG, [*lines, f"no end after {given:g} s; last line: {last[:200]}"]
    except BaseException:
        stop(proc)
        raise
    return rc, log.read_text(errors="replace").splitlines()


def run_logged(
    cmd: list[str], cwd: Path, env: dict[str, str], log: Path, timeout: float
) -> tuple[int, list[str]]:
    """Run ``cmd`` (output to ``log``) with a hang timeout; return (rc or HUNG, log lines)."""
    return finish(start(cmd, cwd, env, log), log, timeout)


def run(
    tree: Path, nproc: int, args: list[str], env_extra: dict, log: Path, timeout: int
) -> tuple[int, list]:
    env = dict(os.environ, **DETERMINISTIC_ENV)
    env.update(NCCL_NVLS_ENABLE="0", CUDA_DEVICE_MAX_CONNECTIONS="1", PYTHONUNBUFFERED="1")
    for key, value in env_extra.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    env["PYTHONPATH"] = os.pathsep.join(
        [str(tree), str(REPO_ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    )
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc-per-node={nproc}", "pretrain_gpt.py", *MODEL, *args]
    return run_logged(cmd, tree, env, log, timeout)


def failure_reason(rc: int, lines: list[str]) -> str | None:
    """A hung run's last words, else the run's last exception."""
    return f"hung: {lines[-1]}" if rc == HUNG and lines else last_exception(lines)


def losses(lines: list[str]) -> dict[int, float]:
    records, _ = parse_log(lines)
    return {r.iteration: r.loss for r in records if r.loss is not None}


def check_format(
    tree: Path,
    name: str,
    nproc: int,
    out: Path,
    timeout: int = RUN_TIMEOUT,
    extra: list[str] | None = None,
    within: float = 0.0,
) -> dict:
    flags, needs, env = FORMATS[name]
    flags = [*flags, *(extra or [])]
    result: dict = {"format": name, "tree": str(tree), "nproc": nproc}
    if not has_text(tree, needs):
        return {**result, "status": "skip", "detail": f"this tree has no {needs}"}
    first, staged = out / f"{name}-A", out / f"{name}-B"
    for d in (first, staged):
        shutil.rmtree(d, ignore_errors=True)
    rc, lines_a = run(
        tree,
        nproc,
        [*flags, f"--save={first}", f"--save-interval={SAVE_AT}"],
        env,
        out / f"{name}-A.log",
        timeout,
    )
    a = losses(lines_a)
    if rc or len(a) < ITERS:
        why = failure_reason(rc, lines_a) or f"exit {rc}, {len(a)} iterations logged"
        return {**result, "status": "fail", "detail": f"run A (train + save): {why}"}
    saved = first / f"iter_{SAVE_AT:07d}"
    staged.mkdir(parents=True)
    shutil.copytree(saved, staged / saved.name)
    (staged / "latest_checkpointed_iteration.txt").write_text(str(SAVE_AT))
    rc, lines_b = run(
        tree, nproc, [*flags, f"--load={staged}"], env, out / f"{name}-B.log", timeout
    )
    b = losses(lines_b)
    result["straight"] = [a[i] for i in range(SAVE_AT + 1, ITERS + 1)]
    result["resumed"] = [b.get(i) for i in range(SAVE_AT + 1, ITERS + 1)]
    if rc or None in result["resumed"] or min(b, default=0) != SAVE_AT + 1:
        why = failure_reason(rc, lines_b) or f"exit {rc}, iterations {sorted(b)}"
        return {**result, "status": "fail", "detail": f"run B (fresh process, load): {why}"}
    status, detail = judge(
        result["straight"], result["resumed"], averages_second_log(tree), within=within
    )
    return {**result, "status": status, "detail": detail}


def averages_second_log(tree: Path) -> bool:
    """From 0.16, training_log keeps its loss totals after a process's first iteration
    (``should_reset = not is_first_iteration``), so the second line a process prints is the
    mean of its first two iterations: after the resume, iteration 6 prints mean(5, 6)."""
    training = tree / "megatron/training/training.py"
    return training.is_file() and "should_reset = not is_first_iteration" in training.read_text()


def iteration_list(numbers: list[int]) -> str:
    """5, 7, 8 / 16, 18-30: runs of three or more as a range."""
    parts: list[str] = []
    i = 0
    while i < len(numbers):
        j = i
        while j + 1 < len(numbers) and numbers[j + 1] == numbers[j] + 1:
            j += 1
        if j - i >= 2:
            parts.append(f"{numbers[i]}-{numbers[j]}")
        else:
            parts.extend(str(n) for n in numbers[i : j + 1])
        i = j + 1
    return ", ".join(parts)


def judge(
    straight: list[float],
    resumed: list[float],
    averaged: bool,
    first: int = SAVE_AT + 1,
    within: float = 0.0,
) -> tuple[str, str]:
    """Run B's printed losses against what run A's losses make it print; ``first`` is the
    iteration of the first loss in both lists (the one after the checkpoint).

    Megatron prints 7 significant digits. Every line compares exactly, except, where the
    tree averages the second line (``averaged``), that one: it is compared with the mean of
    run A's two printed values, within one unit of the 7th digit (the rounding of the two
    inputs and of the print). A lost Adam step or moment moves that line by ~1e-3, far
    more than that. ``within`` (> 0): losses that differ pass when every one is within
    this relative difference of the expected one.
    """
    expected = list(straight)
    slack = [0.0] * len(expected)
    numbers = list(range(first, first + len(expected)))
    if averaged and len(expected) > 1:
        expected[1] = (straight[0] + straight[1]) / 2
        # a unit of the 7th digit, and a hair for decimal prints held in binary floats
        slack[1] = 10.0 ** (math.floor(math.log10(abs(expected[1]))) - 6) * (1 + 1e-6)
    off = [abs(x - y) - tol for x, y, tol in zip(resumed, expected, slack)]
    if max(off) <= 0:
        if not averaged or len(expected) < 2:
            return "pass", f"{_iterations(numbers)} bit-exact as printed"
        exact = [numbers[0], *numbers[2:]]
        return "pass", (
            f"{_iterations(exact)} bit-exact as printed; {first + 1} equals "
            f"mean({first}, {first + 1}) to the printed digits (training_log averages a "
            "process's first two iterations)"
        )
    worst = max(abs(x - y) / abs(y) for x, y in zip(resumed, expected))
    if 0 < within and worst <= within:
        return "pass", f"resumed losses within {within:g} (max rel {worst:.1e})"
    return "fail", f"resumed losses differ (max rel {worst:.1e})"


def _iterations(numbers: list[int]) -> str:
    return ("iterations " if len(numbers) > 1 else "iteration ") + iteration_list(numbers)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("tree", type=Path)
    p.add_argument("--out", type=Path, default=Path("distopt-resume"))
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--formats", default=",".join(FORMATS))
    p.add_argument("--run-timeout", type=int, default=RUN_TIMEOUT, help="seconds per torchrun")
    p.add_argument("--extra", default="", help="more pretrain_gpt.py flags for both runs")
    p.add_argument(
        "--within",
        type=float,
        default=0.0,
        help="pass resumed losses within this relative difference (default 0: as printed)",
    )
    opts = p.parse_args(argv)
    try:
        extra = shlex.split(opts.extra)
    except ValueError as exc:
        print(f"error: --extra {opts.extra[:80]!r}: {exc}", file=sys.stderr)
        return 2
    if not 0 <= opts.within < 1:
        print(f"error: --within {opts.within:g}: expected 0 <= REL < 1", file=sys.stderr)
        return 2
    tree = opts.tree.resolve()
    if not (tree / "pretrain_gpt.py").is_file():
        print(f"error: {tree} has no pretrain_gpt.py", file=sys.stderr)
        return 2
    unknown = sorted(set(opts.formats.split(",")) - set(FORMATS))
    if unknown:
        print(f"error: unknown formats {unknown}; choose from {sorted(FORMATS)}", file=sys.stderr)
        return 2
    opts.out.mkdir(parents=True, exist_ok=True)
    failed = False
    for name in opts.formats.split(","):
        verdict = check_format(
            tree, name, opts.nproc, opts.out.resolve(), opts.run_timeout, extra,
            opts.within,
        )  # fmt: skip
        failed |= verdict["status"] == "fail"
        print(json.dumps(verdict), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
