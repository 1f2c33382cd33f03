"""Benchmark kernels.softmax against torch, torch.compile and Apex (if importable) on one GPU.

    python -m scripts.bench.softmax [--modes causal,masked] [--seqs 1024,...] [--json FILE]

Per (mode, seq, direction) it reports the median time (triton.testing.do_bench) and the
bandwidth reached against an *ideal* byte count, as a percentage of the device copy bandwidth
measured in the same run (``dst.copy_(src)``, read + write):

* full ideal: fwd reads x and writes y; bwd reads dy and y and writes dx (plus, for the
  padding mask, the bool mask read once: it is shared by all heads);
* causal-aware ideal (causal mode): only the lower triangle is read, all of it is written;
  this is the ideal a kernel that skips the upper triangle can reach, so it is the one the
  ``%`` columns use for causal rows. Both byte counts go to the JSON.

``--configs`` runs our kernel under several launch heuristics (see ``CONFIGS``) in one go.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable
from pathlib import Path

import torch

from megatron_rocm.runtime.kernels import softmax, softmax_reference
from megatron_rocm.runtime.kernels import softmax_triton as tri
from megatron_rocm.runtime.kernels.launch import sm_count
from scripts.bench import timing as bench_timing

CONFIGS = {  # the shipped heuristic first, then alternatives worth re-measuring on new hardware
    "default": tri.Tuning(),
    "w16": tri.Tuning(max_warps=16),
    "nohf": tri.Tuning(head_fastest_min_sk=1 << 62),
    "loop16k": tri.Tuning(max_block=16384),
    "crows32k": tri.Tuning(causal_bwd_max_block=32768),
}
DEVICE = "cuda"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def native(mode: str, scale: float, mask: torch.Tensor | None) -> Callable:
    """Upstream's unfused fallback: fp32, scale, masked_fill(-10000), softmax, cast back."""

    def fn(x: torch.Tensor) -> torch.Tensor:
        z = x.float() * scale
        if mask is not None:
            z = z.masked_fill(mask, -10000.0)
        return torch.softmax(z, dim=-1).to(x.dtype)

    return fn


def ours(mode: str, scale: float, mask: torch.Tensor | None) -> Callable:
    if mode == "causal":
        return lambda x: softmax.scaled_upper_triang_masked_softmax(x, scale)
    if mode == "masked":
        return lambda x: softmax.scaled_masked_softmax(x, mask, scale)
    return lambda x: softmax.scaled_softmax(x, scale)


def apex(mode: str, scale: float, mask: torch.Tensor | None) -> Callable | None:
    try:
        from apex.transformer.functional import fused_softmax as fs  # type: ignore
    except Exception:  # noqa: BLE001 - Apex absent or broken: skip the provider
        return None
    table = {
        "causal": lambda x: fs.ScaledUpperTriangMaskedSoftmax.apply(x, scale),
        "masked": lambda x: fs.ScaledMaskedSoftmax.apply(x, mask, scale),
        "plain": lambda x: fs.ScaledSoftmax.apply(x, scale),
    }
    return table[mode]


def bench(fn: Callable[[], object]) -> float:
    return bench_timing.median_ms(fn, DEVICE)


def copy_bandwidth(nbytes: int) -> float:
    return bench_timing.copy_bandwidth(nbytes, DEVICE)


