"""The runtime's environment switches (``MEGATRON_ROCM_*``), checked together before a run.

Each switch is read by the module it steers, where it acts: a kernel choice, an attention call,
often minutes into a run, after the model is built and the data loaded. A malformed value
stopped the run only then, and a misspelt name (``MEGATRON_ROCM_CP_A2A_QVK=0``) was never read
at all, so what it meant to change silently stayed as it was. :func:`problems` parses every
switch at once and names each variable nothing reads; the native backend's argument validation
(``backend.options.reject_te_only_options``, called from upstream's ``validate_args`` by the
``te-spec-backend`` patch) raises with them, one line each, before anything is built.
"""

from __future__ import annotations

import os
from collections.abc import Callable

PREFIX = "MEGATRON_ROCM_"

# Read by the patch tool, the smoke suite and the test suite, not by the runtime.
ELSEWHERE = frozenset(
    {
        "MEGATRON_ROCM_CACHE",
        "MEGATRON_ROCM_SERIES",
        "MEGATRON_ROCM_PYPI_URL",
        "MEGATRON_ROCM_SMOKE_FAULT",
        "MEGATRON_ROCM_FAULT",
        "MEGATRON_ROCM_FAULT_READY",
    }
)
TEST_PREFIX = "MEGATRON_ROCM_TEST_"


def _parsers() -> dict[str, Callable[[], object]]:
    """Switch -> the function that reads it where it acts (raises ValueError when malformed)."""
    from megatron_rocm.runtime.backend import te_sdpa as sdpa
    from megatron_rocm.runtime.backend.cp import a2a as _cp_a2a
    from megatron_rocm.runtime.backend.cp import a2a_projection
    from megatron_rocm.runtime.backend.cp import block_attention as _cp_block_attention
    from megatron_rocm.runtime.backend.cp import copy_engine as _cp_copy_engine
    from megatron_rocm.runtime.backend.cp import handoff as _cp_handoff
    from megatron_rocm.runtime.backend.packed import thd_attention as packed_attention
    from megatron_rocm.runtime.kernels import grouped_gemm, norm
    from megatron_rocm.runtime.kernels import launch as _runtime
    from megatron_rocm.runtime.kernels import local_sdpa as attention

    return {
        "MEGATRON_ROCM_KERNELS": _runtime.reference_forced,
        "MEGATRON_ROCM_SDPA": attention.sdpa_enabled,
        "MEGATRON_ROCM_SDPA_BACKENDS": sdpa.requested_backends,
        "MEGATRON_ROCM_CP_KERNEL": _cp_block_attention.requested_kernel,
        "MEGATRON_ROCM_CP_A2A_STAGES": _cp_a2a.requested_stages,
        "MEGATRON_ROCM_CP_A2A_TRANSPORT": _cp_copy_engine.requested_transport,
        "MEGATRON_ROCM_CP_A2A_HANDOFF": _cp_handoff.handoff_directions,
        "MEGATRON_ROCM_CP_A2A_QKV": a2a_projection.enabled,
        "MEGATRON_ROCM_PACKED_ATTENTION": lambda: packed_attention.requested_implementation(None),
        "MEGATRON_ROCM_GROUPED_GEMM": grouped_gemm.requested_implementation,
        "MEGATRON_ROCM_TRITON_NORMS": norm.triton_norms,
    }


def problems() -> list[str]:
    """One line per malformed switch and per ``MEGATRON_ROCM_*`` variable nothing reads."""
    parsers = _parsers()
    found = []
    for name in sorted(k for k in os.environ if k.startswith(PREFIX)):
        if name in parsers:
            try:
                parsers[name]()
            except ValueError as e:
                found.append(str(e))
        elif name not in ELSEWHERE and not name.startswith(TEST_PREFIX):
            found.append(
                f"{name} is not a megatron-rocm setting, so it would change nothing; the "
                f"runtime's are {', '.join(sorted(parsers))} (docs/backend.md)"
            )
    return found
