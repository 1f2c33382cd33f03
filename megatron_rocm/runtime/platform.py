"""Which GPU stack is this? Decided by ``torch.version.hip``, importable without torch."""

from __future__ import annotations


def torch_or_none():  # noqa: ANN201 - returns the torch module or None
    """Import torch lazily: the patch manager must run on machines without it."""
    try:
        import torch
    except ImportError:
        return None
    return torch


def import_torch():  # noqa: ANN201 - (the torch module or None, why it failed or None)
    """``(torch, None)``; ``(None, None)`` where torch is not installed; ``(None, reason)`` where
    it is installed but its import fails (on ROCm, typically a HIP library the loader cannot
    find), so that doctor and smoke can say so instead of "not installed" or a traceback."""
    try:
        import torch
    except Exception as e:  # noqa: BLE001 - any failure of an installed torch is reported
        import importlib.util

        if isinstance(e, ImportError) and importlib.util.find_spec("torch") is None:
            return None, None
        return None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".strip()
    return torch, None


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
