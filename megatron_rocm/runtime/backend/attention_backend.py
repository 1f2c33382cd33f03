"""Upstream's ``--attention-backend`` on the native attention.

With TE, Megatron turns the flag into ``NVTE_FLASH_ATTN`` / ``NVTE_FUSED_ATTN`` /
``NVTE_UNFUSED_ATTN`` (``LanguageModule._set_attention_backend``), which only TE reads. On the
native backend they would change nothing: ``unfused``, which upstream's functional tests take
their golden values with, would run a flash kernel. So each choice picks the native kernels of
the same family, for every path the attention has:

=========  ============================  =====================  ===========================
flag       dense (torch SDPA)            context-parallel       packed (THD)
                                         blocks
=========  ============================  =====================  ===========================
flash      flash (a mask tensor:         flash                  varlen flash
           efficient, logged once)
fused      cuDNN, else efficient         cuDNN, else efficient  one SDPA per document,
                                                                cuDNN, else efficient
unfused    math                          math                   one SDPA per document, math
auto       torch's choice                fastest that passes    varlen flash if its probe
                                                                passes
=========  ============================  =====================  ===========================

ROCm has no cuDNN: there ``fused`` runs the memory-efficient kernel (AOTriton), as TE-ROCm's
fused attention is its own CK/AOTriton kernel. SDPA's flash kernel takes no mask tensor, where
TE's flash attention unpads a padding mask and bands a window itself, so masked dense attention
under ``flash`` runs the memory-efficient kernel and says so once. Otherwise a kernel the flag
names that cannot run the inputs raises with the reason rather than falling back. The
``MEGATRON_ROCM_SDPA_BACKENDS``, ``MEGATRON_ROCM_CP_KERNEL`` and
``MEGATRON_ROCM_PACKED_ATTENTION`` variables (for benchmarks) choose the same kernels, so they
and a non-``auto`` flag are refused together, as upstream refuses ``NVTE_*`` variables that
disagree with the flag.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

from megatron_rocm.runtime import settings
from megatron_rocm.runtime.backend.packed_attention import ENV_VAR as PACKED_ENV
from megatron_rocm.runtime.backend.sdpa import BACKENDS_ENV, sdpa_backends

CP_KERNEL_ENV = "MEGATRON_ROCM_CP_KERNEL"
_KERNEL_ENVS = (BACKENDS_ENV, CP_KERNEL_ENV, PACKED_ENV)


@dataclass(frozen=True)
class KernelChoice:
    """The kernels one ``--attention-backend`` value names on each path."""

    sdpa: str  # torch SDPA backends, in ``MEGATRON_ROCM_SDPA_BACKENDS``' spelling
    cp_blocks: tuple[str, ...]  # context-parallel block kernels, first that runs
    packed: str  # packed_attention's implementation


CHOICES: dict[str, KernelChoice] = {
    "flash": KernelChoice("flash", ("flash",), "flash"),
    "fused": KernelChoice("cudnn,efficient", ("cudnn", "efficient"), "sdpa_loop"),
    "unfused": KernelChoice("math", ("math",), "sdpa_loop"),
}


def resolve(config: Any) -> KernelChoice | None:
    """The kernels ``config.attention_backend`` asks for; None for ``auto`` (or no field)."""
    backend = getattr(config, "attention_backend", None)
    name = str(getattr(backend, "name", backend) or "auto")
    if name == "auto":
        return None
    if name not in CHOICES:
        raise ValueError(
            f"TEDotProductAttention: --attention-backend {name} is not a kernel of the TE "
            f"spec's attention; use auto, flash, fused or unfused"
        )
    for env in _KERNEL_ENVS:
        if settings.chooses(env):  # auto: no choice
            raise ValueError(
                f"TEDotProductAttention: --attention-backend {name} and {env} both choose the "
                f"attention kernel; unset {env} or leave --attention-backend at auto"
            )
    return CHOICES[name]


def sdpa_kernels(choice: KernelChoice | None) -> contextlib.AbstractContextManager[None]:
    """torch SDPA restricted to the choice's kernels (every SDPA call inside, any path). For
    ``auto`` a bare ``nullcontext``: this runs per layer and micro-batch, on the host."""
    return contextlib.nullcontext() if choice is None else sdpa_backends(choice.sdpa)
