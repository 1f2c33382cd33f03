"""Test-only: with MEGATRON_ROCM_TEST_CPU_SHIM=1 on PYTHONPATH, every Python process (smoke
training ranks included) maps Megatron's CUDA allocations to the CPU (see cpu_shim.py)."""

import os
import sys

if os.environ.get("MEGATRON_ROCM_TEST_CPU_SHIM") == "1":
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "..", "upstream"))
    import cpu_shim

    cpu_shim.install()
