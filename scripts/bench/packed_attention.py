"""Benchmark packed (THD) attention on one GPU: every implementation against the alternatives.

    python -m scripts.bench.packed_attention [--tokens 16384] [--heads 32] [--groups 8]
        [--dim 128] [--no-causal] [--pad-multiple 0] [--impls flash,flex,sdpa_loop,sdpa_padded]

Documents of mixed lengths (a fixed seed; length-1 documents included) fill ``--tokens``
rows. Per implementation it prints one JSON line: median forward and forward+backward times,
TFLOP/s counted on the real documents only (causal halves the work; fwd+bwd = 3.5 x fwd),
the error against ``sdpa_loop`` (max abs difference of output and dq), the first call's time
(compilation for flex) and the per-batch plan cost, with the device and torch version.

* ``flash`` / ``flex`` / ``sdpa_loop``: ``packed_attention(implementation=...)``;
* ``sdpa_padded``: the documents padded to the longest one, one SDPA call on ``[n, max, ...]``
  (the padding copies are not timed; causal right-padding needs no mask).

``--pad-multiple 64`` stores each document padded to a multiple of 64 and passes
``cu_seqlens_padded`` (upstream's CP/RL layout). Flex's first call compiles; its time is
reported as ``first_call_s``. Needs only torch (+ Triton for flex); no network.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import torch
import torch.nn.functional as F

from megatron_rocm.runtime.backend.packed import plan as packed_plan
from megatron_rocm.runtime.backend.packed.thd_attention import packed_attention
from scripts.bench import timing


def document_lengths(tokens: int, seed: int = 0) -> list[int]:
    """Mixed lengths (log-normal around 500, 1..4096) with a few length-1 documents."""
    gen = torch.Generator().manual_seed(seed)
    lengths: list[int] = []
    while sum(lengths) < tokens:
        draw = math.exp(math.log(500) + 1.2 * float(torch.randn(1, generator=gen)))
        lengths.append(max(1, min(4096, int(draw))))
        if len(lengths) % 7 == 3:
            lengths.append(1)
    lengths[-1] -= sum(lengths) - tokens
    return [n for n in lengths if n > 0]


def timed(fn, warmup: int = 3, iters: int = 10) -> float:  # noqa: ANN001
    """Median milliseconds of ``fn()`` over ``iters`` runs (CUDA events; wall clock on CPU)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return timing.sampled_ms(fn, iters, device, warmup=warmup)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--no-causal", dest="causal", action="store_false")
    parser.add_argument("--pad-multiple", type=int, default=0)
    parser.add_argument("--impls", default="flash,flex,sdpa_loop,sdpa_padded")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny CPU run of the script")
    args = parser.parse_args()
    if args.cpu_smoke:
        device, dtype = torch.device("cpu"), torch.float32
    elif not torch.cuda.is_available():
        print("needs a CUDA or ROCm GPU (or --cpu-smoke)", file=sys.stderr)
        return 2
    else:
        device, dtype = torch.device("cuda"), torch.bfloat16
    lengths = document_lengths(args.tokens)
    pads = [(-n) % args.pad_multiple if args.pad_multiple else 0 for n in lengths]
    starts = [sum(a + b for a, b in zip(lengths[:i], pads[:i])) for i in range(len(lengths))]
    t = starts[-1] + lengths[-1] + pads[-1]
    cu = torch.tensor([0] + [sum(lengths[: i + 1]) for i in range(len(lengths))], dtype=torch.int32)
    stored = [n + p for n, p in zip(lengths, pads)]
    cu_pad = torch.tensor(
        [0] + [sum(stored[: i + 1]) for i in range(len(stored))], dtype=torch.int32
    )
    cu, cu_pad = cu.to(device), (cu_pad.to(device) if args.pad_multiple else None)
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(h: int) -> torch.Tensor:
        return torch.randn(t, h, args.dim, device=device, dtype=dtype, generator=gen)

    q, k, v = rand(args.heads), rand(args.groups), rand(args.groups)
    grad = torch.randn(t, args.heads * args.dim, device=device, dtype=dtype, generator=gen)
    scale = args.dim**-0.5
    pair_work = sum(n * n / (2 if args.causal else 1) for n in lengths)
    flops_fwd = 4 * pair_work * args.heads * args.dim  # QK^T and PV
    common = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "hip": getattr(torch.version, "hip", None),
        "tokens": t,
        "documents": len(lengths),
        "longest": max(lengths),
        "heads": args.heads,
        "groups": args.groups,
        "dim": args.dim,
        "dtype": str(dtype).replace("torch.", ""),
        "causal": args.causal,
        "pad_multiple": args.pad_multiple,
    }

    def packed(impl: str):  # noqa: ANN202
        def run(leaves: list[torch.Tensor]) -> torch.Tensor:
            return packed_attention(
                *leaves, cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_pad,
                cu_seqlens_kv_padded=cu_pad, causal=args.causal, softmax_scale=scale,
                implementation=impl,
            )  # fmt: skip

        return run

    def padded_sdpa(leaves: list[torch.Tensor]) -> torch.Tensor:
        qp, kp, vp = leaves  # [n, heads, max, dim], built once below
        return F.scaled_dot_product_attention(
            qp, kp, vp, is_causal=args.causal, scale=scale, enable_gqa=True
        )

    longest = max(lengths)

    def to_padded(x: torch.Tensor) -> torch.Tensor:
        batch = x.new_zeros(len(lengths), longest, *x.shape[1:])
        for i, (s, n) in enumerate(zip(starts, lengths)):
            batch[i, :n] = x[s : s + n]
        return batch.transpose(1, 2).contiguous()

    def fwd_bwd(fn, leaves, g):  # noqa: ANN001, ANN202
        out = fn(leaves)
        out.backward(g)
        return out.detach().float(), leaves[0].grad.float()

    # The oracle for every packed implementation: one SDPA call per document.
    loop_leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    baseline = fwd_bwd(packed("sdpa_loop"), loop_leaves, grad)

    def build_plan() -> None:
        packed_plan._cache.clear()
        plan = packed_plan.build_plan(
            t, t, cu, cu, cu_pad, cu_pad, causal=args.causal, device=device
        )
        if "flex" in args.impls:
            from megatron_rocm.runtime.backend.packed.flex import document_block_mask

            document_block_mask(plan, args.causal, None)

    common["per_batch_plan_ms"] = round(timed(build_plan, 1, 5), 3)  # once per batch, all layers
    for impl in args.impls.split(","):
        record = dict(common, impl=impl)
        try:
            if impl == "sdpa_padded":
                if not args.causal:
                    record["note"] = "non-causal needs a key-padding mask; timed without one"
                leaves = [to_padded(x).requires_grad_() for x in (q, k, v)]
                fn = padded_sdpa
                g = torch.randn_like(fn(leaves))
            else:
                fn, leaves, g = packed(impl), [x.clone().requires_grad_() for x in (q, k, v)], grad
            begin = time.perf_counter()
            result = fwd_bwd(fn, leaves, g)
            if device.type == "cuda":
                torch.cuda.synchronize()
            record["first_call_s"] = round(time.perf_counter() - begin, 3)
            if impl != "sdpa_padded":
                record["max_abs_err_out_vs_sdpa_loop"] = float(
                    (result[0] - baseline[0]).abs().max()
                )
                record["max_abs_err_dq_vs_sdpa_loop"] = float((result[1] - baseline[1]).abs().max())
            fwd_ms = timed(lambda: fn(leaves))  # noqa: B023
            both_ms = timed(lambda: fn(leaves).backward(g))  # noqa: B023
            record.update(
                fwd_ms=round(fwd_ms, 3),
                fwd_bwd_ms=round(both_ms, 3),
                tflops_fwd=round(flops_fwd / fwd_ms / 1e9, 1),
                tflops_fwd_bwd=round(3.5 * flops_fwd / both_ms / 1e9, 1),
            )
        except Exception as exc:  # noqa: BLE001 - report and go on with the next one
            record["error"] = f"{type(exc).__name__}: {exc}"[:400]
        print(json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
