"""Launch policy shared by every kernel: when to use Triton, and logging a fallback once.

``MEGATRON_ROCM_KERNELS`` selects, for debugging and A/B benchmarks: ``auto`` (default: Triton
on a GPU), ``reference`` (every kernel on its torch path) or ``reference:norm,rope`` (only the
named kernels; the names are ``KERNELS``). Any other value raises on first use: a typo must not
silently benchmark the wrong thing.
"""

from __future__ import annotations

import functools
import logging
import os

import torch

from megatron_rocm.runtime import settings

logger = logging.getLogger("megatron_rocm.runtime.kernels")


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    """Triton imports (ROCm and CUDA builds of torch ship it; CPU wheels usually do not)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "not usable"
        return False
    return True


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for launch grids: ``triton.cdiv`` in host code is a constexpr function
    call of a few microseconds, paid on every launch."""
    return -(-a // b)


def interpreting() -> bool:
    """``TRITON_INTERPRET=1`` runs Triton kernels on the CPU (used by CI parity tests)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


KERNELS = settings.choices("MEGATRON_ROCM_KERNELS")


def reference_forced(kernel: str | None = None) -> bool:
    """Whether ``MEGATRON_ROCM_KERNELS`` puts ``kernel`` (None: every kernel) on torch's path."""
    chosen = settings.get("MEGATRON_ROCM_KERNELS")
    return chosen >= set(KERNELS) if kernel is None else kernel in chosen


def use_triton(*tensors: torch.Tensor, kernel: str | None = None) -> bool:
    """Triton for GPU tensors (or CPU tensors under the interpreter), reference otherwise.

    ``kernel`` names the caller (one of ``KERNELS``) for ``MEGATRON_ROCM_KERNELS``."""
    if reference_forced(kernel):
        return False
    if not triton_available():
        log_fallback_once("triton", "Triton is not importable; using torch reference kernels")
        return False
    if all(t.is_cuda for t in tensors):
        return True
    return interpreting()


@functools.lru_cache(maxsize=16)
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors (CUs on ROCm) of ``device``; a few for the CPU interpreter.
    The Triton kernels size persistent grids by it."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def is_hip() -> bool:
    return bool(getattr(torch.version, "hip", None))


def rocm_arch(device: torch.device) -> str:
    """The GPU's ``gfx`` name without feature suffixes (``gfx942:sramecc+:xnack-`` -> gfx942);
    "" where torch does not say."""
    name = getattr(torch.cuda.get_device_properties(device), "gcnArchName", "") or ""
    return name.split(":")[0]


# GPUs AOTriton (ROCm torch's flash and memory-efficient SDPA kernels) ships code for.
AOTRITON_ARCHS = frozenset({"gfx90a", "gfx942", "gfx950", "gfx1100", "gfx1101", "gfx1201"})


_logged: set[str] = set()


def log_fallback_once(key: str, message: str) -> None:
    """Automatic fallbacks are logged once per reason, never silently and never spammed."""
    if key not in _logged:
        _logged.add(key)
        logger.warning("megatron-rocm: %s", message)
