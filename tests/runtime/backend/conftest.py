"""Process worlds shared by the context-parallel test modules (``_cp_world``).

Imports stay inside the fixtures: modules of this folder that need no torch must still collect
where torch is missing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest


@pytest.fixture(scope="module")
def worlds() -> Iterator[Callable[[int], Any]]:
    """``worlds(n)``: a live gloo world of n ranks, started on first use, shared by the module."""
    from _cp_world import World

    live: dict[int, World] = {}

    def get(size: int) -> World:
        if size not in live or not live[size].alive:
            live[size] = World(size)
        return live[size]

    yield get
    for world in live.values():
        world.close()


@pytest.fixture(scope="module")
def gpu_world() -> Iterator[Any]:
    """Two ranks on two GPUs (NCCL, RCCL on ROCm); skips with fewer GPUs."""
    import torch
    from _cp_world import World

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA/ROCm GPUs")
    world = World(2, backend="nccl")
    yield world
    world.close()
