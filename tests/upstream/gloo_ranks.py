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


def rank_main(script: str, run_rank, world: int, ap) -> int:  # noqa: ANN001 - callables
    """A probe's ``main``: ``ap`` (an ``argparse`` parser with ``--out`` and ``--timeout``)
    parsed; without ``RANK`` set, ``script`` again as ranks ``0 .. world - 1`` and their
    results, rank 0's first, as one JSON list in ``--out``; as a rank, ``run_rank(args)``'s
    result (or the error it raised, with its trace) in ``OUT.rank<N>.json``."""
    import sys
    import traceback

    args = ap.parse_args()
    out = Path(args.out)
    if "RANK" not in os.environ:
        results = run_ranks([sys.executable, script, *sys.argv[1:]], world, out, args.timeout)
        out.write_text(json.dumps(results))
        return 0
    try:
        result = run_rank(args)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        result = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
    out.with_suffix(f".rank{os.environ['RANK']}.json").write_text(json.dumps(result))
    return 0


def join_rank_world(tree: str, world: int) -> int:
    """A rank's setting: ``tree`` first on the path, warnings off, upstream's CUDA allocations
    on the CPU (``cpu_shim``), and this process in the ``world``-rank gloo group its launcher
    set up (``RANK``, ``MASTER_PORT``); returns the rank."""
    import sys
    import warnings

    sys.path.insert(0, tree)
    warnings.simplefilter("ignore")
    import torch.distributed as dist

    sys.path.insert(0, str(Path(__file__).parent))
    import cpu_shim

    cpu_shim.install()
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    return rank
