"""Start a worker script once per rank of a local gloo world and collect what each rank wrote.

The upstream probes (``distopt_roundtrip.py``, ``a2a_qkv_probe.py``) run Megatron's own code in
separate processes: each rank is the same script with ``RANK``/``WORLD_SIZE`` and a free
``MASTER_PORT`` set, and writes ``OUT.rank<N>.json``. A rank that wrote nothing is reported
with the end of its output, so a crash shows in the test instead of a missing file.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from megatron_rocm.envtools.smoke.world import free_port


def run_ranks(cmd: list[str], world: int, out: Path, timeout: float) -> list[dict]:
    """Run ``cmd`` as ranks ``0 .. world - 1`` at once; each rank's JSON from
    ``out.with_suffix(".rank<N>.json")`` (removed after reading), or ``{"ok": False, "error":
    "rank died: ..."}``."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))  # fmt: skip
    logs = []
    for proc in procs:
        try:
            logs.append(proc.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
            logs.append(proc.communicate()[0] + "\n[timed out]")
    results = []
    for rank, log in enumerate(logs):
        part = out.with_suffix(f".rank{rank}.json")
        if part.is_file():
            results.append(json.loads(part.read_text()))
            part.unlink()
        else:
            tail = " | ".join(log.splitlines()[-5:])
            results.append({"ok": False, "error": f"rank died: {tail}"})
    return results
