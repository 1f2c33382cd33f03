"""Test-only: run a tree's ``pretrain_gpt.py`` (argv[1]) on a CPU-only torch, one gloo rank.

``cpu_shim`` maps Megatron's CUDA allocations to the CPU; on top of it Megatron's start-up
asks ``torch.cuda.is_available()`` (asserts it), sets the device and reads memory statistics,
which are answered here as a one-device CUDA box would (``CPU_PRETRAIN_CAPABILITY=9.0``: its
compute capability too, for FP8's argument validation); ``torch.compile`` (Megatron's JIT
fuser, warmed up on "cuda" tensors) runs the functions eagerly; gloo runs synchronous collectives
one at a time rather than coalesced (``_synchronous_ops_one_at_a_time``). The training code is
upstream's own.
"""

import contextlib
import os
import runpy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "upstream"))
import cpu_shim  # noqa: E402

cpu_shim.install()
torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: 1
torch.cuda.set_device = lambda *a, **k: None
torch.cuda.memory_allocated = lambda *a, **k: 0
torch.cuda.max_memory_allocated = lambda *a, **k: 0
torch.cuda.memory_reserved = lambda *a, **k: 0
torch.cuda.max_memory_reserved = lambda *a, **k: 0
torch.cuda.empty_cache = lambda: None
if capability := os.environ.get("CPU_PRETRAIN_CAPABILITY"):  # "9.0": what FP8 validation reads
    major, minor = (int(v) for v in capability.split("."))
    torch.cuda.get_device_capability = lambda *a, **k: (major, minor)


def _no_compile(func=None, **kwargs):  # noqa: ANN001, ANN202 - torch.compile's two call forms
    """Megatron's jit_fuser is torch.compile; its warm-up compiles for "cuda" tensors."""
    return func if func is not None else (lambda f: f)


torch.compile = _no_compile


class _Done:
    def wait(self) -> None:
        pass


_coalesced = torch.distributed._coalescing_manager


@contextlib.contextmanager
def _synchronous_ops_one_at_a_time(group=None, device=None, async_ops=False):  # noqa: ANN001, ANN202
    """gloo (torch 2.13) garbles a coalesced ``all_gather_into_tensor`` whose first tensor is
    uint8 and a later one is not: the bucket group ``--fp8-param-gather`` makes (the FP8
    weights' uint8 bucket, then the bf16 one). Synchronous ops run as issued instead (the same
    result); asynchronous ones still coalesce, their handle being the coalescing's."""
    if async_ops:
        with _coalesced(group, device, async_ops) as cm:
            yield cm
    else:
        yield _Done()


torch.distributed._coalescing_manager = _synchronous_ops_one_at_a_time

script = Path(sys.argv[1]).resolve()
sys.argv = [str(script), *sys.argv[2:]]
sys.path.insert(0, str(script.parent))
runpy.run_path(str(script), run_name="__main__")
