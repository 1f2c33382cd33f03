"""Benchmark the norms (kernels.norm, Triton) against torch's fused kernels, one GPU.

    python -m scripts.bench.norm [--shapes 32768x1536,16384x4096] [--programs 1,2,4,8] [--json F]
                                 [--cudagraph]
    TRITON_INTERPRET=1 python -m scripts.bench.norm --smoke   # tiny CPU run, checks it works

Inputs: the 0.85B Llama's residual stream (s 2048 x micro-batch 16 = 32768 rows of 1536, bf16)
and two wider hidden sizes, for RMSNorm and LayerNorm, through ``FusedNorm`` (what the patched
tree's norms and the native backend's ``TELayerNormColumnParallelLinear`` run).

Providers: ``triton`` is ``FusedNorm`` on the Triton kernel (what RMSNorm runs on a GPU from
``norm.TRITON_NORM_MIN_ELEMENTS`` per call; the bench names both norms in
``MEGATRON_ROCM_TRITON_NORMS``, which routes them at every size); ``torch`` is the same
module with ``MEGATRON_ROCM_KERNELS=reference`` (torch's ``rms_norm`` / ``layer_norm``).
``backward`` is ``torch.autograd.grad`` of the output w.r.t. the input and the params.
``--programs`` times the Triton backward alone at other programs-per-SM counts and pipelining
depths (the shipped ones are ``_norm_triton.PROGRAMS_PER_SM`` and ``BACKWARD_STAGES``), to
re-tune them on new hardware.

Each time is the median of ``triton.testing.do_bench``, or with ``--cudagraph`` of CUDA-graph
replays (``do_bench_cudagraph``): a norm's kernel takes about 0.1 ms, no longer than the Python
that launches it, so without graphs the whole-op rows time the host as much as the kernel. Under
graphs the whole-op backward is the replay of forward and backward less the forward's, which
can read a little low (the forward leaves part of ``x`` in L2 for the backward). ``%`` is the
bandwidth reached against the ideal byte count (forward: read x, write y; backward: read x and
dy, write dx) as a share of the copy bandwidth measured in the same run (read + write).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import torch

from megatron_rocm.runtime.kernels import norm_triton as tri
from megatron_rocm.runtime.kernels.launch import sm_count
from megatron_rocm.runtime.kernels.norm import TRITON_NORMS_ENV, FusedNorm
from scripts.bench import timing as bench_timing

DEVICE = "cuda"
STAGES = (1, 2, 3)  # the backward's pipelining depths timed next to the shipped one
CUDA_GRAPH = False  # --cudagraph: time graph replays, without the host's launch overhead


def graphs() -> bool:
    """Whether times are CUDA-graph replays (``--cudagraph`` on a GPU; the CPU has none)."""
    return CUDA_GRAPH and DEVICE != "cpu"


def bench(fn: Callable[[], object]) -> float:
    return bench_timing.median_ms(fn, DEVICE, cuda_graph=graphs())


def copy_bandwidth(nbytes: int) -> float:
    return bench_timing.copy_bandwidth(nbytes, DEVICE, cuda_graph=graphs())


def measure(norm: FusedNorm, x: torch.Tensor, mode: str) -> tuple[float, float]:
    """(forward ms, backward ms) of ``norm`` under ``MEGATRON_ROCM_KERNELS=mode``."""
    # LayerNorm too: time the kernel on both norms
    with bench_timing.environment(
        MEGATRON_ROCM_KERNELS=mode, **{TRITON_NORMS_ENV: "LayerNorm,RMSNorm"}
    ):
        dy = torch.randn_like(x)
        params = list(norm.parameters())
        fwd = bench(lambda: norm(x))
        if graphs():
            # Autograd runs each backward op on its forward op's stream, so a graph captured on
            # a side stream must hold the forward too: the backward is the difference.
            both = bench(lambda: torch.autograd.grad(norm(x), [x, *params], dy))
            return fwd, both - fwd
        y = norm(x)
        bwd = bench(lambda: torch.autograd.grad(y, [x, *params], dy, retain_graph=True))
        return fwd, bwd


def row(shape: tuple[int, int], normalization: str, copy_gbs: float, programs: list[int]) -> dict:
    rows, columns = shape
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    x = torch.randn(shape, generator=gen, device=DEVICE).to(torch.bfloat16).requires_grad_()
    norm = FusedNorm(
        columns, normalization=normalization, params_dtype=torch.bfloat16, device=DEVICE
    )
    nbytes = x.numel() * x.element_size()
    out: dict = {"shape": f"{rows}x{columns}", "norm": normalization}
    for mode, name in (("auto", "triton"), ("reference", "torch")):
        fwd, bwd = measure(norm, x, mode)
        out[f"{name}_fwd_ms"], out[f"{name}_bwd_ms"] = round(fwd, 4), round(bwd, 4)
        out[f"{name}_fwd_pct"] = round(100 * 2 * nbytes / fwd / 1e6 / copy_gbs, 1)
        out[f"{name}_bwd_pct"] = round(100 * 3 * nbytes / bwd / 1e6 / copy_gbs, 1)
    is_rms = normalization == "RMSNorm"
    x2d = x.detach()
    _, mean, rstd = tri.norm_forward(x2d, norm.weight, norm.bias, norm.eps, is_rms)
    dy = torch.randn_like(x2d)
    sms = sm_count(x2d.device)
    for per_sm in programs:
        for stages in STAGES:
            ms = bench(
                lambda per_sm=per_sm, stages=stages: tri.norm_backward(
                    dy, x2d, norm.weight, mean, rstd, not is_rms, is_rms, per_sm * sms, stages
                )
            )
            out[f"bwd_kernel_ms_{per_sm}_per_sm_{stages}_stages"] = round(ms, 4)
    return out


def main(argv: list[str] | None = None) -> int:
    global DEVICE, CUDA_GRAPH
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="32768x1536,16384x4096,8192x8192")
    parser.add_argument("--programs", default="1,2,4,8", help="backward programs per SM to time")
    parser.add_argument("--json", type=Path, help="write the rows here (JSON lines)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU interpreter")
    parser.add_argument(
        "--cudagraph", action="store_true", help="time CUDA-graph replays (no launch overhead)"
    )
    a = parser.parse_args(argv)
    CUDA_GRAPH = a.cudagraph
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
    programs = [int(p) for p in a.programs.split(",")]
    if a.smoke:
        DEVICE, shapes, programs = "cpu", [(64, 96)], [1]
    elif not torch.cuda.is_available():
        print("bench_norm: needs a CUDA or ROCm GPU (or --smoke under TRITON_INTERPRET=1)")
        return 3
    label = "cpu (interpreter)" if DEVICE == "cpu" else torch.cuda.get_device_name(0)
    copy_gbs = copy_bandwidth(max(r * c for r, c in shapes) * 2)
    timing = (
        "CUDA-graph replays" if graphs() else "one wall-clock sample" if a.smoke else "do_bench"
    )
    print(f"# {label}, copy bandwidth {copy_gbs:.0f} GB/s, {timing}")
    print(
        "| norm | rows x cols | torch fwd ms (%) | triton fwd ms (%) | torch bwd ms (%) "
        "| triton bwd ms (%) |"
    )
    print("|---|---|---|---|---|---|")
    rows = []
    for normalization in ("RMSNorm", "LayerNorm"):
        for shape in shapes:
            r = row(shape, normalization, copy_gbs, programs)
            r["device"], r["cuda_graph"] = label, graphs()
            rows.append(r)
            print(
                f"| {normalization} | {r['shape']} | {r['torch_fwd_ms']} ({r['torch_fwd_pct']}) "
                f"| {r['triton_fwd_ms']} ({r['triton_fwd_pct']}) | {r['torch_bwd_ms']} "
                f"({r['torch_bwd_pct']}) | {r['triton_bwd_ms']} ({r['triton_bwd_pct']}) |"
            )
            sweep = {k: v for k, v in r.items() if k.startswith("bwd_kernel_ms_")}
            print(f"  backward kernel alone by programs per SM: {sweep}")
    if a.json:
        a.json.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
