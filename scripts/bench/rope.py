"""Benchmark kernels.rope (Triton) against its torch path and Megatron's unfused RoPE, one GPU.

    python -m scripts.bench.rope [--batches 8,16] [--cudagraph] [--configs default,w2] [--json F]
    TRITON_INTERPRET=1 python -m scripts.bench.rope --smoke   # tiny CPU run, checks it works

Inputs are the 0.85B Llama's q and k (s 2048, 12 query heads, 4 key heads, head dim 128,
bf16) at micro-batch 8 and 16, as the GPU tests use them: q is contiguous ``[s, b, 12, 128]``
(Megatron copies it out of the fused qkv projection), k is a strided view of that projection
(``[s, b, 4, 128]``, head stride 640), and the angles are Megatron's ``[s, 1, 1, 128]`` fp32
table. Plus an interleaved q and a packed (thd) q and k with uneven documents.

Providers, each forward and backward (``torch.autograd.grad`` of the output):
``triton`` is what ``fused_apply_rotary_pos_emb`` runs on a GPU now; ``torch`` is its torch
path (``MEGATRON_ROCM_KERNELS=reference``: cos/sin tables, a hand-written backward);
``unfused`` is Megatron's ``_apply_rotary_pos_emb_bshd`` math under autograd, what upstream
runs without ``--apply-rope-fusion``.

``--configs`` adds ``triton:<name>`` columns: the same kernel under other launch heuristics
(``CONFIGS``), to re-tune ``_rope_triton.Tuning`` on new hardware.

Each time is the median of ``triton.testing.do_bench``; ``%`` is the bandwidth reached against
the ideal byte count (read t once, write the output once; backward: read the gradient once,
write it once; plus the angle table once) as a share of the copy bandwidth measured in the
same run (``dst.copy_(src)``, read + write). Needs only torch and Triton, no network.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from megatron_rocm.runtime.kernels import rope
from megatron_rocm.runtime.kernels import rope_triton as tri
from scripts.bench import timing as bench_timing

CONFIGS = {  # the shipped heuristic first, then alternatives worth measuring on new hardware
    "default": tri.Tuning(),
    "w2": tri.Tuning(elems_per_thread=32),  # 2 warps per program at d=128 (4 on AMD: 1)
    "w4": tri.Tuning(elems_per_thread=16),
    "tile4k": tri.Tuning(tile=4096),  # twice the heads per step, 2 warps
    "wholebatch": tri.Tuning(programs_per_sm=1),  # never split the batch over programs
}

DEVICE = "cuda"
CUDA_GRAPH = False
SEQ, D, Q_HEADS, KV_HEADS = 2048, 128, 12, 4


def bench(fn: Callable[[], object]) -> float:
    """Median ms; ``--cudagraph`` replays the call from a CUDA graph: GPU time alone, without
    the host's launch overhead (which the default timing includes where the GPU outruns the
    host)."""
    return bench_timing.median_ms(fn, DEVICE, cuda_graph=CUDA_GRAPH, rep=40)


def copy_bandwidth(nbytes: int) -> float:
    return bench_timing.copy_bandwidth(nbytes, DEVICE, rep=40)


def freqs_table(positions: int) -> torch.Tensor:
    """Megatron's RotaryEmbedding output: ``pos * 10000^(-2i/d)``, halves duplicated, fp32."""
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float32, device=DEVICE) / D))
    angles = torch.outer(torch.arange(positions, dtype=torch.float32, device=DEVICE), inv)
    return torch.cat((angles, angles), -1)[:, None, None, :]


def cases(seq: int, batches: list[int]) -> list[dict]:
    """Every benchmarked input: its name and shape, ``t``, ``fn`` (our entry point) and
    ``unfused`` (Megatron's math under autograd), and the angle table's bytes."""
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    freqs = freqs_table(seq)
    out = []
    for b in batches:
        groups = Q_HEADS // KV_HEADS
        qkv = torch.randn((seq, b, KV_HEADS, (groups + 2) * D), generator=gen, device=DEVICE).to(
            torch.bfloat16
        )
        q = qkv[..., : groups * D].reshape(seq, b, Q_HEADS, D)  # a copy, as in Megatron
        k = qkv[..., groups * D : (groups + 1) * D]  # a strided view
        for name, t in ((f"q sbhd b{b}", q), (f"k sbhd b{b}", k)):
            out.append(_sbhd(name, t, freqs, interleaved=False))
        if b == batches[0]:
            out.append(_sbhd(f"q sbhd b{b} interleaved", q, freqs, interleaved=True))
            out += _thd(seq, b, freqs, gen)
    return out


def _sbhd(name: str, t: torch.Tensor, freqs: torch.Tensor, interleaved: bool) -> dict:
    return {
        "name": name,
        "shape": list(t.shape),
        "t": t,
        "fn": lambda x: rope.fused_apply_rotary_pos_emb(x, freqs, interleaved=interleaved),
        "unfused": lambda x: rope.rope_reference(x, freqs, interleaved),
        "angle_bytes": freqs.numel() * freqs.element_size(),
    }


