"""Training and validation helpers: small pretrain_gpt.py runs and their logs, loss comparisons,
resume checks, the four-GPU layouts, step profiles and trace summaries.

Run from the repository root: ``python -m scripts.training.<name> --help``.
"""
