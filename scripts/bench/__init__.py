"""Benchmarks of the kernels, the native backend and the patch tool, all timed by ``timing``.

Run from the repository root: ``python -m scripts.bench.<name> --help``.
"""