def _thd(seq: int, b: int, freqs: torch.Tensor, gen: torch.Generator) -> list[dict]:
    """``b`` packs of ``seq`` tokens, each cut into documents of 1/2, 1/8, 1/4, 1/8 of seq."""
    parts = [seq // 2, seq // 8, seq // 4]
    lengths = (parts + [seq - sum(parts)]) * b
    cu = torch.tensor([0, *lengths], device=DEVICE).cumsum(0).to(torch.int32)
    out = []
    for heads, label in ((Q_HEADS, "q"), (KV_HEADS, "k")):
        t = torch.randn((seq * b, heads, D), generator=gen, device=DEVICE).to(torch.bfloat16)
        out.append(
            {
                "name": f"{label} thd {len(lengths)} docs",
                "shape": list(t.shape),
                "t": t,
                "fn": lambda x, cu=cu: rope.fused_apply_rotary_pos_emb_thd(x, cu, freqs),
                "unfused": lambda x, cu=cu: rope.rope_thd_reference(x, cu, freqs),
                "angle_bytes": freqs.numel() * freqs.element_size(),
            }
        )
    return out


def run_case(case: dict, configs: list[str]) -> list[dict]:
    t = case["t"]
    dy = torch.randn(t.shape, device=DEVICE).to(t.dtype)
    moved = 2 * t.numel() * t.element_size()
    ideal = {"fwd": moved + case["angle_bytes"], "bwd": moved + case["angle_bytes"]}
    providers = {"triton": ("auto", case["fn"], configs[0])}
    providers |= {f"triton:{c}": ("auto", case["fn"], c) for c in configs[1:]}
    providers["torch"] = ("reference", case["fn"], configs[0])
    providers["unfused"] = ("reference", case["unfused"], configs[0])
    rows, outputs = [], {}
    for name, (mode, fn, config) in providers.items():
        tri.set_tuning(CONFIGS[config])
        with bench_timing.environment(MEGATRON_ROCM_KERNELS=mode):
            x = t.detach().requires_grad_(True)
            y = fn(x)
            outputs[name] = y.detach()
            ran = type(y.grad_fn).__name__
            if name.startswith("triton") and not ran.startswith("_TritonRotary"):
                print(f"WARNING {case['name']}: the Triton kernel did not run ({ran})")
            try:
                fwd = bench(lambda fn=fn: fn(t))
                bwd = bench(lambda y=y, x=x: torch.autograd.grad(y, x, dy, retain_graph=True))
            except Exception as exc:  # noqa: BLE001 - e.g. a host sync under --cudagraph
                print(f"{name} {case['name']}: {type(exc).__name__}: {exc}", file=sys.stderr)
                continue
        for direction, ms in (("fwd", fwd), ("bwd", bwd)):
            rows.append(
                {
                    "case": case["name"],
                    "shape": case["shape"],
                    "dir": direction,
                    "provider": name,
                    "ms": ms,
                    "ideal_bytes": ideal[direction],
                }
            )
        del x, y
    tri.set_tuning(CONFIGS["default"])
    diff = (outputs["triton"].float() - outputs["torch"].float()).abs().max().item()
    for r in rows:
        r["max_abs_diff_triton_vs_torch"] = diff
    return rows


def markdown(results: list[dict], copy_gbs: float) -> str:
    providers = list(dict.fromkeys(r["provider"] for r in results))
    head = "| case | shape | dir | " + " | ".join(providers) + " | triton vs torch | diff |"
    lines = [head, "|" + "---|" * (len(providers) + 5)]
    for case, direction in dict.fromkeys((r["case"], r["dir"]) for r in results):
        group = {r["provider"]: r for r in results if (r["case"], r["dir"]) == (case, direction)}
        cells = []
        for p in providers:
            r = group.get(p)
            pct = 100 * r["ideal_bytes"] / r["ms"] / 1e6 / copy_gbs if r else 0
            cells.append(f"{r['ms']:.3f} ms ({pct:.0f}%)" if r else "-")
        any_r = next(iter(group.values()))
        speedup = (
            f"{group['torch']['ms'] / group['triton']['ms']:.2f}x"
            if "torch" in group and "triton" in group
            else "-"
        )
        shape = "x".join(map(str, any_r["shape"]))
        lines.append(
            f"| {case} | {shape} | {direction} | "
            + " | ".join(cells)
            + f" | {speedup} | {any_r['max_abs_diff_triton_vs_torch']:.1e} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    global DEVICE, CUDA_GRAPH
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="8,16", help="micro-batch sizes")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--cudagraph", action="store_true", help="time CUDA-graph replays")
    ap.add_argument(
        "--configs", default="default", help=f"launch heuristics to compare: {','.join(CONFIGS)}"
    )
    ap.add_argument("--smoke", action="store_true", help="tiny CPU run (TRITON_INTERPRET=1)")
    args = ap.parse_args(argv)
    CUDA_GRAPH = args.cudagraph
    unknown = sorted(set(args.configs.split(",")) - set(CONFIGS))
    if unknown:
        print(f"bench_rope: unknown --configs {','.join(unknown)}; known: {','.join(CONFIGS)}")
        return 2
    seq, batches = SEQ, [int(b) for b in args.batches.split(",")]
    if args.smoke:
        DEVICE, seq, batches = "cpu", 16, [2]
    elif not torch.cuda.is_available():
        print("bench_rope: needs a CUDA or ROCm GPU (or --smoke with TRITON_INTERPRET=1)")
        return 2
    import triton

    copy_gbs = copy_bandwidth(1 << 30 if DEVICE == "cuda" else 1 << 20)
    dev = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (smoke)"
    timer = "CUDA graph replay" if CUDA_GRAPH else "do_bench"
    print(f"{dev}  torch {torch.__version__}  triton {triton.__version__}  bf16  ({timer})")
    print(f"copy bandwidth (read+write): {copy_gbs:.0f} GB/s", flush=True)
    results: list[dict] = []
    for case in cases(seq, batches):
        results += run_case(case, args.configs.split(","))
        print(f"done {case['name']}", file=sys.stderr, flush=True)
    print(markdown(results, copy_gbs))
    if args.json:
        meta = {"device": dev, "torch": torch.__version__, "triton": triton.__version__}
        meta["timer"] = timer
        meta |= {"copy_gbs": copy_gbs, "date": time.strftime("%Y-%m-%d")}
        args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
