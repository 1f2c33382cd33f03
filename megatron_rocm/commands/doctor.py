"""``megatron-rocm doctor``: report the GPU stack and flag environment mistakes with a fix each.

Exit codes: 0 nothing wrong, 1 problems found, 3 torch is not installed or does not import
(nothing to check).
"""

from __future__ import annotations

import argparse

from megatron_rocm.commands import options
from megatron_rocm.envtools import envcheck
from megatron_rocm.errors import EXIT_ENVIRONMENT, EXIT_FAILED, EXIT_OK
from megatron_rocm.output import print_json
from megatron_rocm.runtime.platform import import_torch


def _human(snap: envcheck.Snapshot) -> str:
    lines = []
    failed = next((p for p in snap.problems if p.code == "torch-import-fails"), None)
    if failed is not None:
        lines.append("torch:        INSTALLED BUT DOES NOT IMPORT")
    elif snap.torch is None:
        lines.append("torch:        NOT INSTALLED")
        lines.append(f"              install the ROCm build: {envcheck.ROCM_TORCH_HINT}")
    else:
        build = (
            f"ROCm/HIP {snap.hip}" if snap.hip else (f"CUDA {snap.cuda}" if snap.cuda else "CPU")
        )
        lines.append(f"torch:        {snap.torch} ({build} build)")
        lines.append(f"collectives:  {snap.collectives or 'none (no NCCL/RCCL in this build)'}")
        lines.append(f"triton:       {snap.triton or 'not installed'}")
        lines.append(f"GPUs:         {len(snap.gpus)}")
        for g in snap.gpus:
            lines.append(f"  [{g.index}] {g.name}  {g.arch}  {g.memory_gib} GiB")
    lines.append(f"ROCm stack:   {'present' if snap.rocm_installed else 'not found'}")
    lines.append("environment:")
    if not snap.env:
        lines.append("  (none of the watched variables is set)")
    for k, v in snap.env.items():
        lines.append(f"  {k}={v}")
    if snap.problems:
        lines.append(f"problems ({len(snap.problems)}):")
        for p in snap.problems:
            lines.append(f"  - {p.message}\n    fix: {p.fix}")
    else:
        lines.append("no problems found")
    return "\n".join(lines)


def doctor(as_json: bool = False) -> int:
    """Collect, judge, print. Never raises for a bad environment: reporting it is the job."""
    torch, failure = import_torch()
    snap = envcheck.collect(torch)
    snap.problems = envcheck.problems(snap)
    if failure is not None:
        snap.problems.insert(
            0,
            envcheck.Problem(
                "torch-import-fails",
                f"torch is installed but does not import ({failure})",
                "on ROCm check that the ROCm libraries are found (ldconfig, LD_LIBRARY_PATH); "
                f"else reinstall the ROCm build: {envcheck.ROCM_TORCH_HINT}",
            ),
        )
    elif torch is None:
        snap.problems.insert(
            0,
            envcheck.Problem(
                "no-torch",
                "torch is not installed",
                f"install the ROCm build: {envcheck.ROCM_TORCH_HINT}",
            ),
        )
    if as_json:
        print_json(snap.to_dict())
    else:
        print(_human(snap))
    if torch is None:
        return EXIT_ENVIRONMENT
    return EXIT_FAILED if snap.problems else EXIT_OK


def add_parser(sub: argparse._SubParsersAction) -> None:
    """This verb's options, on ``main``'s parser."""
    p = sub.add_parser("doctor", help="report the ROCm/CUDA environment and flag problems")
    options.add_json(p)


def run(args: argparse.Namespace) -> int:
    return doctor(as_json=args.json)
