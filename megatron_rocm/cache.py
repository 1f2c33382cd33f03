"""The one rule for megatron-rocm's cache folder (downloads, mirrors, logs, install records).

Why one function: the PyPI sdists, the URL mirrors, the error log and the install audit trail
must land in the same place, and ``MEGATRON_ROCM_CACHE`` must move all of them at once (tests,
CI caches and read-only home folders rely on it).
"""

from __future__ import annotations

import os
from pathlib import Path

from megatron_rocm.errors import SourceError

CACHE_ENV = "MEGATRON_ROCM_CACHE"


def cache_dir() -> Path:
    """``$MEGATRON_ROCM_CACHE``, else ``$XDG_CACHE_HOME/megatron-rocm``, else
    ``~/.cache/megatron-rocm`` where the home folder exists (it is never created: a
    SourceError otherwise). Nothing is created here: callers make what they use."""
    explicit = os.environ.get(CACHE_ENV)
    try:
        if explicit:
            return Path(explicit).expanduser()
        home = os.path.expanduser("~")
        if home == "~":  # no $HOME and no passwd entry for this user
            raise RuntimeError("no home folder")
        xdg = os.environ.get("XDG_CACHE_HOME")
        if not xdg and not os.path.isdir(home):
            # HOME=/nonexistent (a service account, a sandbox): making ~/.cache would
            # create a home folder nobody asked for
            raise SourceError(
                f"the home folder {home} does not exist, so there is no ~/.cache for the "
                f"cache (it is not created); set ${CACHE_ENV} or $XDG_CACHE_HOME to a folder"
            )
        xdg = xdg or os.path.join(home, ".cache")
    except RuntimeError as e:  # expanduser: "~nosuchuser", or no home to expand "~" to
        where = f"${CACHE_ENV}={explicit!r}" if explicit else "~/.cache"
        raise SourceError(
            f"cannot find the cache folder {where} ({e}); set ${CACHE_ENV} to a folder"
        ) from None
    return Path(xdg) / "megatron-rocm"
