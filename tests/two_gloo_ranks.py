"""Two spawned gloo ranks for the tests of collectives (CPU)."""

from __future__ import annotations

from megatron_rocm.envtools.smoke.world import free_port


def join(rank: int, port: int, timeout_s: float = 60) -> None:
    """This spawned process into a two-rank gloo group on ``port``."""
    import os
    from datetime import timedelta

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=timeout_s))


def two_ranks(target) -> list:  # noqa: ANN001 - a spawned process's function
    """``target(rank, port, results)`` on two spawned gloo ranks; what each put, rank 0's
    first. A rank that hangs or dies fails the test instead of hanging it."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, port, results)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        got = sorted(results.get(timeout=90) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    return got