def shapes(mode: str, seq: int, elems: int) -> tuple[int, int]:
    """(batch, heads) so one tensor holds about ``elems`` elements."""
    ab = max(1, elems // (seq * seq))
    heads = min(ab, 16)
    return ab // heads, heads


def ideal_bytes(mode: str, b: int, heads: int, seq: int, esize: int) -> dict[str, float]:
    full = b * heads * seq * seq * esize
    read = b * heads * seq * (seq + 1) // 2 * esize if mode == "causal" else full
    mask = b * seq * seq if mode == "masked" else 0
    return {
        "fwd_full": 2 * full + mask,
        "bwd_full": 3 * full,
        "fwd": read + full + mask,
        "bwd": 2 * read + full,
    }


def run_case(
    mode: str, seq: int, dtype: torch.dtype, args: argparse.Namespace, t0: float
) -> list[dict]:
    torch._dynamo.reset()  # a fresh compile per shape, never the recompile-limit eager fallback
    b, heads = shapes(mode, seq, args.elems)
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    x = torch.randn((b, heads, seq, seq), generator=gen, device=DEVICE, dtype=dtype)
    dy = torch.randn_like(x)
    mask = None
    if mode == "masked":
        mask = torch.rand((b, 1, seq, seq), generator=gen, device=DEVICE) < 0.1
    if mode == "causal":
        x, dy = x.view(-1, seq, seq), dy.view(-1, seq, seq)
        mask = softmax_reference.causal_mask(seq, seq, DEVICE)
    scale = 1 / math.sqrt(128)
    providers: dict[str, Callable | None] = {}
    n_rows = x.numel() // seq
    code = {"causal": tri.CAUSAL, "masked": tri.MASKED}.get(mode, tri.PLAIN)
    sms = sm_count(x.device)

    def plans(t: tri.Tuning) -> tuple[tri.Plan, tri.Plan]:
        bwd_code = tri.CAUSAL if code == tri.CAUSAL else tri.PLAIN
        return (
            tri.plan(n_rows, seq, code, sms, t),
            tri.plan(n_rows, seq, bwd_code, sms, t, backward=True),
        )

    base = plans(CONFIGS[args.configs[0]])
    for i, name in enumerate(args.configs):
        # a config that launches exactly what the first one does would only re-measure it
        if i == 0 or plans(CONFIGS[name]) != base:
            providers[f"ours:{name}"] = ours(mode, scale, mask)
    providers["torch"] = native(mode, scale, mask)
    if "compile" in args.providers:
        providers["compile"] = torch.compile(native(mode, scale, mask), dynamic=False)
    providers["apex"] = apex(mode, scale, mask) if "apex" in args.providers else None
    ideal = ideal_bytes(mode, b, heads, seq, x.element_size())
    rows = []
    with torch.no_grad():
        reference = native(mode, scale, mask)(x)
    for name, fn in providers.items():
        if fn is None:
            continue
        if name == "compile" and time.monotonic() - t0 > args.budget_s:
            print(f"skip compile at {mode} {seq}: over --budget-s", flush=True)
            continue
        if name.startswith("ours:"):
            tri.set_tuning(CONFIGS[name.split(":", 1)[1]])
        try:
            xg = x.detach().requires_grad_(True)
            y = fn(xg)
            fwd = bench(lambda fn=fn: fn(x))
            bwd = bench(lambda y=y, xg=xg: torch.autograd.grad(y, xg, dy, retain_graph=True))
        except Exception as exc:  # noqa: BLE001 - one provider failing must not lose the rest
            print(f"{name} {mode} {seq}: {type(exc).__name__}: {exc}", flush=True)
            continue
        finally:
            tri.set_tuning(CONFIGS["default"])
        err = (y.detach().float() - reference.float()).abs().max().item()
        for direction, ms in (("fwd", fwd), ("bwd", bwd)):
            rows.append(
                {
                    "mode": mode,
                    "seq": seq,
                    "batch": b,
                    "heads": heads,
                    "dir": direction,
                    "provider": name,
                    "ms": ms,
                    "ideal_bytes": ideal[direction],
                    "ideal_bytes_full": ideal[f"{direction}_full"],
                    "max_abs_diff_vs_torch": err,
                }
            )
        del y, xg
    return rows


def markdown(results: list[dict], copy_gbs: float) -> str:
    """One row per case: each provider's median ms and % of copy bandwidth vs. the ideal bytes
    (causal-aware for causal), then the best of our configs against the full-matrix ideal."""
    providers = list(dict.fromkeys(r["provider"] for r in results))
    head = (
        "| mode | seq | b x np | dir | "
        + " | ".join(providers)
        + " | best ours: % of full ideal | its max abs diff vs torch |"
    )
    lines = [head, "|" + "---|" * (len(providers) + 6)]
    keys = list(dict.fromkeys((r["mode"], r["seq"], r["dir"]) for r in results))
    for mode, seq, direction in keys:
        group = {
            r["provider"]: r
            for r in results
            if (r["mode"], r["seq"], r["dir"]) == (mode, seq, direction)
        }
        cells = []
        for p in providers:
            r = group.get(p)
            pct = 100 * r["ideal_bytes"] / r["ms"] / 1e6 / copy_gbs if r else 0
            cells.append(f"{r['ms']:.3f} ms ({pct:.0f}%)" if r else "-")
        best = min((r for p, r in group.items() if p.startswith("ours")), key=lambda r: r["ms"])
        full_pct = 100 * best["ideal_bytes_full"] / best["ms"] / 1e6 / copy_gbs
        any_r = next(iter(group.values()))
        bn = f"{any_r['batch']}x{any_r['heads']}"
        lines.append(
            f"| {mode} | {seq} | {bn} | {direction} | "
            + " | ".join(cells)
            + f" | {best['provider'][5:]}: {full_pct:.0f}% | {best['max_abs_diff_vs_torch']:.1e} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", default="causal,masked")
    ap.add_argument("--seqs", default="1024,2048,4096,8192,16384,32768")
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--providers", default="compile,apex", help="extra providers to try")
    ap.add_argument("--elems", type=int, default=1 << 28, help="elements per tensor (~512 MB bf16)")
    ap.add_argument("--budget-s", type=float, default=240.0, help="stop compiling after this")
    ap.add_argument("--deadline-s", type=float, default=300.0, help="start no case after this")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--smoke", action="store_true", help="tiny CPU run (TRITON_INTERPRET=1)")
    ap.add_argument("--render", type=Path, help="only print the table of a saved --json file")
    args = ap.parse_args(argv)
    if args.render:
        saved = json.loads(args.render.read_text())
        meta = saved["meta"]
        print(f"{meta['device']}  torch {meta['torch']}  triton {meta['triton']}  {meta['dtype']}")
        print(f"copy bandwidth (read+write): {meta['copy_gbs']:.0f} GB/s")
        print(markdown(saved["results"], meta["copy_gbs"]))
        return 0
    if args.smoke:
        global DEVICE
        DEVICE = "cpu"
        args.seqs, args.elems, args.providers = "16,40", 4096, ""
    args.configs = args.configs.split(",")
    args.providers = args.providers.split(",")
    dtype = DTYPES[args.dtype]
    t0 = time.monotonic()
    copy_gbs = copy_bandwidth(1 << 30 if DEVICE == "cuda" else 1 << 20)
    dev = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (smoke)"
    import triton

    meta = {
        "device": dev,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "dtype": args.dtype,
        "copy_gbs": copy_gbs,
        "configs": {k: CONFIGS[k].__dict__ for k in args.configs},
        "date": time.strftime("%Y-%m-%d"),
    }
    print(f"{dev}  torch {torch.__version__}  triton {triton.__version__}  {args.dtype}")
    print(f"copy bandwidth (read+write): {copy_gbs:.0f} GB/s", flush=True)
    results: list[dict] = []
    for mode in args.modes.split(","):
        for seq in (int(s) for s in args.seqs.split(",")):
            if time.monotonic() - t0 > args.deadline_s:
                print(f"skip {mode} {seq}: over --deadline-s", flush=True)
                continue
            try:
                results += run_case(mode, seq, dtype, args, t0)
            except torch.cuda.OutOfMemoryError:
                print(f"{mode} {seq}: out of memory, skipped", flush=True)
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
            print(f"done {mode} {seq} at {time.monotonic() - t0:.0f}s", flush=True)
            if args.json:
                args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    print(markdown(results, copy_gbs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
