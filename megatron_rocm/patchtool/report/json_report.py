"""JSON report: the whole matrix as data; the next CI run compares against it (new breaks)."""

from __future__ import annotations

import json

from megatron_rocm.patchtool.matrix import Matrix


def render(m: Matrix) -> str:
    return json.dumps(m.to_dict(), indent=2, ensure_ascii=False) + "\n"
