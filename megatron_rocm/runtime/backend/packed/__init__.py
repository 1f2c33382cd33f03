"""Packed-sequence (THD) attention: batch plans, kernels, CP partitioning and document masks."""
