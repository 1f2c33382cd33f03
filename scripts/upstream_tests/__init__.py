"""Helpers of scripts/upstream_unit_tests.py (upstream Megatron-LM's unit tests, per file).
``plugin/`` holds the pytest plugin; it alone goes on the test processes' ``PYTHONPATH``."""
