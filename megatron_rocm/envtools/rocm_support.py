"""The ROCm PyTorch this project supports: one table, read by ``doctor``, ``install``'s hint and
``docs/rocm.md`` (rendered by :func:`markdown`; a test keeps the doc in step).

Minimum torch and why, per feature (each row names what breaks on an older build). Nothing in this
table was run on AMD hardware by the project: the kernels are compiled for the archs below in CI
(``tests/runtime/kernels/test_amd_compile_gate.py``), the training was validated on NVIDIA GPUs.
No torch import here: the patch tool and ``install`` use it without torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# The index the hint names: ROCm builds of torch 2.10 came for ROCm 7.0/7.1, 2.11 for 7.2.
ROCM_INDEX = "https://download.pytorch.org/whl/rocm7.2"
ROCM_TORCH_HINT = f"pip install torch --index-url {ROCM_INDEX}"
VALIDATED_TORCH = ("2.11", "2.13")  # the project's test matrix (NVIDIA GPUs and CPU)
VALIDATED_TRITON = "3.6"
ARCHS = {  # gfx arch -> GPUs; all three are compiled for in CI
    "gfx942": "MI300X, MI325X",
    "gfx950": "MI350X, MI355X",
    "gfx90a": "MI210, MI250X",
}


@dataclass(frozen=True)
class Requirement:
    feature: str
    min_torch: tuple[int, int]
    why: str


REQUIREMENTS = (
    Requirement(
        "context-parallel attention (log-sum-exp merge)",
        (2, 9),
        "AOTriton <= 0.10 (ROCm torch <= 2.8) returns the log-sum-exp in base 2 "
        "(pytorch#156012); a first-use probe converts it, 2.9 (AOTriton 0.11) needs none",
    ),
    Requirement(
        "grouped GEMM via torch._grouped_mm (MoE)",
        (2, 9),
        "only an explicit MEGATRON_ROCM_GROUPED_GEMM=torch request, which also needs "
        "gfx942/gfx950 (CK; on other archs torch's is a per-expert loop, so the request is "
        "refused); auto takes our Triton grouped GEMM on ROCm at any torch",
    ),
    Requirement(
        "SDPA flash / memory-efficient kernels",
        (2, 9),
        "AOTriton 0.11 ships both for gfx90a/gfx942/gfx950; no cuDNN on ROCm",
    ),
    Requirement(
        "the project's validated stack",
        (2, 11),
        f"tested with torch {VALIDATED_TORCH[0]} (CUDA build, NVIDIA GPUs) and "
        f"{VALIDATED_TORCH[1]} (CPU build) and Triton {VALIDATED_TRITON}; no ROCm build of torch "
        "has been run",
    ),
)
MIN_TORCH = min(r.min_torch for r in REQUIREMENTS)
RECOMMENDED_TORCH = max(r.min_torch for r in REQUIREMENTS)
MIN_ROCM = (6, 4)  # the oldest ROCm that torch MIN_TORCH shipped wheels for


def version_tuple(text: str | None) -> tuple[int, int] | None:
    """``"2.9.1+rocm6.4"`` -> ``(2, 9)``; None for anything unparsable."""
    m = re.match(r"\s*(\d+)\.(\d+)", text or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def _v(t: tuple[int, int]) -> str:
    return f"{t[0]}.{t[1]}"


def problems(torch: str | None, hip: str | None, triton: str | None) -> list[str]:
    """One line per thing older than supported, on a ROCm build of torch (``hip`` set)."""
    if not hip:
        return []
    out = []
    have = version_tuple(torch)
    if have is not None:
        for r in REQUIREMENTS:
            if have < r.min_torch:
                out.append(
                    f"torch {torch} is older than {_v(r.min_torch)}, needed for {r.feature}: "
                    f"{r.why}; {ROCM_TORCH_HINT}"
                )
    rocm = version_tuple(hip)
    if rocm is not None and rocm < MIN_ROCM:
        out.append(f"ROCm {hip} is older than {_v(MIN_ROCM)} (torch {_v(MIN_TORCH)}'s oldest)")
    tv = version_tuple(triton)
    if tv is not None and tv < version_tuple(VALIDATED_TRITON):
        out.append(
            f"Triton {triton} is older than {VALIDATED_TRITON}, the one the kernels are compiled "
            "and tested with"
        )
    return out


def markdown() -> str:
    """The table as docs/rocm.md shows it."""
    lines = [
        "| feature | minimum torch (ROCm build) | why |",
        "|---|---|---|",
        *(f"| {r.feature} | {_v(r.min_torch)} | {r.why} |" for r in REQUIREMENTS),
        "",
        "| arch | GPUs |",
        "|---|---|",
        *(f"| {a} | {g} |" for a, g in ARCHS.items()),
        "",
        f"Install: `{ROCM_TORCH_HINT}` (ROCm {_v(MIN_ROCM)} or newer on the host; torch 2.10 "
        "came for ROCm 7.0/7.1, 2.11 for 7.2). Triton: the `pytorch-triton-rocm` that torch "
        f"pins, {VALIDATED_TRITON} or newer.",
    ]
    return "\n".join(lines)
