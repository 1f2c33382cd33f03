#!/usr/bin/env python3
"""What clock the GPU ran at while it trained, and what held it there, from an nvidia-smi log.

Usage: python3 -m scripts.training.power_summary SMI.csv [--load 0.5] [--json OUT.json]

A step time only reads as "GPU time" at a known clock: a GEMM-bound step at the power limit
runs below the maximum SM clock, so a profiled iteration (the profiler's host overhead leaves
gaps in which the GPU cools) shows shorter kernels than the same iteration unprofiled. The log
is what ``scripts/gpu.sh``'s ``mfu`` stage records beside its runs::

    nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.max.sm,power.draw,power.limit,\
clocks_event_reasons.active --format=csv -lms 250

Samples drawing at least ``--load`` of the power limit count as "under load" (idle samples
between runs would pull the means up). Prints one line, and with ``--json`` writes the numbers:
samples under load, mean and median SM clock against the maximum, mean power against the
limit, and the share of those samples each clock-event reason was active in (NVML's bits:
software power cap, hardware slowdown, thermal ones...; none where the GPU does not report
them). Exit 2 when the file is missing, holds no readable sample (an nvidia-smi error, say) or
none under load.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
from pathlib import Path

# NVML's clocks-event reasons (nvmlClocksEventReason*), as nvidia-smi prints the bitmask.
REASONS = {
    0x1: "GPU idle",
    0x2: "applications clocks setting",
    0x4: "software power cap",
    0x8: "hardware slowdown",
    0x10: "sync boost",
    0x20: "software thermal slowdown",
    0x40: "hardware thermal slowdown",
    0x80: "hardware power brake",
    0x100: "display clocks setting",
}
_COLUMNS = {
    "clock": "clocks.current.sm [MHz]",
    "max_clock": "clocks.max.sm [MHz]",
    "power": "power.draw [W]",
    "limit": "power.limit [W]",
    "reasons": "clocks_event_reasons.active",
}


def _number(text: str) -> float:
    """``'1660 MHz'`` / ``'645.90 W'`` -> the number."""
    return float(text.strip().split()[0])


def _reasons(text: str | None) -> int:
    """The reasons bitmask; 0 where the GPU does not report it (``[N/A]``, ``[Not
    Supported]``, an older driver without the column)."""
    try:
        return int((text or "").strip(), 16)
    except ValueError:
        return 0


def samples(path: Path) -> list[dict[str, float]]:
    """Every row of the log with a clock and a power reading (rows of ``[N/A]`` dropped)."""
    rows = []
    with path.open(newline="") as fh:
        reader = csv.DictReader(fh, skipinitialspace=True)
        for row in reader:
            try:
                reading = {k: _number(row[c]) for k, c in _COLUMNS.items() if k != "reasons"}
            except (KeyError, ValueError, IndexError, AttributeError, TypeError):
                continue
            rows.append({**reading, "reasons": _reasons(row.get(_COLUMNS["reasons"]))})
    return rows


def summarise(rows: list[dict[str, float]], load: float) -> dict | None:
    """The samples at ``load`` or more of the power limit, summarised; None when there are none."""
    busy = [r for r in rows if r["power"] >= load * r["limit"]]
    if not busy:
        return None
    clocks = [r["clock"] for r in busy]
    reasons = {
        name: round(sum(1 for r in busy if int(r["reasons"]) & bit) / len(busy), 3)
        for bit, name in REASONS.items()
        if any(int(r["reasons"]) & bit for r in busy)
    }
    return {
        "samples": len(busy),
        "mean_sm_mhz": round(statistics.fmean(clocks), 1),
        "median_sm_mhz": statistics.median(clocks),
        "max_sm_mhz": max(r["max_clock"] for r in busy),
        "mean_power_w": round(statistics.fmean(r["power"] for r in busy), 1),
        "power_limit_w": max(r["limit"] for r in busy),
        "reasons_share": reasons,
    }


def line(summary: dict) -> str:
    held = ", ".join(f"{name} {share:.0%}" for name, share in summary["reasons_share"].items())
    return (
        f"{summary['samples']} samples under load: SM clock mean {summary['mean_sm_mhz']:.0f} MHz "
        f"(median {summary['median_sm_mhz']:.0f}) of {summary['max_sm_mhz']:.0f} "
        f"({summary['mean_sm_mhz'] / summary['max_sm_mhz']:.0%}), power mean "
        f"{summary['mean_power_w']:.0f} W of {summary['power_limit_w']:.0f} W; "
        f"clock-event reasons: {held or 'none'}"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("log", type=Path, help="nvidia-smi --format=csv log")
    ap.add_argument(
        "--load", type=float, default=0.5, help="share of the power limit counted as under load"
    )
    ap.add_argument("--json", type=Path, help="write the numbers here too")
    args = ap.parse_args(argv)
    if not args.log.is_file():
        print(f"power_summary: no file {args.log}", file=sys.stderr)
        return 2
    rows = samples(args.log)
    if not rows:
        first = args.log.read_text(errors="replace").splitlines()[:1] or [""]
        print(f"power_summary: no readable sample in {args.log} (its first line: {first[0][:120]!r})",
              file=sys.stderr)  # fmt: skip
        return 2
    summary = summarise(rows, args.load)
    if summary is None:
        print(f"power_summary: no sample at {args.load:.0%} of the power limit in {args.log}",
              file=sys.stderr)  # fmt: skip
        return 2
    print(line(summary))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
