"""What the patched Megatron tree imports at training time.

``kernels`` (native replacements for Apex/TE fused ops), ``backend`` (the native modules behind
upstream's TransformerEngine spec), ``rccl`` and ``platform``. Nothing here may import the patch
tool, the CLI or the environment tools: this package is loaded inside Megatron's training
process.
"""
