"""The one rule for megatron-rocm's cache folder (downloads, mirrors, logs, install records).

Why one function: the PyPI sdists, the URL mirrors, the error log and the install audit trail
must land in the same place, and ``MEGATRON_ROCM_CACHE`` must move all of them at once (tests,
CI caches and read-only home folders rely on it).
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "MEGATRON_ROCM_CACHE"


def cache_dir() -> Path:
    """``$MEGATRON_ROCM_CACHE``, else ``$XDG_CACHE_HOME/megatron-rocm``, else
    ``~/.cache/megatron-rocm``. Nothing is created here: callers make what they use."""
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "megatron-rocm"
