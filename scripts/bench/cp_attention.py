"""Attention TFLOP/s of context-parallel attention vs single-GPU SDPA at the same total length.

    torchrun --nproc-per-node 2 scripts/bench/cp_attention.py [--lengths 8192,16384,32768]
        [--comm p2p,all_gather,a2a] [--kernels auto,cudnn] [--heads 32/8] [--a2a-stages 1,2,4]
        [--a2a-transports process-group,copy-engine] [--json FILE]

Llama-ish shapes: batch 1, 32 query heads, 8 kv groups (``--heads Q/KV``: 64/8 is
Llama-2-70B's layer), head dim 128, bf16, causal, forward + backward. Per total length L,
every rank first times single-GPU SDPA over all L tokens
(``kernels.local_sdpa.sdpa_attention``, what the native backend runs without CP), then the
ranks together time ``context_parallel_attention`` with L / cp tokens each, in Megatron's
zigzag layout, for each comm type and block kernel (``--kernels``: values of
``MEGATRON_ROCM_CP_KERNEL``), and for a2a each count of head groups it pipelines
(``--a2a-stages``: values of ``MEGATRON_ROCM_CP_A2A_STAGES``; ``default`` leaves it unset; a
case named ``..._sN`` asked for N, and ``stages`` says how many ran) and each way of
exchanging (``--a2a-transports``: values of ``MEGATRON_ROCM_CP_A2A_TRANSPORT``; a case named
``..._process-group`` or ``..._copy-engine`` asked for it, and ``transport`` says which ran).
The single-GPU SDPA is also timed
with its flash and cuDNN backends forced (``sdpa_1gpu_flash``, ``sdpa_1gpu_cudnn``, where the
build has them): a CP block kernel slower than the backend SDPA picks makes CP look sub-linear.
One JSON line per case, with the device named:

* ``ms``: median wall time of forward + backward (the slowest rank's, for CP);
* ``gflop``: the causal attention's FLOPs at this length and ``heads`` (all GPUs together);
* ``tflops_per_gpu``: causal attention FLOPs (forward ``2 * 2 * b * h * L^2 * d / 2``,
  backward 2.5x forward) / number of GPUs / time. Near-linear CP keeps this close to the
  single-GPU figure; ``speedup`` = single-GPU ms / CP ms (cp is ideal);
* ``max_abs_err``: CP output vs the single-GPU output on the same data (bf16 rounding only);
* ``kv_heads``: how the CP case's block kernel took the grouped kv heads,
  ``native`` (as they are) or ``expanded`` (copied per query head first). ``KERNEL:expanded``
  in ``--kernels`` (e.g. ``cudnn:expanded``) makes that kernel expand them for the case: what
  grouping natively saves.

``--ops N`` adds each case's N costliest ops (``top_ops``: name, ms and calls per forward +
backward; GPU kernel time on a GPU, CPU time on the CPU) from ``torch.profiler``: where the
ring's time goes that one SDPA call does not spend.

``--cpu`` runs the same code on gloo with tiny lengths (a check of the script, not a benchmark).
Needs no network; takes well under two minutes on H100/H200.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from megatron_rocm.runtime.backend.cp import a2a as _cp_a2a
from megatron_rocm.runtime.backend.cp import copy_engine as _cp_copy_engine
from megatron_rocm.runtime.backend.cp.block_attention import (
    BlockKernel,
    pick_kernel,
)
from megatron_rocm.runtime.backend.cp.dispatch import (
    context_parallel_attention,
    zigzag_shard,
)
from megatron_rocm.runtime.backend.cp.ring import bhsd
from megatron_rocm.runtime.kernels.local_sdpa import sdpa_attention
from scripts.bench import attention as bench_attention
from scripts.bench import timing

HEADS, GROUPS, DIM, BATCH = 32, 8, 128, 1


def causal_flops(length: int, heads: int) -> float:
    return bench_attention.Shape(BATCH, length, heads, heads, DIM).flops


def timed(fn: Callable[[], object], iters: int, device: torch.device, warmup: int = 2) -> float:
    """Median milliseconds of ``fn`` (CUDA events on a GPU, wall clock on the CPU)."""
    return timing.sampled_ms(fn, iters, device, warmup=warmup)


def top_ops(fn: Callable[[], object], device: torch.device, top: int, runs: int = 2) -> list:
    """The ``top`` ops of ``fn`` by self time (device time of the kernels on a GPU), per run."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(runs):
            fn()
        if cuda:
            torch.cuda.synchronize()
    names = ("self_device_time_total", "self_cuda_time_total") if cuda else ("self_cpu_time_total",)

    def self_us(event: object) -> float:
        return next((getattr(event, n) for n in names if hasattr(event, n)), 0.0)

    rows = [(e.key, self_us(e) / 1e3 / runs, e.count / runs) for e in prof.key_averages()]
    rows = sorted((r for r in rows if r[1] > 0), key=lambda r: -r[1])[:top]
    return [[name[:120], round(ms, 4), round(calls, 1)] for name, ms, calls in rows]


