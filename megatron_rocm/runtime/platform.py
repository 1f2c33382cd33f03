"""Which GPU stack is this? Decided by ``torch.version.hip``, importable without torch."""

from __future__ import annotations


def torch_or_none():  # noqa: ANN201 - returns the torch module or None
    """Import torch lazily: the patch manager must run on machines without it."""
    try:
        import torch
    except ImportError:
        return None
    return torch


def is_rocm() -> bool:
    """True on a ROCm (HIP) build of PyTorch. Tests simulate it by setting ``torch.version.hip``."""
    torch = torch_or_none()
    return bool(torch is not None and getattr(torch.version, "hip", None))


def has_gpu() -> bool:
    """A CUDA or ROCm device is visible (ROCm PyTorch exposes it through ``torch.cuda``)."""
    torch = torch_or_none()
    return bool(torch is not None and torch.cuda.is_available())


def capturing(device) -> bool:  # noqa: ANN001 - a torch.device
    """Whether work queued on ``device`` now is being captured into a CUDA graph (Megatron's
    ``--cuda-graph-impl``): nothing may read a GPU value on the host then, nor wait on work
    the capture did not record."""
    torch = torch_or_none()
    return bool(
        torch is not None and device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    )
