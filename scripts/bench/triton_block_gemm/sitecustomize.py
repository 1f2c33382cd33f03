"""On ``PYTHONPATH`` (an absolute path: training runs in the tree's folder), every block-scaled
FP8 GEMM of ``--fp8-recipe blockwise`` runs on the Triton kernel, as on ROCm, where hipBLASLt
has no block-scaled GEMM. It measures ROCm's path on an NVIDIA GPU:

    PYTHONPATH=$PWD/scripts/bench/triton_block_gemm:$PYTHONPATH \\
        python3 -m scripts.training.train_small TREE ... -- --fp8-format hybrid --fp8-recipe blockwise

Python imports one ``sitecustomize`` per process: this one replaces any other on the path
behind it.
"""

from megatron_rocm.runtime.kernels import fp8_blockwise

fp8_blockwise.cublaslt_takes = lambda problem: False  # cuBLASLt takes no problem: Triton serves
