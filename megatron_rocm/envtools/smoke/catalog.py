"""The suite's checks in suite order: imports the check modules, which register themselves.

Kept out of ``runner`` because the check modules import ``runner`` (``register``, ``Context``):
the registry stays a leaf and nothing loops.
"""

from __future__ import annotations

from megatron_rocm.envtools.smoke.runner import REGISTRY, Check


def load_checks() -> dict[str, Check]:
    """Import the check modules (they register themselves), in suite order."""
    from megatron_rocm.envtools.smoke import (  # noqa: F401 - imported for registration
        checks_collectives,
        checks_fp8,
        checks_imports,
        checks_kernels,
        checks_parallel,
        checks_realdata,
        checks_resume,
        checks_throughput,
        checks_training,
    )

    order = (
        "imports",
        "kernels",
        "training",
        "training.resume",
        "real-data",
        "collectives",
        "parallel",
        "throughput",
    )

    def rank(name: str) -> int:  # the longest prefix decides: resume after the other trainings
        return max(i for i, p in enumerate(order) if name == p or name.startswith(p + "."))

    return dict(sorted(REGISTRY.items(), key=lambda kv: rank(kv[0])))
