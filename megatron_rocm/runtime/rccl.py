"""Reject Megatron options that need NVIDIA-only communication libraries, on ROCm only.

The ``nccl-only-features`` patch calls :func:`reject_nccl_only_options` first thing in
Megatron's ``validate_args``. Without it these options fail late and obscurely on ROCm (a
missing TransformerEngine userbuffers module, ``ncclMemAlloc`` not found in RCCL, a SHARP
plugin that never loads); with it the run stops before any GPU work, with one line per
option that says what to do instead. On CUDA it does nothing.

Every option is looked up with ``getattr``: each exists only at some Megatron versions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from megatron_rocm.runtime.platform import is_rocm


@dataclass(frozen=True)
class NcclOnlyOption:
    """One Megatron option that RCCL cannot honour: where it lives and what to say."""

    dest: str  # attribute on Megatron's args namespace
    flag: str  # command-line spelling, for the message
    advice: str  # why it cannot work on ROCm, and what to use instead
    is_set: Callable[[Any], bool] = bool


def _given(value: Any) -> bool:
    """For options whose default is None: any given value (even an empty path) counts."""
    return value is not None


_UB_ADVICE = (
    "registers NCCL user buffers (ncclMemAlloc / NCCL window registration), which RCCL does "
    "not provide; remove it (RCCL uses its own internal buffers)"
)

NCCL_ONLY_OPTIONS: tuple[NcclOnlyOption, ...] = (
    NcclOnlyOption(
        "tp_comm_overlap",
        "--tp-comm-overlap",
        "needs TransformerEngine userbuffers, not available on ROCm; remove it (Megatron's "
        "default path still overlaps the tensor-parallel all-gather/reduce-scatter with the "
        "backward GEMMs over RCCL)",
    ),
    NcclOnlyOption("nccl_ub", "--use-nccl-ub", _UB_ADVICE),
    NcclOnlyOption("gtp_remat_nccl_ub", "--gtp-remat-nccl-ub", _UB_ADVICE),
    NcclOnlyOption("gtp_expert_remat_nccl_ub", "--gtp-expert-remat-nccl-ub", _UB_ADVICE),
    NcclOnlyOption(
        "use_sharp",
        "--use-sharp",
        "needs NVIDIA SHARP in-network reductions (InfiniBand switches through NCCL's "
        "CollNet plugin); remove it together with --sharp-enabled-group (RCCL reduces on the "
        "GPUs)",
    ),
    NcclOnlyOption(
        "nccl_communicator_config_path",
        "--nccl-communicator-config-path",
        "sets NVIDIA NCCL communicator fields (CGA cluster size, CTA counts, network name) per "
        "process group; remove it and tune RCCL with its environment variables instead "
        "(e.g. NCCL_MIN_NCHANNELS, NCCL_MAX_NCHANNELS)",
        _given,
    ),
    NcclOnlyOption(
        "symmetric_ar_type",
        "--symmetric-ar-type",
        "needs TransformerEngine and CUDA symmetric memory (NVLS multimem all-reduce); remove "
        "it (tensor-parallel all-reduces then go through RCCL)",
        _given,
    ),
)


def nccl_only_problems(args: Any) -> list[str]:
    """One message per NVIDIA-only option set on ``args``, in table order (platform-blind)."""
    problems = []
    for option in NCCL_ONLY_OPTIONS:
        value = getattr(args, option.dest, None)
        if option.is_set(value):
            problems.append(f"{option.flag} {option.advice}.")
    return problems


def reject_nccl_only_options(args: Any) -> None:
    """Raise ``ValueError`` listing every NVIDIA-only option set, when running on ROCm.

    All offending options are reported at once, one line each, so a user fixes a launch
    script in one pass. On CUDA (or without torch) this returns without looking at ``args``.
    """
    if not is_rocm():
        return
    problems = nccl_only_problems(args)
    if problems:
        lines = "\n".join(f"  {p}" for p in problems)
        raise ValueError(f"options not available on ROCm (RCCL):\n{lines}")