def slowest(ms: float, device: torch.device) -> float:
    value = torch.tensor([ms], device=device, dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return value.item()


def _forced_sdpa_backends(
    leaves: list[torch.Tensor], grad: torch.Tensor, scale: float, length: int, iters: int,
    device: torch.device,
) -> Iterator[dict]:  # fmt: skip
    """The one-GPU SDPA with each fast backend forced: which one the default dispatch took."""
    if device.type != "cuda":
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    for label, backend in (("flash", "FLASH_ATTENTION"), ("cudnn", "CUDNN_ATTENTION")):
        if not hasattr(SDPBackend, backend):
            continue

        def run(x: list = leaves, b: object = getattr(SDPBackend, backend)) -> None:
            with sdpa_kernel(b):
                sdpa_attention(*x, None, "causal", scale).backward(grad)

        try:
            ms = timed(run, iters, device)
        except RuntimeError as exc:  # the backend cannot take these inputs on this build
            yield {"case": f"sdpa_1gpu_{label}", "L": length, "error": str(exc)[:160]}
            continue
        flops = causal_flops(length, leaves[0].shape[2])
        yield {"case": f"sdpa_1gpu_{label}", "L": length, "ms": round(ms, 3),
               "tflops_per_gpu": round(flops / ms / 1e9, 2)}  # fmt: skip


def bench_length(
    length: int,
    comms: list[str],
    iters: int,
    device: torch.device,
    dtype: torch.dtype,
    kernels: list[str],
    ops: int = 0,
    heads: int = HEADS,
    groups: int = GROUPS,
    a2a_stages: tuple[str, ...] = ("default",),
    a2a_transports: tuple[str, ...] = ("auto",),
) -> Iterator[dict]:
    """Single-GPU SDPA, then CP attention per comm type, all at ``length`` tokens in total."""
    rank, cp = dist.get_rank(), dist.get_world_size()
    scale = DIM**-0.5
    gen = torch.Generator(device=device).manual_seed(length)
    shapes = {"q": heads, "k": groups, "v": groups}
    full = {
        n: torch.randn(length, BATCH, h, DIM, generator=gen, device=device, dtype=dtype)
        for n, h in shapes.items()
    }
    full["g"] = torch.randn(length, BATCH, heads * DIM, generator=gen, device=device, dtype=dtype)
    leaves = [full[n].clone().requires_grad_() for n in "qkv"]
    single_out = sdpa_attention(*leaves, None, "causal", scale).detach()

    def single_step(x: list = leaves) -> None:
        sdpa_attention(*x, None, "causal", scale).backward(full["g"])

    single_ms = timed(single_step, iters, device)
    flops = causal_flops(length, heads)
    single = {"case": "sdpa_1gpu", "L": length, "ms": round(single_ms, 3),
              "tflops_per_gpu": round(flops / single_ms / 1e9, 2)}  # fmt: skip
    if ops:
        single["top_ops"] = top_ops(single_step, device, ops)
    yield single
    yield from _forced_sdpa_backends(leaves, full["g"], scale, length, iters, device)
    del leaves  # free the single-GPU tensors before the CP cases
    local = {n: zigzag_shard(t, cp, rank) for n, t in full.items()}
    expected = zigzag_shard(single_out, cp, rank).float()
    cases = [
        (comm, kernel, stages, transport)
        for comm in comms
        for kernel in kernels
        for stages in (a2a_stages if comm == "a2a" else ["default"])
        for transport in (a2a_transports if comm == "a2a" else ["auto"])
    ]
    for comm, spec, stages, transport in cases:
        kernel_name, _, variant = spec.partition(":")
        os.environ["MEGATRON_ROCM_CP_KERNEL"] = kernel_name
        os.environ.pop(_cp_a2a.STAGES_ENV, None)
        if stages != "default":
            os.environ[_cp_a2a.STAGES_ENV] = stages
        os.environ[_cp_copy_engine.TRANSPORT_ENV] = transport
        _cp_copy_engine.decide_again()  # the transport is decided once per group
        cp_leaves = [local[n].clone().requires_grad_() for n in "qkv"]
        q, k, v = (bhsd(x) for x in cp_leaves)
        kernel = pick_kernel(q, k, v, 0.0)
        with grouped_heads(kernel, q, k, expanded=variant == "expanded") as kv_heads:
            label = f"cp{cp}_{comm}_{kernel.name}" + ("_expanded" if variant == "expanded" else "")
            label += "" if stages == "default" else f"_s{stages}"
            label += "" if transport == "auto" else f"_{transport}"
            record = {"case": label, "L": length, "kernel": kernel.name, "kv_heads": kv_heads}
            record = _timed_cp_case(
                record, comm, cp_leaves, local["g"], expected, single_ms, scale, iters, device,
                ops,
            )  # fmt: skip
            if comm == "a2a":
                used = _cp_copy_engine.uses_copy_engines(None)  # the cases run on WORLD
                record["transport"] = "copy-engine" if used else "process-group"
                record["stages"] = _cp_a2a.stage_count(heads, groups, cp, copy_engines=used)
            yield record
    os.environ.pop(_cp_a2a.STAGES_ENV, None)
    os.environ.pop(_cp_copy_engine.TRANSPORT_ENV, None)


@contextlib.contextmanager
def grouped_heads(
    kernel: BlockKernel, q: torch.Tensor, k: torch.Tensor, *, expanded: bool
) -> Iterator[str]:
    """How ``kernel`` takes grouped kv heads in this case: "native" or "expanded".
    ``expanded`` makes it expand them for the case (``cudnn:expanded``: what cuDNN blocks did
    before their grouped-head probe)."""
    if expanded:
        kernel.native_gqa = lambda q, k: False  # an instance attribute shadows the method
    try:
        yield "native" if kernel.native_gqa(q, k) else "expanded"
    finally:
        kernel.__dict__.pop("native_gqa", None)


def _timed_cp_case(
    record: dict, comm: str, cp_leaves: list, grad: torch.Tensor, expected: torch.Tensor,
    single_ms: float, scale: float, iters: int, device: torch.device, ops: int,
) -> dict:  # fmt: skip
    """``record`` with one CP case's time, its error against the one-GPU output, its ops."""
    cp = dist.get_world_size()

    def run() -> torch.Tensor:
        return context_parallel_attention(
            *cp_leaves, cp_group=None, causal=True, softmax_scale=scale, comm_type=comm
        )

    err = (run().detach().float() - expected).abs().max()
    dist.all_reduce(err, op=dist.ReduceOp.MAX)
    dist.barrier()

    def step() -> None:
        run().backward(grad)

    ms = slowest(timed(step, iters, device), device)
    flops = causal_flops(record["L"], cp_leaves[0].shape[2])
    record.update(ms=round(ms, 3), tflops_per_gpu=round(flops / cp / ms / 1e9, 2),
                  speedup=round(single_ms / ms, 3), max_abs_err=float(f"{err.item():.3g}"))  # fmt: skip
    if ops:  # every rank profiles (the ring needs its peer); rank 0's ops are reported
        record["top_ops"] = top_ops(step, device, ops)
    return record


def _heads(text: str) -> tuple[int, int]:
    """``Q/KV`` -> (query heads, kv heads); the query heads must group over the kv heads."""
    try:
        heads, groups = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not Q/KV, e.g. 64/8") from None
    if heads < 1 or groups < 1 or heads % groups:
        raise argparse.ArgumentTypeError(f"{heads} query heads do not group over {groups} kv heads")
    return heads, groups


def _stages(text: str) -> tuple[str, ...]:
    """``1,2,default`` -> the a2a head-group counts to time (positive whole numbers)."""
    values = tuple(v.strip() for v in text.split(","))
    bad = [v for v in values if v != "default" and _cp_a2a.parse_stage_count(v) is None]
    if bad:
        raise argparse.ArgumentTypeError(f"{', '.join(bad)}: not 'default' or a whole number >= 1")
    return values


def _transports(text: str) -> tuple[str, ...]:
    """``process-group,copy-engine`` -> the a2a transports to time."""
    values = tuple(v.strip() for v in text.split(","))
    bad = [v for v in values if v not in _cp_copy_engine.TRANSPORTS]
    if bad:
        raise argparse.ArgumentTypeError(
            f"{', '.join(bad)}: not one of {', '.join(_cp_copy_engine.TRANSPORTS)}"
        )
    return values


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="8192,16384,32768")
    parser.add_argument("--comm", default="p2p,all_gather,a2a")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument(
        "--kernels", default="auto", help="CP block kernels (MEGATRON_ROCM_CP_KERNEL values)"
    )
    parser.add_argument("--json", help="also append the JSON lines to this file (rank 0)")
    parser.add_argument(
        "--ops", type=int, default=0, help="add each case's N costliest ops (torch.profiler)"
    )
    parser.add_argument(
        "--heads",
        type=_heads,
        default=(HEADS, GROUPS),
        help=f"query/kv heads (default {HEADS}/{GROUPS}; Llama-2-70B's layer: 64/8)",
    )
    parser.add_argument(
        "--a2a-stages",
        type=_stages,
        default=("default",),
        help="head groups a2a pipelines, per case (MEGATRON_ROCM_CP_A2A_STAGES values; "
        "'default' leaves it unset)",
    )
    parser.add_argument(
        "--a2a-transports",
        type=_transports,
        default=("auto",),
        help="how a2a exchanges, per case (MEGATRON_ROCM_CP_A2A_TRANSPORT values)",
    )
    parser.add_argument("--cpu", action="store_true", help="gloo + tiny lengths: checks the script")
    args = parser.parse_args()
    for spec in args.kernels.split(","):  # before any set-up: a typo must not cost a run
        if spec.partition(":")[2] not in ("", "expanded"):
            parser.error(f"--kernels {spec}: the only variant is KERNEL:expanded")

    if args.cpu:
        dist.init_process_group("gloo")
        device, dtype = torch.device("cpu"), torch.float32
    else:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl")
        device, dtype = torch.device("cuda", torch.cuda.current_device()), torch.bfloat16
    rank, cp = dist.get_rank(), dist.get_world_size()
    name = "cpu" if args.cpu else torch.cuda.get_device_name(device)
    lengths = [int(x) for x in args.lengths.split(",")]
    sink = open(args.json, "a") if args.json and rank == 0 else None  # noqa: SIM115

    def emit(record: dict) -> None:
        if rank == 0:
            line = json.dumps({"bench": "cp_attention", "device": name, "gpus": cp, **record})
            print(line, flush=True)
            if sink:
                sink.write(line + "\n")

    comms, kernels = args.comm.split(","), args.kernels.split(",")
    for length in lengths:
        cases = bench_length(
            length, comms, args.iters, device, dtype, kernels, args.ops, *args.heads,
            a2a_stages=args.a2a_stages, a2a_transports=args.a2a_transports,
        )  # fmt: skip
        for record in cases:
            gflop = round(causal_flops(length, args.heads[0]) / 1e9, 3)
            emit({**record, "heads": "/".join(map(str, args.heads)), "gflop": gflop})
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if sink:
        sink.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
