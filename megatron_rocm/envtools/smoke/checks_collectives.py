"""Multi-GPU checks: one worker process per GPU (``_worker.py``), torchrun-style environment.

Workers get ``NCCL_NVLS_ENABLE=0`` (NVLink multicast is off on the lent machines and absent on
AMD) and ``MASTER_ADDR=127.0.0.1``; each writes its verdict to a JSON file, so a rank that dies
or hangs is reported with its own output instead of a bare timeout.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from megatron_rocm.envtools.smoke.runner import CheckFailed, Context, register
from megatron_rocm.envtools.smoke.world import start_world, tail

MAX_WORLD = 8


def run_world(
    world: int, backend: str, test: str, tree: Path | None = None, timeout: float = 180.0
) -> str:
    """Run ``test`` on ``world`` ranks; return rank 0's detail or raise with the first failure."""
    with tempfile.TemporaryDirectory(prefix="megatron-rocm-smoke-") as out:
        cmd = [sys.executable, "-m", "megatron_rocm.envtools.smoke._worker"]
        cmd += ["--backend", backend, "--out", out, "--tests", test]
        cmd += ["--tree", str(tree)] if tree else []
        logs = [Path(out, f"rank{r}.log") for r in range(world)]
        outputs = [Path(out, f"rank{r}.json") for r in range(world)]
        timed_out = start_world(cmd, world, {}, logs, timeout, outputs)
        results = {r: json.loads(f.read_text())[test] for r, f in enumerate(outputs) if f.is_file()}
        tails = [tail(log, 3) for log in logs]
    for r in range(world):
        if r not in results:
            why = f"timed out after {timeout:.0f}s" if timed_out else "died"
            raise CheckFailed(f"rank {r} {why} without a result: {tails[r]}")
        ok, detail = results[r]
        if not ok:
            raise CheckFailed(f"rank {r}: {detail}")
    return results[0][1]


@register("collectives.nccl")
def nccl(ctx: Context) -> str:
    """all_reduce / all_gather / reduce_scatter over every visible GPU (NCCL or RCCL)."""
    ctx.needs_gpu(2, "the collectives check")
    return run_world(min(ctx.gpu_count, MAX_WORLD), "nccl", "collectives")


@register("collectives.tensor_parallel")
def tensor_parallel(ctx: Context) -> str:
    """Megatron Column+RowParallelLinear at TP=2 equals the single-GPU computation."""
    ctx.needs_gpu(2, "the tensor-parallel check")
    return run_world(2, "nccl", "tensor_parallel", ctx.needs_tree())
