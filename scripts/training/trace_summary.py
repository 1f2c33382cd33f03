"""Where one profiled training iteration spends its time, from a torch profiler trace.

    python -m scripts.training.trace_summary TRACE.json[.gz] [--gaps 15] [--top 30]
    python -m scripts.training.trace_summary RANK0.json.gz --against RANK1.json.gz [--top 30]

Reads the Chrome trace that ``pretrain_gpt.py --profile --use-pytorch-profiler`` (or any
``torch.profiler`` run) writes and prints:

* the span of GPU work, the time some kernel was running (busy) and the idle rest;
* GPU time per kernel family (GEMM, attention, Triton, norms, elementwise, copies, NCCL, ...);
* the costliest kernels, each with the frames that launched most of its time (and their share
  where it was launched from several places);
* the longest idle gaps, each with the Python frames (Megatron's and ours) that launched the
  kernel ending the gap and what that thread ran while the GPU waited: idle time is CPU time
  the GPU waited for (syncs, launch overhead);
* all idle time (gaps of 20 us or more) by the host frame it was spent in;
* communication no compute kernel runs beside (exposed), per collective, and how much compute
  ran beside communication (where both share the GPU's SMs and memory).

``--against`` compares two ranks of one iteration: in a step that ends in a collective every
rank waits for the slowest, so the kernels one rank spends longer on say where the step's
imbalance comes from, and each rank's exposed communication says how long it waited. The same
kernels are also paired call by call: ranks that exchange at every layer lose what each
stretch between exchanges took longer on the other rank, so differences that alternate
between the ranks cost time that the totals do not show.

A full-depth model's op table (``scripts/training/profile_step.py --ops``) says what each kernel costs;
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

# a2a on copy engines: what marks its kernels -> the kind of exchange each is
EXCHANGES = {
    "Memcpy PtoP": "copy-engine copy",
    "symmetric_memory::barrier": "symmetric-memory barrier",
}

# First match wins. Attention comes before GEMM: cuDNN's attention kernels are named
# "cudnn_generated_..._sdpa_sm90_flash_..._wgmma_...", which the GEMM pattern also matches.
FAMILIES = (
    ("attention", re.compile(r"flash|fmha|sdpa|attention|cudnn", re.I)),
    ("gemm", re.compile(r"nvjet|gemm|cutlass|xmma|Cijk|sm90_|sm80_", re.I)),
    ("nccl", re.compile(r"nccl|rccl", re.I)),
    # a2a on copy engines: peer copies through symmetric memory, and the group's barriers
    ("exchange", re.compile("|".join(map(re.escape, EXCHANGES)))),
    ("norm", re.compile(r"norm|GammaBeta", re.I)),
    ("triton", re.compile(r"^triton_|_kernel$")),
    ("copy", re.compile(r"copy|Memcpy|cat|transpose", re.I)),
    ("optimizer", re.compile(r"multi_tensor|foreach|adam", re.I)),
    ("reduce", re.compile(r"reduce|sum|max|softmax|cross_entropy|nll", re.I)),
    ("elementwise", re.compile(r"elementwise|vectorized|unrolled|fill|Memset", re.I)),
)
GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
COMMUNICATION = {"nccl", "exchange"}
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
    covered = _merged(spans)
    busy = sum(end - start for start, end in covered)
    return busy, [(a[1], b[0]) for a, b in zip(covered, covered[1:])]


def gpu_kernels(events: list[dict]) -> list[dict]:
    """The trace's GPU events (kernels, copies, memsets), in start order."""
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATS]
    kernels.sort(key=lambda e: e["ts"])
    return kernels


def _span(e: dict) -> tuple[float, float]:
    return e["ts"], e["ts"] + e.get("dur", 0)


