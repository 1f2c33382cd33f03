#!/usr/bin/env python3
"""Time ``check`` and ``matrix`` over every release tag >= core_v0.12.0 plus main.

Why: the nightly CI job and a maintainer's "does the series still apply everywhere?" must stay
interactive (target: the whole matrix under 20 s on a 2-core machine). Reports, per workload,
the refs, the median seconds over --repeat runs and seconds per ref, end to end through the
CLI (Python start-up included) and in process; then how time grows with the number of refs.

    python -m scripts.bench.check /path/to/Megatron-LM-mirror [--series patches] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from megatron_rocm.commands.check import check_refs
from megatron_rocm.patchtool.matrix import build_matrix, select_refs
from megatron_rocm.patchtool.series import load_series
from scripts.bench import timing


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def timed(fn: Callable[[], object], repeat: int) -> float:
    """Median seconds of ``repeat`` wall-clock runs."""
    return timing.sampled_ms(fn, repeat) / 1e3


def cli(*args: str) -> Callable[[], object]:
    def run() -> None:
        proc = subprocess.run(
            [sys.executable, "-m", "megatron_rocm", *args], capture_output=True, text=True
        )
        if proc.returncode not in (0, 1):
            raise SystemExit(f"megatron-rocm {' '.join(args[:2])} failed: {proc.stderr}")

    return run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mirror", help="local Megatron-LM clone or bare mirror")
    parser.add_argument("--series", default=None, help="patch series (default: bundled)")
    parser.add_argument("--repeat", type=int, default=3, help="runs per workload (median)")
    args = parser.parse_args()
    repo = Path(args.mirror)
    series = load_series(args.series)
    specs = select_refs(repo, None)
    refs = [s.name for s in specs]
    series_args = ["--series", args.series] if args.series else []
    out = Path(tempfile.mkdtemp(prefix="bench-matrix-"))
    print(f"machine: {os.cpu_count()} CPUs ({cpu_model()}), Python {platform.python_version()}")
    print(
        f"mirror: {repo}; series: {series.folder} ({len(series.patches)} patches); "
        f"refs: {refs[0]} .. {refs[-1]} ({len(refs)}); median of {args.repeat}\n"
    )

    rows: list[tuple[str, int, float]] = []
    rows.append(
        (
            "check, CLI",
            len(refs),
            timed(cli("check", "--source", str(repo), "--ref", *refs, *series_args), args.repeat),
        )
    )
    rows.append(
        (
            "check, in process",
            len(refs),
            timed(lambda: check_refs(repo, refs, series, None), args.repeat),
        )
    )
    rows.append(
        (
            "matrix --no-scan, CLI",
            len(refs),
            timed(
                cli(
                    "matrix",
                    "--source",
                    str(repo),
                    "--no-scan",
                    "--format",
                    "json",
                    "--out",
                    str(out / "a.json"),
                    *series_args,
                ),
                args.repeat,
            ),
        )
    )
    rows.append(
        (
            "matrix + scan, CLI",
            len(refs),
            timed(
                cli(
                    "matrix",
                    "--source",
                    str(repo),
                    "--format",
                    "md",
                    "--format",
                    "html",
                    "--format",
                    "json",
                    "--format",
                    "junit",
                    "--out",
                    str(out / "all"),
                    *series_args,
                ),
                args.repeat,
            ),
        )
    )
    for scan in (False, True):
        rows.append(
            (
                f"matrix{' + scan' if scan else ' --no-scan'}, in process",
                len(refs),
                timed(
                    lambda s=scan: build_matrix(repo, specs, series, source="bench", scan=s),
                    args.repeat,
                ),
            )
        )
    for n in sorted({1, 5, 10, len(specs)}):
        if n <= len(specs):
            rows.append(
                (
                    f"scaling: matrix + scan, {n} refs",
                    n,
                    timed(
                        lambda n=n: build_matrix(repo, specs[-n:], series, source="bench"),
                        args.repeat,
                    ),
                )
            )

    width = max(len(r[0]) for r in rows)
    print(f"{'workload':<{width}}  {'refs':>4}  {'seconds':>8}  {'s/ref':>6}")
    for name, n, sec in rows:
        print(f"{name:<{width}}  {n:>4}  {sec:>8.2f}  {sec / n:>6.3f}")
    worst = max(sec for name, _, sec in rows if not name.startswith("scaling"))
    print(f"\nslowest full run {worst:.2f} s (target < 20 s): {'OK' if worst < 20 else 'TOO SLOW'}")
    return 0 if worst < 20 else 1


if __name__ == "__main__":
    raise SystemExit(main())
