"""Where tests keep downloads between runs (outside the per-test temporary HOME)."""

from __future__ import annotations

import os
from pathlib import Path

DOWNLOAD_CACHE = Path(
    os.environ.get("MEGATRON_ROCM_TEST_CACHE")
    or os.path.join(os.path.expanduser("~"), ".cache", "megatron-rocm-tests")
)
