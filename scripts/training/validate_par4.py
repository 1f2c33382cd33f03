#!/usr/bin/env python3
"""Issue 14 on four GPUs: upstream's ``pretrain_gpt.py`` trains a Llama in four parallel
layouts through the TE spec (the native backend), two of them save and resume, and each is
set against the same model on one GPU.

    python -m scripts.training.validate_par4 TREE [--out DIR] [--runs tp2pp2vpp,tp2cp2,ep4moe,dp4distopt]
        [--preset-size small|0.85b] [--iters 30] [--no-resume] [--no-baselines]
        [--run-timeout S] [--dry-run] [--table FILE]

Every run is ``scripts/training/train_small.py TREE --preset llama --preset-size SIZE`` (mock data,
bf16, upstream's fusions, no ``--transformer-impl``) with the layout's options; the flags after
its ``--`` go to pretrain_gpt.py. ``small`` (the default: 12 layers, hidden 768) is host-bound
at these micro-batches, so its table says whether the layouts train, resume and match, not how
they scale; ``0.85b`` (24 layers, hidden 1536) gives every rank micro-batches of 16k tokens
(8 x 2048, or 1 x 16384 under CP): TP2 x PP2 micro 8 and global 64, TP2 x CP2 as below, EP4
and DP4 micro 8 per rank, and experts of a quarter of the dense FFN (``par4_layouts``), so
that the one-GPU baselines fit one 80 GB GPU. The small layouts (all on 4 GPUs):

- ``tp2pp2vpp``: TP2 + SP x PP2, 2 virtual stages per pipeline rank (3 layers each), micro 1,
  global 8 (8 micro-batches for the interleaved schedule).
- ``tp2cp2``: TP2 + SP x CP2 at sequence length 16384, micro 1, global 8.
- ``ep4moe``: 8 experts over EP4 (``--moe-grouped-gemm``, alltoall dispatcher, top-2, aux loss
  1e-2 as upstream's Mixtral example), the dense part DP4, the preset's micro 8 x 4 ranks.
- ``dp4distopt``: DP4, ``--use-distributed-optimizer --overlap-grad-reduce
  --overlap-param-gather``, micro 8 x 4 ranks.

Baselines: the same model, sequence length, micro-batch and global batch per data-parallel
replica on one GPU (``ep4moe``'s: the same 8 experts, EP1, grouped GEMM), all at once, one per
GPU (``CUDA_VISIBLE_DEVICES``; torchrun ``--standalone`` takes a free port per run). Then the
4-GPU runs, one after another. ``--runs`` picks layouts (and their baselines).

Resume (``tp2pp2vpp`` and ``dp4distopt``, unless ``--no-resume``): run A trains ``--iters``
iterations in upstream's ``--deterministic-mode`` and saves at ``iters // 2``; that checkpoint
is staged alone; run B, a fresh train_small.py, loads it and trains on. B's printed losses are
judged against A's by validate_distopt_resume.judge. What validate_args asks of deterministic
mode: up to 0.16 ``NCCL_ALGO`` set (Ring here, with ``CUBLAS_WORKSPACE_CONFIG=:4096:8``, the
values 0.19's determinism.py defaults to), no ``--use-flash-attn`` and no
``--cross-entropy-loss-fusion``; from 0.19 also no ``--tp-comm-overlap``. All are off by
default, so the layouts need no other flag. The timed runs are not deterministic.

Stdout: one JSON line per run and per resume verdict, then one with the result and the table's
path. The Markdown scaling table (tokens/s per GPU at the median iteration after the first 3,
against the one-GPU baseline; ``par4_report.py``) goes to ``--table`` (default
OUT/par4-table.md), names the GPU and is rewritten after every run, so a call stopped from
outside still leaves the rows that finished. A run not ended after ``--run-timeout`` seconds
is stopped, its ranks too. Exit status: 0 every run and verdict passed, 1 any failed, 2 bad
input. Progress goes to stderr, each run's output to OUT/NAME.out.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from scripts.training.par4_layouts import DETERMINISTIC, NPROC, SIZES, Layout, baseline, layouts
from scripts.training.par4_report import gpu_names, record, render_table
from scripts.training.par4_resume import compare_resumed, run_problem, stage
from scripts.training.train_small import REPO_ROOT
from scripts.training.validate_distopt_resume import (
    DETERMINISTIC_ENV,
    averages_second_log,
    finish,
    has_text,
    losses,
    start,
    stop,
)

TRAIN_SMALL = ["-m", "scripts.training.train_small"]  # the command after python, from REPO_ROOT
RUN_TIMEOUT = 600  # seconds per train_small.py run; --run-timeout


def tree_flags(tree: Path) -> list[str]:
    """Flags every run gets where the tree has them: no [b, 1, s, s] mask from the mock
    dataloader (the TE spec's attention is causal without one; 256 MiB a sample at 16k)."""
    flag = "--no-create-attention-mask-in-dataloader"
    return [flag] if has_text(tree, f"'{flag}'") else []


def train_command(tree: Path, layout: Layout, iters: int, log: Path, extra: list[str]) -> list[str]:
    preset = ["--preset", "llama", "--preset-size", layout.size]
    cmd = [sys.executable, *TRAIN_SMALL, str(tree), *preset, "--iters", str(iters)]
    return [*cmd, "--log", str(log), *layout.options(), "--", *layout.flags, *extra]


@dataclass
class Step:
    """One train_small.py run to make: its command, environment additions and output file."""

    name: str
    cmd: list[str]
    env: dict[str, str]
    out: Path

    def describe(self) -> dict:
        return {"step": self.name, "env": self.env, "cmd": self.cmd, "output": str(self.out)}


def step(
    tree: Path,
    out: Path,
    name: str,
    layout: Layout,
    iters: int,
    extra: list[str],
    env: dict[str, str] | None = None,
) -> Step:
    cmd = train_command(tree, layout, iters, out / f"{name}.log", [*tree_flags(tree), *extra])
    return Step(name, cmd, dict(env or {}), out / f"{name}.out")


def environment(extra: dict[str, str]) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", **extra)
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    return env


# ---------------------------------------------------------------------------- plans


def resume_steps(tree: Path, layout: Layout, iters: int, out: Path) -> tuple[Step, Step]:
    """Run A (train ``iters``, save at iters // 2) and run B (load the staged checkpoint)."""
    name = layout.name
    save = [f"--save={out / f'{name}-ckpt-A'}", f"--save-interval={iters // 2}"]
    load = [f"--load={out / f'{name}-ckpt-B'}"]
    env = DETERMINISTIC_ENV
    first = step(tree, out, f"{name}-resume-A", layout, iters, [*DETERMINISTIC, *save], env)
    second = step(tree, out, f"{name}-resume-B", layout, iters, [*DETERMINISTIC, *load], env)
    return first, second


def check_resume(
    name: str, steps: tuple[Step, Step], iters: int, out: Path, timeout: float, averaged: bool
) -> dict:
    """Run A, stage its checkpoint of iters // 2, run B; the verdict as a JSON-able dict."""
    save_at = iters // 2
    result: dict = {"resume": name, "save_at": save_at, "iterations": iters}
    for folder in (out / f"{name}-ckpt-A", out / f"{name}-ckpt-B"):
        shutil.rmtree(folder, ignore_errors=True)
    rc, lines = run_steps([steps[0]], timeout)[0]
    straight = losses(lines)
    why = run_problem(rc, lines)
    if not why and len(straight) < iters:
        why = f"exit {rc}, {len(straight)} iterations logged"
    if why or (why := stage(out, name, save_at)):
        return {**result, "status": "fail", "detail": f"run A (train + save): {why}"}
    rc, lines = run_steps([steps[1]], timeout)[0]
    return {**result, **compare_resumed(straight, rc, lines, save_at, averaged)}


# ---------------------------------------------------------------------------- running


def visible_devices(n: int) -> list[str]:
    """The first ``n`` GPUs the parent may use, as CUDA_VISIBLE_DEVICES values."""
    inherited = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return (inherited or [str(i) for i in range(n)])[:n]


def run_steps(steps: list[Step], timeout: float) -> list[tuple[int, list[str]]]:
    """Start every step at once and wait for all; each one's (rc or HUNG, output lines).
    Whatever is still running when this is left by an exception (Ctrl-C) is stopped."""
    procs: list = []
    results = []
    try:
        for s in steps:
            print(f"[par4] {s.name}: started", file=sys.stderr, flush=True)
            procs.append(start(s.cmd, REPO_ROOT, environment(s.env), s.out))
        deadline = time.monotonic() + timeout
        for i, s in enumerate(steps):
            results.append(finish(procs[i], s.out, deadline - time.monotonic(), timeout))
            procs[i] = None
            print(f"[par4] {s.name}: exit {results[-1][0]}", file=sys.stderr, flush=True)
    finally:
        for proc in procs:
            if proc is not None and proc.poll() is None:
                stop(proc)
    return results


def parse_cli(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("tree", type=Path, help="patched Megatron-LM checkout (has pretrain_gpt.py)")
    p.add_argument("--out", type=Path, default=Path("par4"), help="logs, checkpoints (par4)")
    names = ",".join(layouts())
    p.add_argument("--runs", default=names, help=f"layouts (default {names})")
    p.add_argument(
        "--preset-size",
        choices=SIZES,
        default="small",
        help="the Llama preset the layouts train, sized for it (default small)",
    )
    p.add_argument("--iters", type=int, default=30, help="iterations per run (default 30)")
    p.add_argument("--no-resume", action="store_true", help="skip the save/resume checks")
    p.add_argument("--no-baselines", action="store_true", help="skip the one-GPU runs")
    p.add_argument(
        "--run-timeout",
        type=float,
        default=RUN_TIMEOUT,
        help=f"seconds per run before it is stopped as hung (default {RUN_TIMEOUT})",
    )
    p.add_argument("--table", type=Path, help="Markdown table (default OUT/par4-table.md)")
    p.add_argument("--dry-run", action="store_true", help="print the commands as JSON; run none")
    return p.parse_args(argv)


def fail_usage(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


Plan = tuple[
    list[tuple[Layout, Step]],  # the one-GPU runs, made together
    list[tuple[Layout, Step, tuple[Step, Step] | None]],  # per layout: its run, runs A and B
]


def plan(
    tree: Path, out: Path, chosen: list[Layout], iters: int, baselines: bool, resume: bool
) -> Plan:
    """Every run to make, in order."""
    bases = [baseline(x) for x in chosen] if baselines else []
    together = [
        step(tree, out, b.name, b, iters, [], {"CUDA_VISIBLE_DEVICES": device})
        for b, device in zip(bases, visible_devices(len(bases)))
    ]
    each = [
        (
            x,
            step(tree, out, x.name, x, iters, []),
            resume_steps(tree, x, iters, out) if resume and x.resume else None,
        )
        for x in chosen
    ]
    return list(zip(bases, together)), each


def main(argv: list[str] | None = None) -> int:
    opts = parse_cli(argv)
    tree = opts.tree.resolve()
    names = list(dict.fromkeys(n.strip() for n in opts.runs.split(",") if n.strip()))
    sized = layouts(opts.preset_size)
    unknown = [n for n in names if n not in sized]
    if unknown or not names:
        return fail_usage(f"unknown runs {unknown or opts.runs!r}; choose from {list(sized)}")
    if opts.iters < 4:
        return fail_usage("--iters must be 4 or more (3 warm-up iterations, then the timed ones)")
    if opts.run_timeout <= 0:
        return fail_usage("--run-timeout must be positive")
    if not (tree / "pretrain_gpt.py").is_file():
        return fail_usage(f"{tree} has no pretrain_gpt.py")
    if len(visible_devices(NPROC)) < NPROC:
        return fail_usage(f"CUDA_VISIBLE_DEVICES names fewer than the {NPROC} GPUs needed")
    out = opts.out.resolve()
    table = (opts.table or out / "par4-table.md").resolve()
    chosen = [sized[n] for n in names]
    bases, each = plan(tree, out, chosen, opts.iters, not opts.no_baselines, not opts.no_resume)
    if opts.dry_run:
        for _, s in bases:
            print(json.dumps({**s.describe(), "together": True}))
        for x, timed, resume in each:
            print(json.dumps(timed.describe()))
            if resume:
                saved = out / f"{x.name}-ckpt-A" / f"iter_{opts.iters // 2:07d}"
                staged = out / f"{x.name}-ckpt-B"
                print(json.dumps(resume[0].describe()))
                print(
                    json.dumps({"step": f"{x.name}-stage", "copy": str(saved), "to": str(staged)})
                )
                print(json.dumps(resume[1].describe()))
        return 0

    gpus = gpu_names()
    if gpus and len(gpus) < NPROC:
        return fail_usage(f"needs {NPROC} GPUs, this machine shows {len(gpus)}")
    out.mkdir(parents=True, exist_ok=True)
    gpu = f"{len(gpus)} x {gpus[0]}" if gpus else "unknown"
    table.parent.mkdir(parents=True, exist_ok=True)
    records: list[dict] = []
    verdicts: list[dict] = []

    def report(line: dict) -> None:
        """Print a record and rewrite the table with it: a run stopped from outside (a
        machine's time limit) still leaves the table of what finished."""
        print(json.dumps(line), flush=True)
        table.write_text(render_table(records, verdicts, gpu, opts.iters))

    results = run_steps([s for _, s in bases], opts.run_timeout)
    for (b, _), result in zip(bases, results):
        records.append(record(b, "baseline", *result))
        report(records[-1])
    averaged = averages_second_log(tree)
    for x, timed, resume in each:
        records.append(record(x, "layout", *run_steps([timed], opts.run_timeout)[0]))
        report(records[-1])
        if resume:
            verdicts.append(
                check_resume(x.name, resume, opts.iters, out, opts.run_timeout, averaged)
            )
            report(verdicts[-1])

    ok = all(r["ok"] for r in records) and all(v["status"] == "pass" for v in verdicts)
    print(json.dumps({"result": "pass" if ok else "fail", "gpu": gpu, "table": str(table)}))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
