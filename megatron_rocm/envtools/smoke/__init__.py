"""The smoke suite: does a patched Megatron-LM tree import, compute and train on this machine?

``megatron-rocm smoke`` runs it; see docs/smoke.md for the checks and how to read the report.
"""
