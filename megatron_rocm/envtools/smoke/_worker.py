"""One rank of the collectives check, started by ``checks_collectives`` with a torchrun-like env
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT). Writes ``<out>/rank<N>.json``:
``{"collectives": [ok, detail], "tensor_parallel": [ok, detail]}``.

A separate process per rank (not threads) because NCCL/RCCL needs one device per process.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

FAULT = os.environ.get("MEGATRON_ROCM_SMOKE_FAULT") or None


def _mismatch(label: str, got: torch.Tensor, want: torch.Tensor, atol: float = 0.0) -> list[str]:
    """Return the problem instead of raising: a rank that stopped early would hang the others."""
    if got.shape == want.shape and torch.allclose(got.float(), want.float(), atol=atol, rtol=0):
        return []
    err = (got.float() - want.float()).abs().max().item() if got.shape == want.shape else "-"
    return [f"{label}: wrong result on rank {dist.get_rank()} (max err {err})"]


def _raise(errors: list[str]) -> None:
    if errors:
        raise AssertionError("; ".join(errors))


def collectives(device: torch.device) -> str:
    """all_reduce, all_gather and reduce_scatter with results every rank can predict."""
    rank, world = dist.get_rank(), dist.get_world_size()
    n = 1 << 20 if device.type == "cuda" else 1024
    t = torch.full((n,), float(rank + 1), device=device)
    dist.all_reduce(t)
    if FAULT == "allreduce" and rank == 0:
        t[0] += 1.0  # MEGATRON_ROCM_SMOKE_FAULT=allreduce: a corrupted reduction must be caught
    errors = _mismatch("all_reduce(sum)", t, torch.full_like(t, world * (world + 1) / 2))

    mine = torch.arange(n, device=device, dtype=torch.float32) + 1000 * rank
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)
    for r, g in enumerate(gathered):
        want = torch.arange(n, device=device, dtype=torch.float32) + 1000 * r
        errors += _mismatch(f"all_gather[{r}]", g, want)

    chunks = [torch.full((n,), float(rank * world + c), device=device) for c in range(world)]
    out = torch.empty(n, device=device)
    dist.reduce_scatter(out, chunks)
    want = sum(float(r * world + rank) for r in range(world))
    errors += _mismatch("reduce_scatter(sum)", out, torch.full_like(out, want))
    _raise(errors)
    return f"all_reduce, all_gather, reduce_scatter of {n} floats on {world} ranks"


def tensor_parallel(device: torch.device) -> str:
    """ColumnParallelLinear -> gelu -> RowParallelLinear at TP=world vs the one-device math."""
    from megatron.core import ModelParallelConfig, parallel_state
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    rank, world = dist.get_rank(), dist.get_world_size()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    if device.type == "cuda":  # the RNG tracker is CUDA-only; CPU runs are for our own tests
        model_parallel_cuda_manual_seed(1234)
    h, f = 64, 128 * world
    g = torch.Generator().manual_seed(7)  # every rank draws the same full weights
    w1, b1 = torch.randn(f, h, generator=g) / h**0.5, torch.randn(f, generator=g)
    w2, b2 = torch.randn(h, f, generator=g) / f**0.5, torch.randn(h, generator=g)
    x = torch.randn(8, 3, h, generator=g)
    config = ModelParallelConfig(
        tensor_model_parallel_size=world,
        params_dtype=torch.float32,
        use_cpu_initialization=True,
        perform_initialization=False,
    )
    init = torch.nn.init.zeros_
    col = ColumnParallelLinear(
        h, f, config=config, init_method=init, bias=True, gather_output=False
    ).to(device)
    row = RowParallelLinear(
        f,
        h,
        config=config,
        init_method=init,
        bias=True,
        input_is_parallel=True,
        skip_bias_add=False,
    ).to(device)
    shard = f // world
    with torch.no_grad():
        col.weight.copy_(w1[rank * shard : (rank + 1) * shard])
        col.bias.copy_(b1[rank * shard : (rank + 1) * shard])
        row.weight.copy_(w2[:, rank * shard : (rank + 1) * shard])
        row.bias.copy_(b2)
    xd = x.clone().to(device).requires_grad_()
    y, _ = row(torch.nn.functional.gelu(col(xd)[0]))
    y.sum().backward()

    xr = x.clone().requires_grad_()
    lin, gelu = torch.nn.functional.linear, torch.nn.functional.gelu
    yr = lin(gelu(lin(xr, w1, b1)), w2, b2)
    yr.sum().backward()
    # 2e-3: the GPU may run fp32 matmuls in TF32; a wrong shard or a missing reduction is O(1).
    _raise(
        _mismatch("TP forward", y.detach().cpu(), yr.detach(), atol=2e-3)
        + _mismatch("TP input grad", xd.grad.cpu(), xr.grad, atol=2e-3)
    )
    parallel_state.destroy_model_parallel()
    return f"Column+RowParallelLinear at TP={world} matches one-device math (fwd + input grad)"


def _run(name: str, fn: Callable[[torch.device], str], device: torch.device) -> list:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return [True, fn(device)]
    except Exception as e:  # noqa: BLE001 - reported to the parent as this rank's result
        tb = traceback.extract_tb(e.__traceback__)
        where = f" (at {Path(tb[-1].filename).name}:{tb[-1].lineno})" if tb else ""
        return [False, f"{type(e).__name__}: {e}{where}"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="nccl")
    ap.add_argument("--out", required=True)
    ap.add_argument("--tree", default=None)
    ap.add_argument("--tests", default="collectives")
    args = ap.parse_args(argv)
    if args.tree:
        sys.path.insert(0, args.tree)
    local = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local) if args.backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(args.backend, timeout=datetime.timedelta(seconds=120))
    results = {}
    for name in args.tests.split(","):
        fn = {"collectives": collectives, "tensor_parallel": tensor_parallel}[name]
        results[name] = _run(name, fn, device)
    Path(args.out, f"rank{dist.get_rank()}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
