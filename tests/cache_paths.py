"""Where tests keep downloads between runs (outside the per-test temporary HOME), and where
they find a Megatron-LM git mirror (the tests that need one skip without it)."""

from __future__ import annotations

import os
from pathlib import Path

DOWNLOAD_CACHE = Path(
    os.environ.get("MEGATRON_ROCM_TEST_CACHE")
    or os.path.join(os.path.expanduser("~"), ".cache", "megatron-rocm-tests")
)
MIRROR = Path(os.environ.get("MEGATRON_ROCM_TEST_MIRROR", "/work/.mirror/NVIDIA+Megatron-LM/repo"))
