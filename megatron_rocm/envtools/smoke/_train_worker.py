"""One rank of a training world (``world.run_jobs``): runs ``engine`` jobs one after another.

    python -m megatron_rocm.envtools.smoke._train_worker --jobs JOBS.json --out DIR [--tree T]

Environment as torchrun sets it (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT).
After each job the rank rewrites ``DIR/rank<N>.json`` with every result so far, so a rank that
dies mid-job still leaves the verdicts of the jobs before. A job that raises stops the rank:
after a failure inside a collective the ranks are out of step, and the launcher starts a fresh
world for the jobs that remain.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
import traceback
import warnings
from pathlib import Path


def _one_line(exc: BaseException) -> str:
    tb = traceback.extract_tb(exc.__traceback__)
    where = f" (at {Path(tb[-1].filename).name}:{tb[-1].lineno})" if tb else ""
    text = str(exc).strip().replace("\n", " | ")[:600]
    return f"{type(exc).__name__}: {text}{where}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tree", default=None)
    ap.add_argument("--backend", default="nccl")
    args = ap.parse_args(argv)
    if args.tree:
        sys.path.insert(0, args.tree)
    import torch
    import torch.distributed as dist

    from megatron_rocm.envtools.smoke.checks_training import quiet_megatron
    from megatron_rocm.envtools.smoke.engine import Job, run_job

    jobs = [Job.from_dict(j) for j in json.loads(Path(args.jobs).read_text())]
    rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    if any(j.deterministic for j in jobs):  # upstream's --deterministic-mode (env set by parent)
        torch.use_deterministic_algorithms(True, warn_only=True)
    if args.backend == "nccl":
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group(args.backend, timeout=datetime.timedelta(seconds=120))
    results: list[dict] = []
    out = Path(args.out, f"rank{rank}.json")
    for job in jobs:
        start = time.perf_counter()
        try:
            with warnings.catch_warnings(), quiet_megatron():
                warnings.simplefilter("ignore")
                result = {"name": job.name, "ok": True, **run_job(job, device)}
        except Exception as e:  # noqa: BLE001 - reported to the parent as this job's result
            result = {"name": job.name, "ok": False, "error": _one_line(e)}
            traceback.print_exc()  # into the rank's log, for whoever debugs it
        result["seconds"] = round(time.perf_counter() - start, 2)
        results.append(result)
        out.write_text(json.dumps(results))
        if not result["ok"]:
            return 1
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
