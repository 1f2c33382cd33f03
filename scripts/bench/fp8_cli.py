"""What the FP8 benchmarks' command lines share: the device they time on and their JSON output.

Each runs on a GPU with FP8 GEMMs, or with ``--smoke`` on the CPU (a check that the script
works); a machine without such a GPU gets one line and exit 3.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch


def fp8_device(prog: str, smoke: bool) -> str | None:
    """ "cpu" for ``--smoke``, "cuda" where the GPU has FP8 GEMMs; else None, after saying why
    on stderr as ``prog: ...`` (the caller exits 3)."""
    if smoke:
        return "cpu"
    if not torch.cuda.is_available():
        print(f"{prog}: no GPU (use --smoke on a CPU)", file=sys.stderr)
        return None
    from megatron_rocm.runtime.kernels.fp8 import unsupported_gpu_reason

    if (reason := unsupported_gpu_reason()) is not None:
        print(f"{prog}: this GPU: {reason}", file=sys.stderr)
        return None
    return "cuda"


def add_interpreted_smoke(parser: argparse.ArgumentParser) -> None:
    """``--smoke`` for a benchmark whose CPU run is its Triton kernel under the interpreter."""
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny CPU run under TRITON_INTERPRET=1: checks it works",
    )


def interpreter_missing(prog: str, smoke: bool) -> bool:
    """Whether ``--smoke`` was asked without ``TRITON_INTERPRET=1``, after saying so on stderr
    in one line (the caller exits 2: the kernel cannot run on the CPU otherwise)."""
    if smoke and os.environ.get("TRITON_INTERPRET") != "1":
        print(
            f"{prog}: --smoke runs the kernel on the CPU: set TRITON_INTERPRET=1", file=sys.stderr
        )
        return True
    return False


def device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device == "cuda" else "cpu"


def report(result: dict, json_path: Path | None) -> int:
    """``result`` written to ``json_path`` (``--json``) and printed as the last line; 0."""
    if json_path:
        json_path.write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    return 0
