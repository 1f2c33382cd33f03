#!/usr/bin/env python3
"""GPU timings of megatron_rocm.runtime.kernels (all but softmax) against what upstream runs without
Apex/TE: naive norm math, unfused RoPE, upcast wgrad GEMM, torch AdamW defaults, the
per-tensor l2norm with host syncs, and the local unfused attention.

Usage: python3 -m scripts.bench.kernels [--json] [--quick]
Prints a markdown table (device, torch and HIP/CUDA versions, date); ``--json`` prints JSON.
Each row also reports the max abs difference between the two providers (a parity check).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
from collections.abc import Callable

import torch

from megatron_rocm.runtime.kernels import grad_accum
from megatron_rocm.runtime.kernels.local_sdpa import sdpa_attention
from megatron_rocm.runtime.kernels.multi_tensor import multi_tensor_l2norm
from megatron_rocm.runtime.kernels.norm import FusedNorm, norm_reference
from megatron_rocm.runtime.kernels.optimizer import FusedAdam
from megatron_rocm.runtime.kernels.rope import fused_apply_rotary_pos_emb, rope_reference
from scripts.bench import timing

DEV = torch.device("cuda")
BF16 = torch.bfloat16


def timed(fn: Callable[[], object], iters: int, warmup: int = 3) -> float:
    """Median milliseconds of ``fn`` over ``iters`` runs, CUDA events around each."""
    return timing.sampled_ms(fn, iters, "cuda", warmup=warmup)


def fwd_bwd(fn: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> Callable[[], None]:
    grad = None

    def run() -> None:
        nonlocal grad
        leaves = [x.detach().requires_grad_() for x in inputs]
        out = fn(*leaves)
        if grad is None:
            grad = torch.randn_like(out)
        out.backward(grad)

    return run


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def bench_norm(kind: str, tokens: int, hidden: int, iters: int) -> dict:
    norm = FusedNorm(hidden, normalization=kind, params_dtype=BF16, device=DEV)
    x = torch.randn(tokens, hidden, device=DEV, dtype=BF16)
    ours = timed(fwd_bwd(norm, x), iters)

    def naive(inp: torch.Tensor) -> torch.Tensor:
        return norm_reference(inp, norm.weight, norm.bias, norm.eps, kind)

    base = timed(fwd_bwd(naive, x), iters)
    diff = max_diff(norm(x), naive(x))
    return row(f"norm {kind} fwd+bwd", f"[{tokens}, {hidden}] bf16", ours, base, "unfused", diff)


def bench_rope(iters: int, s: int = 4096, b: int = 2, h: int = 32, d: int = 128) -> dict:
    t = torch.randn(s, b, h, d, device=DEV, dtype=BF16)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, device=DEV).float() / d))
    angles = torch.outer(torch.arange(s, device=DEV).float(), inv)
    freqs = torch.cat((angles, angles), -1)[:, None, None, :]
    ours = timed(fwd_bwd(lambda x: fused_apply_rotary_pos_emb(x, freqs), t), iters)
    base = timed(fwd_bwd(lambda x: rope_reference(x, freqs), t), iters)
    diff = max_diff(fused_apply_rotary_pos_emb(t, freqs), rope_reference(t, freqs))
    return row("rope fwd+bwd", f"[{s}, {b}, {h}, {d}] bf16", ours, base, "unfused", diff)


def bench_wgrad(iters: int, tokens: int = 8192, k_in: int = 4096, n_out: int = 4096) -> dict:
    total_input = torch.randn(tokens, k_in, device=DEV, dtype=BF16)
    grad_output = torch.randn(tokens, n_out, device=DEV, dtype=BF16)
    main_grad = torch.zeros(n_out, k_in, device=DEV)
    ours = timed(
        lambda: grad_accum.wgrad_gemm_accum_fp32(total_input, grad_output, main_grad), iters
    )
    check = torch.zeros_like(main_grad)
    grad_accum.wgrad_gemm_accum_fp32(total_input, grad_output, check)
    upcast = torch.zeros_like(main_grad)
    base = timed(lambda: upcast.addmm_(grad_output.t().float(), total_input.float()), iters)
    expected = torch.zeros_like(main_grad).addmm_(grad_output.t().float(), total_input.float())
    tflops = 2 * tokens * k_in * n_out / ours / 1e9
    note = f"{grad_accum.chosen_strategy('cuda', BF16)}; {tflops:.0f} TFLOP/s"
    shape = f"[{tokens}, {k_in}] x [{tokens}, {n_out}] bf16"
    return row("wgrad accum fp32", shape, ours, base, "upcast", max_diff(check, expected), note)


def bench_adam(iters: int, h: int = 4096) -> dict:
    torch.manual_seed(0)
    shapes = [(h, h)] * 8 + [(h,)] * 64 + [(h * 43 // 16, h)] * 4
    params = [torch.nn.Parameter(torch.randn(s, device=DEV)) for s in shapes]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for p, q in zip(params, twins):
        p.grad = torch.randn_like(p) * 1e-3
        q.grad = p.grad.clone()
    kw = {"lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    ours_opt = FusedAdam(params, adam_w_mode=True, **kw)
    base_opt = torch.optim.AdamW(twins, **kw)  # upstream's no-Apex fallback, default settings
    ours = timed(ours_opt.step, iters)
    base = timed(base_opt.step, iters)
    diff = max(max_diff(p, q) for p, q in zip(params, twins))
    numel = sum(p.numel() for p in params)
    return row(
        "adam step",
        f"{len(params)} tensors, {numel / 1e6:.0f}M fp32",
        ours,
        base,
        "AdamW default",
        diff,
    )


def bench_l2norm(iters: int, h: int = 4096) -> dict:
    torch.manual_seed(0)
    grads = [torch.randn(h, h, device=DEV) for _ in range(8)]
    grads += [torch.randn(h, device=DEV) for _ in range(120)]
    flag = torch.zeros(1, dtype=torch.int, device=DEV)

    def ours() -> torch.Tensor:
        return multi_tensor_l2norm(2048 * 32, flag, [grads], False)[0]

    def per_tensor_with_sync() -> torch.Tensor:
        # What upstream's local fallback does: one norm per tensor, then host round trips.
        norms = [torch.norm(g) for g in grads]
        total = torch.norm(torch.tensor([float(n) for n in norms]))
        return torch.tensor([float(total)], device=DEV)

    diff = max_diff(ours(), per_tensor_with_sync())
    return row(
        "l2norm",
        f"{len(grads)} tensors fp32",
        timed(ours, iters),
        timed(per_tensor_with_sync, iters),
        "per-tensor + sync",
        diff,
    )


def unfused_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The local DotProductAttention: repeat kv, baddbmm scores, masked fp32 softmax, bmm."""
    sq, b, heads, dim = q.shape
    groups = k.shape[2]
    k = k.repeat_interleave(heads // groups, dim=2)
    v = v.repeat_interleave(heads // groups, dim=2)
    qb = q.reshape(sq, b * heads, dim).transpose(0, 1)
    kb = k.reshape(sq, b * heads, dim).transpose(0, 1).transpose(1, 2)
    empty = torch.empty(b * heads, sq, sq, device=q.device, dtype=q.dtype)
    scores = torch.baddbmm(empty, qb, kb, beta=0.0, alpha=1.0 / math.sqrt(dim))
    mask = torch.ones(sq, sq, device=q.device, dtype=torch.bool).triu(1)
    probs = torch.softmax(scores.masked_fill(mask, -10000.0).float(), dim=-1).to(q.dtype)
    context = torch.bmm(probs, v.reshape(sq, b * heads, dim).transpose(0, 1))
    return context.view(b, heads, sq, dim).permute(2, 0, 1, 3).reshape(sq, b, heads * dim)


def bench_attention(seq: int, groups: int, iters: int, heads: int = 32) -> dict:
    torch.manual_seed(0)
    b, dim = 2, 128
    q = torch.randn(seq, b, heads, dim, device=DEV, dtype=BF16)
    k = torch.randn(seq, b, groups, dim, device=DEV, dtype=BF16)
    v = torch.randn(seq, b, groups, dim, device=DEV, dtype=BF16)
    ours = timed(fwd_bwd(lambda *x: sdpa_attention(*x, None, "causal"), q, k, v), iters)
    base = timed(fwd_bwd(unfused_attention, q, k, v), iters)
    diff = max_diff(sdpa_attention(q, k, v, None, "causal"), unfused_attention(q, k, v))
    shape = f"b{b} s{seq} np{heads} ng{groups} hn{dim} bf16"
    return row("attention causal fwd+bwd", shape, ours, base, "local unfused", diff)


def row(
    op: str, shape: str, ours: float, base: float, baseline: str, diff: float, note: str = ""
) -> dict:
    return {
        "op": op,
        "shape": shape,
        "ours_ms": round(ours, 4),
        "baseline": baseline,
        "baseline_ms": round(base, 4),
        "speedup": round(base / ours, 2),
        "max_abs_diff": float(f"{diff:.3g}"),
        "note": note,
    }


def environment() -> dict:
    hip = getattr(torch.version, "hip", None)
    return {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "runtime": f"HIP {hip}" if hip else f"CUDA {torch.version.cuda}",
        "date": datetime.date.today().isoformat(),
    }


def markdown(env: dict, rows: list[dict]) -> str:
    lines = [
        f"Device: {env['device']} · torch {env['torch']} · {env['runtime']} · {env['date']}",
        "",
        "| op | shape | ours ms | baseline | baseline ms | speedup | max abs diff | note |",
        "|---|---|---:|---|---:|---:|---:|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['op']} | | | | | | | ERROR: {r['error']} |")
            continue
        lines.append(
            f"| {r['op']} | {r['shape']} | {r['ours_ms']:.3f} | {r['baseline']} | "
            f"{r['baseline_ms']:.3f} | {r['speedup']:.2f}x | {r['max_abs_diff']:.3g} | "
            f"{r['note']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print JSON instead of markdown")
    parser.add_argument("--quick", action="store_true", help="fewer iterations")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_kernels: needs a CUDA or ROCm GPU", file=sys.stderr)
        return 3
    iters = 5 if args.quick else 20
    cases: list[tuple[str, Callable[[], dict]]] = [
        ("norm LayerNorm", lambda: bench_norm("LayerNorm", 16384, 4096, iters)),
        ("norm RMSNorm", lambda: bench_norm("RMSNorm", 16384, 4096, iters)),
        ("rope", lambda: bench_rope(iters)),
        ("wgrad", lambda: bench_wgrad(iters)),
        ("adam", lambda: bench_adam(iters)),
        ("l2norm", lambda: bench_l2norm(iters)),
        ("attention mha", lambda: bench_attention(4096, 32, max(3, iters // 2))),
        ("attention gqa", lambda: bench_attention(4096, 8, max(3, iters // 2))),
    ]
    rows = []
    for name, case in cases:
        try:
            rows.append(case())
        except Exception as exc:  # noqa: BLE001 - one failing case must not hide the others
            rows.append({"op": name, "error": f"{type(exc).__name__}: {exc}"[:200]})
        torch.cuda.empty_cache()
    env = environment()
    print(json.dumps({**env, "rows": rows}, indent=2) if args.json else markdown(env, rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
