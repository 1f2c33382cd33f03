"""megatron-rocm: upstream Megatron-LM on AMD GPUs (ROCm) as a maintained patch series."""

__version__ = "0.1.0"
