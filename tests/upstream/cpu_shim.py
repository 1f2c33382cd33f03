"""Run Megatron-core code that hard-codes ``device="cuda"`` on a CPU-only torch (tests only).

Megatron's DDP buffers, DistributedOptimizer and grad scaler allocate with
``device=torch.cuda.current_device()`` or ``device="cuda"`` and check ``param.type()`` for
``torch.cuda.*Tensor``. Under :class:`CudaOnCpu` every such request gets a CPU tensor and the
type names read as CUDA ones, so the real upstream code paths run on a gloo world. Nothing
here is imported by the package; it exists so CPU CI can exercise upstream code at all.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


class CudaOnCpu(TorchFunctionMode):
    """Map CUDA device requests to the CPU and report CPU tensors as CUDA typed."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda or func is torch.Tensor.pin_memory:
            return args[0]
        if kwargs.get("pin_memory"):  # pinned host memory only exists beside an accelerator
            kwargs["pin_memory"] = False
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if ".cuda." in name else name.replace("torch.", "torch.cuda.", 1)
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


class _NullStream:
    """A stream or event on which every call (wait_stream, record_event, ...) does nothing.
    A class, not a factory: trees from 0.19's dev on annotate ``torch.cuda.Stream | None``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        return lambda *a, **k: _NullStream()


def install() -> CudaOnCpu:
    """Enter the mode for the rest of the process and stub the stream, sync and RNG calls
    (Megatron's CUDA RNG tracker then keeps CPU generator states; dropout is off in tests)."""
    import contextlib

    torch.cuda.current_device = lambda: "cpu"  # also read inside autograd backward (no mode there)
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_stream = lambda *a, **k: _NullStream()
    torch.cuda.default_stream = lambda *a, **k: _NullStream()
    torch.cuda.Stream = _NullStream
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    torch.cuda.random.get_rng_state = torch.cuda.get_rng_state
    torch.cuda.Event = _NullStream
    torch.cuda.manual_seed = lambda *a, **k: None
    torch.cuda.manual_seed_all = lambda *a, **k: None
    _cpu_device_meshes()
    mode = CudaOnCpu()
    mode.__enter__()
    return mode


def _cpu_device_meshes() -> None:
    """torch FSDP2's wrapper asks for ``DeviceMesh.from_group(group, "cuda")``: a CPU mesh."""
    from torch.distributed import device_mesh

    original = device_mesh.DeviceMesh.from_group

    def from_group(group, device_type, *args, **kwargs):  # noqa: ANN001, ANN202
        return original(group, "cpu" if _is_cuda(device_type) else device_type, *args, **kwargs)

    device_mesh.DeviceMesh.from_group = staticmethod(from_group)
