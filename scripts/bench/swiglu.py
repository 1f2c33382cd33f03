"""Benchmark SwiGLU (kernels.swiglu, Triton) against upstream's compiled functions, one GPU.

    python -m scripts.bench.swiglu [--tree MEGATRON_TREE] [--shapes 32768x5504] [--json F]
    TRITON_INTERPRET=1 python -m scripts.bench.swiglu --smoke   # tiny CPU run, checks it works

``upstream`` is ``swiglu`` / ``swiglu_back`` of ``megatron/core/fusions/fused_bias_swiglu.py``
imported from ``--tree`` (``torch.compile``-d by upstream's ``jit_fuser``: what an unpatched
tree runs); without ``--tree`` the same math compiled here stands in. ``triton`` is
``kernels.swiglu``. Shapes are ``rows x F`` (the input is ``rows x 2F``): the 0.85B Llama of
``train_small.py`` (micro-batch 16 x seq 2048 rows, F 5504) and Llama-3 8B's F at 8k tokens.

Each time is the median of ``triton.testing.do_bench``; ``%`` is the bandwidth reached against
the ideal byte count (forward: read 2F, write F; backward: read 3F, write 2F per row) as a share
of the copy bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from megatron_rocm.runtime.kernels import swiglu
from scripts.bench import timing as bench_timing

DEVICE = "cuda"


def local_reference() -> tuple[Callable, Callable]:
    """SwiGLU forward/backward in torch, compiled on a GPU as upstream's ``jit_fuser`` does."""

    def forward(y: torch.Tensor) -> torch.Tensor:
        a, b = torch.chunk(y, 2, -1)
        return F.silu(a) * b

    def backward(g: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        a, b = torch.chunk(y, 2, -1)
        s = torch.sigmoid(a)
        return torch.cat((g * s * (1 + a * (1 - s)) * b, g * F.silu(a)), -1)

    if DEVICE == "cpu":
        return forward, backward
    return torch.compile(forward), torch.compile(backward)


def upstream_reference(tree: Path) -> tuple[Callable, Callable]:
    sys.path.insert(0, str(tree))
    from megatron.core.fusions.fused_bias_swiglu import swiglu as fwd  # type: ignore
    from megatron.core.fusions.fused_bias_swiglu import swiglu_back as bwd  # type: ignore

    return fwd, bwd


def row(shape: tuple[int, int], reference: tuple[Callable, Callable], copy_gbs: float) -> dict:
    rows, ffn = shape
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    y = torch.randn((rows, 2 * ffn), generator=gen, device=DEVICE).to(torch.bfloat16)
    g = torch.randn((rows, ffn), generator=gen, device=DEVICE).to(torch.bfloat16)
    ref_fwd, ref_bwd = reference
    fwd_bytes, bwd_bytes = 3 * rows * ffn * 2, 5 * rows * ffn * 2
    out: dict = {"shape": f"{rows}x{ffn}"}
    if DEVICE != "cpu":
        torch._dynamo.reset()  # upstream compiles for this shape, as in a run with one shape
    providers = {
        "upstream": (lambda: ref_fwd(y), lambda: ref_bwd(g, y)),
        "triton": (lambda: swiglu.forward(y, ref_fwd), lambda: swiglu.backward(g, y, ref_bwd)),
    }
    for name, (fwd, bwd) in providers.items():
        for pass_name, fn, nbytes in (("fwd", fwd, fwd_bytes), ("bwd", bwd, bwd_bytes)):
            ms = bench_timing.median_ms(fn, DEVICE)
            out[f"{name}_{pass_name}_ms"] = round(ms, 4)
            out[f"{name}_{pass_name}_pct"] = round(100 * nbytes / ms / 1e6 / copy_gbs, 1)
    # Same numbers as the reference, to the rounding of one op (both compute in fp32).
    torch.testing.assert_close(providers["triton"][0](), ref_fwd(y), rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(providers["triton"][1](), ref_bwd(g, y), rtol=1.6e-2, atol=1e-2)
    return out


def main(argv: list[str] | None = None) -> int:
    global DEVICE
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", type=Path, help="Megatron-LM tree whose swiglu to time")
    parser.add_argument("--shapes", default="32768x5504,8192x14336")
    parser.add_argument("--json", type=Path, help="write the rows here (JSON lines)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU interpreter")
    a = parser.parse_args(argv)
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
    if a.smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":
            print("bench_swiglu: --smoke runs on the CPU under TRITON_INTERPRET=1")
            return 3
        DEVICE, shapes = "cpu", [(8, 96)]
    elif not torch.cuda.is_available():
        print("bench_swiglu: needs a CUDA or ROCm GPU (or --smoke under TRITON_INTERPRET=1)")
        return 3
    reference = upstream_reference(a.tree) if a.tree else local_reference()
    label = "cpu (interpreter)" if DEVICE == "cpu" else torch.cuda.get_device_name(0)
    copy_gbs = bench_timing.copy_bandwidth(max(r * f for r, f in shapes) * 4, DEVICE)
    source = f"upstream = {a.tree}" if a.tree else "upstream = the same math compiled here"
    print(f"# {label}, copy bandwidth {copy_gbs:.0f} GB/s, {source}")
    print(
        "| rows x F | upstream fwd ms (%) | triton fwd ms (%) | upstream bwd ms (%) "
        "| triton bwd ms (%) |"
    )
    print("|---|---|---|---|---|")
    rows = []
    for shape in shapes:
        r = row(shape, reference, copy_gbs)
        r["device"] = label
        rows.append(r)
        print(
            f"| {r['shape']} | {r['upstream_fwd_ms']} ({r['upstream_fwd_pct']}) "
            f"| {r['triton_fwd_ms']} ({r['triton_fwd_pct']}) | {r['upstream_bwd_ms']} "
            f"({r['upstream_bwd_pct']}) | {r['triton_bwd_ms']} ({r['triton_bwd_pct']}) |"
        )
    if a.json:
        a.json.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
