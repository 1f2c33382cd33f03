"""Native (torch + Triton) replacements for the Apex/TransformerEngine kernels Megatron uses.

Each op has a torch reference (the CPU path and the parity oracle) and, where it pays, a
Triton kernel that runs on both CUDA and ROCm. See docs/architecture.md for the API contract.
"""
