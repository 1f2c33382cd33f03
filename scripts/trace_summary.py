"""Where one profiled training iteration spends its time, from a torch profiler trace.

    python scripts/trace_summary.py TRACE.json[.gz] [--gaps 15] [--top 30]

Reads the Chrome trace that ``pretrain_gpt.py --profile --use-pytorch-profiler`` (or any
``torch.profiler`` run) writes and prints:

* the span of GPU work, the time some kernel was running (busy) and the idle rest;
* GPU time per kernel family (GEMM, attention, Triton, norms, elementwise, copies, NCCL, ...);
* the longest idle gaps, each with the Python frames (Megatron's and ours) that launched the
  kernel ending the gap: idle time is CPU time the GPU waited for (syncs, launch overhead).

A full-depth model's op table (``scripts/profile_step.py --ops``) says what each kernel costs;
this says what the *iteration* costs beyond its kernels, which is where the step time that
no kernel accounts for goes.
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

# First match wins. Attention comes before GEMM: cuDNN's attention kernels are named
# "cudnn_generated_..._sdpa_sm90_flash_..._wgmma_...", which the GEMM pattern also matches.
FAMILIES = (
    ("attention", re.compile(r"flash|fmha|sdpa|attention|cudnn", re.I)),
    ("gemm", re.compile(r"nvjet|gemm|cutlass|xmma|Cijk|sm90_|sm80_", re.I)),
    ("nccl", re.compile(r"nccl|rccl", re.I)),
    ("norm", re.compile(r"norm|GammaBeta", re.I)),
    ("triton", re.compile(r"^triton_|_kernel$")),
    ("copy", re.compile(r"copy|Memcpy|cat|transpose", re.I)),
    ("optimizer", re.compile(r"multi_tensor|foreach|adam", re.I)),
    ("reduce", re.compile(r"reduce|sum|max|softmax|cross_entropy|nll", re.I)),
    ("elementwise", re.compile(r"elementwise|vectorized|unrolled|fill|Memset", re.I)),
)
GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
_OURS = re.compile(r"(megatron/|megatron_rocm/|pretrain_gpt)")


def load(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as fh:
        data = json.load(fh)
    return data["traceEvents"] if isinstance(data, dict) else data


def family(name: str) -> str:
    for fam, pattern in FAMILIES:
        if pattern.search(name):
            return fam
    return "other"


def busy_union(spans: list[tuple[float, float]]) -> tuple[float, list[tuple[float, float]]]:
    """Total covered time and the idle gaps between covered stretches (microseconds)."""
    busy, gaps = 0.0, []
    cur_start, cur_end = spans[0]
    for start, end in spans[1:]:
        if start > cur_end:
            busy += cur_end - cur_start
            gaps.append((cur_end, start))
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    busy += cur_end - cur_start
    return busy, gaps


def launching_frames(events: list[dict], kernel: dict, depth: int = 4) -> str:
    """Our and Megatron's Python frames around the launch of ``kernel`` (innermost first)."""
    corr = kernel.get("args", {}).get("correlation")
    launch = next(
        (
            e
            for e in events
            if e.get("cat") == "cuda_runtime" and e.get("args", {}).get("correlation") == corr
        ),
        None,
    )
    if launch is None:
        return "?"
    ts, tid = launch["ts"], launch.get("tid")
    frames = [
        e
        for e in events
        if e.get("cat") in ("python_function", "cpu_op")
        and e.get("tid") == tid
        and e["ts"] <= ts <= e["ts"] + e.get("dur", 0)
    ]
    frames.sort(key=lambda e: e.get("dur", 0))
    ours = [e["name"] for e in frames if e.get("cat") == "cpu_op" or _OURS.search(e["name"])]
    return " < ".join(n.split("/")[-1][:60] for n in ours[:depth]) or frames[0]["name"][:60]


def summarise(events: list[dict], gaps_shown: int, top: int) -> str:
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATS]
    if not kernels:
        return "no GPU events in this trace"
    kernels.sort(key=lambda e: e["ts"])
    spans = [(e["ts"], e["ts"] + e.get("dur", 0)) for e in kernels]
    span = max(end for _, end in spans) - spans[0][0]
    busy, gaps = busy_union(spans)
    lines = [
        f"GPU span {span / 1e3:.1f} ms, busy {busy / 1e3:.1f} ms, idle {(span - busy) / 1e3:.1f} ms"
        f" ({len(kernels)} kernels)",
        "",
        "| family | ms | share |",
        "|---|---|---|",
    ]
    per_family: dict[str, float] = defaultdict(float)
    per_kernel: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in kernels:
        per_family[family(e["name"])] += e.get("dur", 0)
        stat = per_kernel[e["name"]]
        stat[0] += e.get("dur", 0)
        stat[1] += 1
    total = sum(per_family.values())
    for fam, us in sorted(per_family.items(), key=lambda kv: -kv[1]):
        lines.append(f"| {fam} | {us / 1e3:.1f} | {us / total:.1%} |")
    lines += ["", "| kernel | ms | calls |", "|---|---|---|"]
    for name, (us, n) in sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"| {name[:90]} | {us / 1e3:.2f} | {n} |")
    lines += ["", "| idle gap ms | before kernel | launched from |", "|---|---|---|"]
    starts = [s for s, _ in spans]
    for gap_start, gap_end in sorted(gaps, key=lambda g: g[0] - g[1])[:gaps_shown]:
        nxt = kernels[bisect.bisect_left(starts, gap_end)]
        where = launching_frames(events, nxt)
        lines.append(f"| {(gap_end - gap_start) / 1e3:.2f} | {nxt['name'][:50]} | {where} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", type=Path)
    ap.add_argument("--gaps", type=int, default=15, help="idle gaps to list")
    ap.add_argument("--top", type=int, default=30, help="kernels to list")
    args = ap.parse_args(argv)
    try:
        events = load(args.trace)
    except (OSError, ValueError, KeyError) as exc:
        print(f"trace_summary: cannot read {args.trace}: {exc}", file=sys.stderr)
        return 1
    print(summarise(events, args.gaps, args.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