def _merged(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, non-overlapping stretches covering ``spans``."""
    out: list[tuple[float, float]] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def _covered(start: float, end: float, cover: list[tuple[float, float]]) -> float:
    """How much of ``[start, end)`` the sorted stretches ``cover`` cover."""
    i = max(bisect.bisect_right(cover, (start, float("inf"))) - 1, 0)
    total = 0.0
    while i < len(cover) and cover[i][0] < end:
        total += max(0.0, min(end, cover[i][1]) - max(start, cover[i][0]))
        i += 1
    return total


def collective(name: str) -> str:
    """A communication kernel's collective: ``ncclDevKernel_ReduceScatter_Sum_f32_RING_LL``
    -> ``ReduceScatter``; p2p batches are ``SendRecv``; copy-engine transfers through
    symmetric memory are ``copy-engine copy``, its barriers ``symmetric-memory barrier`` (whose
    exposed time is mostly one rank waiting for the other to arrive)."""
    for mark, kind in EXCHANGES.items():
        if mark in name:
            return kind
    m = re.search(r"(?:nccl|rccl)\w*?Kernel_([A-Za-z]+)", name, re.I)
    return m.group(1) if m else name[:40]


def exposure(kernels: list[dict]) -> dict[str, float]:
    """Microseconds: compute (time some non-communication kernel runs), compute beside
    communication, and per collective the time it runs with no compute beside it."""
    comm = [e for e in kernels if family(e["name"]) in COMMUNICATION]
    compute = _merged([_span(e) for e in kernels if family(e["name"]) not in COMMUNICATION])
    comm_cover = _merged([_span(e) for e in comm])
    out: dict[str, float] = defaultdict(float)
    out["compute"] = sum(end - start for start, end in compute)
    out["compute beside communication"] = sum(_covered(s, e, comm_cover) for s, e in compute)
    # a collective's stretches, less the compute beside them (two kernels of one collective
    # running at once count once)
    by_collective: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for e in comm:
        by_collective[collective(e["name"])].append(_span(e))
    for name, spans in by_collective.items():
        out[f"exposed {name}"] = sum(
            (end - start) - _covered(start, end, compute) for start, end in _merged(spans)
        )
    return dict(out)


def compare(ours: list[dict], theirs: list[dict], top: int) -> str:
    """Two ranks' iterations side by side: families, exposure, the kernels whose total time
    differs most (same name on both ranks), and the same kernels call by call (``pace``)."""
    lines = ["| family | this rank ms | other rank ms | other - this |", "|---|---|---|---|"]
    fams: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    names: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0, 0])
    for side, kernels in enumerate((ours, theirs)):
        for e in kernels:
            fams[family(e["name"])][side] += e.get("dur", 0)
            names[e["name"]][side] += e.get("dur", 0)
            names[e["name"]][side + 2] += 1
    for fam, (a, b) in sorted(fams.items(), key=lambda kv: -abs(kv[1][1] - kv[1][0])):
        lines.append(f"| {fam} | {a / 1e3:.1f} | {b / 1e3:.1f} | {(b - a) / 1e3:+.1f} |")
    lines += ["", "| | this rank ms | other rank ms | other - this |", "|---|---|---|---|"]
    mine, other = exposure(ours), exposure(theirs)
    for key in sorted(set(mine) | set(other)):
        a, b = mine.get(key, 0.0), other.get(key, 0.0)
        lines.append(f"| {key} | {a / 1e3:.1f} | {b / 1e3:.1f} | {(b - a) / 1e3:+.1f} |")
    lines += [
        "",
        "| kernel | this rank ms (calls) | other rank ms (calls) | other - this |",
        "|---|---|---|---|",
    ]
    for name, (a, b, na, nb) in sorted(names.items(), key=lambda kv: -abs(kv[1][1] - kv[1][0]))[
        :top
    ]:
        lines.append(
            f"| {name[:80]} | {a / 1e3:.2f} ({na}) | {b / 1e3:.2f} ({nb}) | {(b - a) / 1e3:+.2f} |"
        )
    return "\n".join(lines + [""] + pace(ours, theirs, top))


def pace(ours: list[dict], theirs: list[dict], top: int) -> list[str]:
    """The same compute kernels call by call: how much longer each rank took where it was the
    slower one.

    Ranks that exchange at every layer wait for each other at each exchange, so a rank can
    lose time to the other even where the totals say the other is the faster: a kernel whose
    calls are sometimes longer on one rank and sometimes on the other (clocks under a power
    cap, say) costs both. Summed over the calls where the *other* rank took longer, the
    differences bound what this rank can have waited for it (and the converse): a bound, since
    differences of kernels between the same two exchanges may cancel. Kernels are paired by
    name and call order, where both ranks called them equally often; the rest are counted.
    """
    calls: list[dict[str, list[float]]] = [defaultdict(list), defaultdict(list)]
    for side, kernels in enumerate((ours, theirs)):
        for e in kernels:
            if family(e["name"]) not in COMMUNICATION:
                calls[side][e["name"]].append(e.get("dur", 0))
    rows: list[tuple[float, float, float, str]] = []  # other slower, this slower, largest, name
    unpaired = [0, 0.0]
    for name in set(calls[0]) | set(calls[1]):
        mine, other = calls[0].get(name, []), calls[1].get(name, [])
        if len(mine) != len(other):
            unpaired[0] += 1
            unpaired[1] += sum(mine) + sum(other)
            continue
        deltas = [b - a for a, b in zip(mine, other, strict=True)]
        rows.append((
            sum(d for d in deltas if d > 0), -sum(d for d in deltas if d < 0),
            max(deltas, key=abs), name,
        ))  # fmt: skip
    other_slower, this_slower = sum(r[0] for r in rows), sum(r[1] for r in rows)
    lines = [
        f"Paired calls: the other rank took {other_slower / 1e3:.1f} ms longer where it was"
        f" slower, this rank {this_slower / 1e3:.1f} ms where it was (net"
        f" {(other_slower - this_slower) / 1e3:+.1f} ms); {unpaired[0]} kernel name(s),"
        f" {unpaired[1] / 1e3:.1f} ms, called unequally often, not paired.",
        "",
        "| kernel | calls | other slower by ms | this slower by ms | largest ms |",
        "|---|---|---|---|---|",
    ]
    for longer, shorter, largest, name in sorted(rows, key=lambda r: -(r[0] + r[1]))[:top]:
        lines.append(
            f"| {name[:80]} | {len(calls[0][name])} | {longer / 1e3:.2f} | {shorter / 1e3:.2f} |"
            f" {largest / 1e3:+.2f} |"
        )
    return lines


LAUNCH_CATS = ("cuda_runtime", "cuda_driver")  # Inductor's Triton kernels launch via the driver


def launches(events: list[dict]) -> dict[object, dict]:
    """Each kernel launch (runtime or driver API call) by its correlation id."""
    return {
        e["args"]["correlation"]: e
        for e in events
        if e.get("cat") in LAUNCH_CATS and "correlation" in e.get("args", {})
    }


def _ours_or_op(e: dict) -> bool:
    return e.get("cat") == "cpu_op" or bool(_OURS.search(e["name"]))


def _short(e: dict) -> str:
    return e["name"].split("/")[-1][:60]


def launch_sites(
    kernels: list[dict], events: list[dict], by_corr: dict, depth: int = 3
) -> list[str]:
    """The frames around each kernel's launch, ours, Megatron's and torch's ops innermost first
    (the innermost frame where none is), in one sweep over the host frames; "?" where the launch
    or its frames are not in the trace (no Python stacks traced)."""
    found = [by_corr.get(k.get("args", {}).get("correlation")) for k in kernels]
    queries = [(launch.get("tid"), launch["ts"]) if launch else (None, -1.0) for launch in found]
    sites = []
    for launch, stack in zip(found, host_stacks(events, queries), strict=True):
        ours = [_short(e) for e in reversed(stack) if _ours_or_op(e)]
        if launch is None or not stack:
            sites.append("?")
        else:
            sites.append(" < ".join(ours[:depth]) or stack[-1]["name"][:60])
    return sites


def host_stacks(events: list[dict], queries: list[tuple[object, float]]) -> list[list[dict]]:
    """The host frames (Python functions and ops) running on thread ``tid`` at time ``t``, for
    each ``(tid, t)`` of ``queries``, outermost first: one sweep over each thread's frames,
    which nest."""
    frames: dict[object, list[dict]] = defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("python_function", "cpu_op"):
            frames[e.get("tid")].append(e)
    for spans in frames.values():
        spans.sort(key=lambda e: (e["ts"], -e.get("dur", 0)))
    out: list[list[dict]] = [[] for _ in queries]
    by_tid: dict[object, list[tuple[float, int]]] = defaultdict(list)
    for q, (tid, t) in enumerate(queries):
        by_tid[tid].append((t, q))
    for tid, asks in by_tid.items():
        spans, i, stack = frames.get(tid, []), 0, []
        for t, q in sorted(asks):
            while i < len(spans) and spans[i]["ts"] <= t:
                stack.append(spans[i])
                i += 1
            stack = [e for e in stack if e["ts"] + e.get("dur", 0) >= t]
            out[q] = list(stack)
    return out


WAITED = "(launched before the gap: it waited on the GPU)"


def host_frames_during(
    gap: tuple[float, float], launch: dict | None, stack: list[dict]
) -> list[dict] | None:
    """What the launching thread ran while the GPU waited, from the gap's start to the launch
    of the kernel that ended it: our, Megatron's and torch's op frames that cover at least half
    of that stretch, innermost first (``stack``: the thread's frames at its midpoint, which
    every such frame contains). None: the launch call had returned before the gap began."""
    if launch is None:
        return []
    start, end = gap[0], launch["ts"]
    if launch["ts"] + launch.get("dur", 0) <= start:
        return None
    if end <= start:  # the gap began inside the launch call itself
        return [launch]
    covering = [
        e
        for e in stack
        if _ours_or_op(e)
        and min(end, e["ts"] + e.get("dur", 0)) - max(start, e["ts"]) >= (end - start) / 2
    ]
    return list(reversed(covering))


def host_during(
    gap: tuple[float, float], launch: dict | None, stack: list[dict], depth: int = 3
) -> str:
    """``host_frames_during`` as text: the innermost ``depth``, or why there are none."""
    frames = host_frames_during(gap, launch, stack)
    if frames is None:
        return WAITED
    return " < ".join(_short(e) for e in frames[:depth]) or "?"


def gaps_with_hosts(
    gaps: list[tuple[float, float]], kernels: list[dict], events: list[dict], by_corr: dict
) -> list[tuple[tuple[float, float], dict, dict | None, list[dict]]]:
    """Each gap with the kernel that ended it, that kernel's launch (None: not in the trace)
    and the launching thread's frames midway between the gap's start and the launch."""
    starts = [k["ts"] for k in kernels]
    nexts = [kernels[bisect.bisect_left(starts, end)] for _, end in gaps]
    found = [by_corr.get(k.get("args", {}).get("correlation")) for k in nexts]
    queries = [
        (launch.get("tid"), (gap[0] + launch["ts"]) / 2) if launch else (None, gap[0])
        for gap, launch in zip(gaps, found, strict=True)
    ]
    stacks = host_stacks(events, queries)
    return list(zip(gaps, nexts, found, stacks, strict=True))


def idle_by_host_frame(
    gaps: list[tuple[float, float]],
    kernels: list[dict],
    events: list[dict],
    by_corr: dict,
    min_us: float = 20,
) -> list[tuple[str, float, int]]:
    """Idle time (gaps of ``min_us`` or more) by the innermost host frame that ran through it:
    where the host was while the GPU waited, over the whole iteration."""
    long_enough = [gap for gap in gaps if gap[1] - gap[0] >= min_us]
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for gap, _, launch, stack in gaps_with_hosts(long_enough, kernels, events, by_corr):
        where = host_during(gap, launch, stack, depth=1)
        totals[where][0] += gap[1] - gap[0]
        totals[where][1] += 1
    return sorted(((k, v[0], int(v[1])) for k, v in totals.items()), key=lambda r: -r[1])


def summarise(events: list[dict], gaps_shown: int, top: int) -> str:
    kernels = gpu_kernels(events)
    if not kernels:
        return "no GPU events in this trace"
    spans = [_span(e) for e in kernels]
    span = max(end for _, end in spans) - spans[0][0]
    busy, gaps = busy_union(spans)
    lines = [
        f"GPU span {span / 1e3:.1f} ms, busy {busy / 1e3:.1f} ms, idle {(span - busy) / 1e3:.1f} ms"
        f" ({len(kernels)} kernels)",
        "",
        "| family | ms | share |",
        "|---|---|---|",
    ]
    by_corr = launches(events)
    per_family: dict[str, float] = defaultdict(float)
    per_kernel: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    per_site: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for e, site in zip(kernels, launch_sites(kernels, events, by_corr), strict=True):
        per_family[family(e["name"])] += e.get("dur", 0)
        stat = per_kernel[e["name"]]
        stat[0] += e.get("dur", 0)
        stat[1] += 1
        per_site[e["name"]][site] += e.get("dur", 0)
    total = sum(per_family.values())
    for fam, us in sorted(per_family.items(), key=lambda kv: -kv[1]):
        lines.append(f"| {fam} | {us / 1e3:.1f} | {us / total:.1%} |")
    lines += ["", "| kernel | ms | calls | launched from (most of its time) |", "|---|---|---|---|"]
    for name, (us, n) in sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:top]:
        site, site_us = max(per_site[name].items(), key=lambda kv: kv[1])
        share = f" ({site_us / us:.0%})" if site_us < us else ""
        lines.append(f"| {name[:90]} | {us / 1e3:.2f} | {n} | {site}{share} |")
    lines += [
        "",
        "| idle gap ms | before kernel | launched from | host during the gap |",
        "|---|---|---|---|",
    ]
    longest = sorted(gaps, key=lambda g: g[0] - g[1])[:gaps_shown]
    shown = gaps_with_hosts(longest, kernels, events, by_corr)
    sites = launch_sites([nxt for _, nxt, _, _ in shown], events, by_corr, depth=4)
    for (gap, nxt, launch, stack), where in zip(shown, sites, strict=True):
        host = host_during(gap, launch, stack)
        lines.append(f"| {(gap[1] - gap[0]) / 1e3:.2f} | {nxt['name'][:50]} | {where} | {host} |")
    lines += ["", "| idle ms (gaps of 20 us or more) | gaps | host frame the GPU waited on |"]
    lines += ["|---|---|---|"]
    for where, us, n in idle_by_host_frame(gaps, kernels, events, by_corr)[:top]:
        lines.append(f"| {us / 1e3:.2f} | {n} | {where} |")
    lines += ["", "| communication and compute | ms |", "|---|---|"]
    lines += [f"| {key} | {us / 1e3:.1f} |" for key, us in sorted(exposure(kernels).items())]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", type=Path)
    ap.add_argument("--gaps", type=int, default=15, help="idle gaps to list")
    ap.add_argument("--top", type=int, default=30, help="kernels to list")
    ap.add_argument(
        "--against",
        type=Path,
        metavar="TRACE",
        help="another rank's trace of the same iteration: compare the two instead",
    )
    args = ap.parse_args(argv)
    traces = [args.trace] + ([args.against] if args.against else [])
    loaded = []
    for path in traces:
        try:
            loaded.append(load(path))
        except (OSError, ValueError, KeyError) as exc:
            print(f"trace_summary: cannot read {path}: {exc}", file=sys.stderr)
            return 1
    if args.against:
        ours, theirs = (gpu_kernels(events) for events in loaded)
        if not ours or not theirs:
            print("trace_summary: a trace has no GPU events to compare", file=sys.stderr)
            return 1
        print(compare(ours, theirs, args.top))
    else:
        print(summarise(loaded[0], args.gaps, args.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
