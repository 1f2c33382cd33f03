"""On ``PYTHONPATH`` (an absolute path: training runs in the tree's folder), every block-scaled
FP8 GEMM of ``--fp8-recipe blockwise`` runs on the Triton kernel, as on ROCm, where hipBLASLt
has no block-scaled GEMM. It measures ROCm's path on an NVIDIA GPU:

    PYTHONPATH=$PWD/scripts/bench/triton_block_gemm:$PWD \\
        python3 -m scripts.training.train_small TREE ... -- --fp8-format hybrid --fp8-recipe blockwise

Each process says so in one line on stderr (the training logs hold it), and a process that
cannot import ``megatron_rocm`` stops with exit 3 rather than run on cuBLASLt unnoticed.
Python imports one ``sitecustomize`` a process: this one hides any other behind it on the path.
"""

import os
import sys

try:
    from megatron_rocm.runtime.kernels import fp8_blockwise
except Exception as exc:  # noqa: BLE001 - any failure leaves the hook undone: stop loudly
    sys.stderr.write(
        f"triton_block_gemm: cannot import megatron_rocm ({type(exc).__name__}: {exc})\n"
    )
    sys.stderr.flush()
    # SystemExit here would be a fatal error of the interpreter's start, traceback and all
    os._exit(3)

fp8_blockwise.cublaslt_takes = lambda problem: False  # cuBLASLt takes no problem: Triton serves
sys.stderr.write("triton_block_gemm: every block-scaled FP8 GEMM on the Triton kernel\n")
