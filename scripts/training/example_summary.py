#!/usr/bin/env python3
"""One line of JSON for a run of one of upstream's example scripts (``pretrain_gpt.py``'s log).

Usage: python3 -m scripts.training.example_summary RUN.log [--peak-tflops 989]

The examples print their own throughput (``--log-throughput``: Megatron's model TFLOP/s per
GPU), so nothing here recounts FLOPs: it takes the iterations ``train_small.py`` parses, leaves
out the first ``WARM_UP`` as ``train_small`` does, and reports the median iteration time, the
median of Megatron's per-iteration TFLOP/s and its MFU against ``--peak-tflops``, the first and
last loss, the largest ``max reserved`` memory rank 0 reported (Megatron prints it in MiB and
only for the first iterations), and the last exception. Exit 0 with at least one timed
iteration and every loss finite, 1 otherwise (``problems`` says why), 2 when the log is
missing.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from pathlib import Path

from scripts.training.train_small import (
    PEAK_TFLOPS,
    WARM_UP,
    add_peak_tflops,
    last_exception,
    parse_log,
)

_RESERVED = re.compile(r"max reserved:\s*([0-9.]+)")


def summarize(lines: list[str], peak_tflops: float = PEAK_TFLOPS) -> dict:
    """The run's summary (see the module docstring); ``ok`` false with its ``problems``."""
    records, _ = parse_log(lines)
    timed = [r for r in records[WARM_UP:] if r.elapsed_ms is not None]
    reserved = [float(m.group(1)) for line in lines if (m := _RESERVED.search(line))]
    out: dict = {"iterations": len(records), "timed": len(timed)}
    if timed:
        median_ms = statistics.median(r.elapsed_ms for r in timed)
        tflops = [r.megatron_tflops for r in timed if r.megatron_tflops is not None]
        median_tflops = statistics.median(tflops) if tflops else None
        out.update(
            median_iter_ms=round(median_ms, 1),
            mean_iter_ms=round(statistics.mean(r.elapsed_ms for r in timed), 1),
            megatron_tflops_per_gpu=median_tflops,
            mfu=round(median_tflops / peak_tflops, 4) if median_tflops else None,
        )
    losses = [r.loss for r in records if r.loss is not None]
    out["first_loss"] = losses[0] if losses else None
    out["last_loss"] = losses[-1] if losses else None
    out["max_reserved_mib"] = max(reserved) if reserved else None
    out["exception"] = last_exception(lines)
    problems = []
    if not timed:
        problems.append(f"no timed iteration (after the first {WARM_UP})")
    # Megatron logs no loss for an iteration whose loss is NaN, and counts it
    if any(not math.isfinite(x) for x in losses) or any(r.nan_iterations for r in records):
        problems.append("loss is not finite")
    out["problems"] = problems
    out["ok"] = not problems
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("log", type=Path, help="the example's pretrain_gpt.py log")
    add_peak_tflops(parser)
    a = parser.parse_args(argv)
    if not a.log.is_file():
        print(f"example_summary: {a.log}: no such log", file=sys.stderr)
        return 2
    summary = summarize(a.log.read_text(errors="replace").splitlines(), a.peak_tflops)
    print(json.dumps(summary))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
