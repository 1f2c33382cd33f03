"""The patch tool: the series, in-memory checks, the apply transaction, export and the matrix.

Nothing here runs inside Megatron's training process and nothing here imports torch: it must
work on CI boxes and laptops with only git and Python.
"""
