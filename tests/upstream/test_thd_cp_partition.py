"""``thd-cp-partition`` on real sdists, on CPU: upstream's packed-batch CP split without TE.

0.16's ``get_thd_batch_on_this_cp_rank`` and 0.19's per-document balancing (what
``pretrain_gpt.py --sft --context-parallel-size 2`` calls) split a packed batch of three
padded documents for CP rank 0 and 1. Patched, each rank keeps chunks r and 2cp-1-r of every
document (``_cp_world.thd_rows``, TE's layout restated); with the patch reverted, upstream's
own assertion or a ``None`` ``tex`` stops them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from cache_paths import DOWNLOAD_CACHE

from megatron_rocm.main import main

pytestmark = [pytest.mark.upstream, pytest.mark.slow, pytest.mark.torch]
pytest.importorskip("torch")
HERE = Path(__file__).resolve().parent
PATCH = HERE.parents[1] / "patches/thd-cp-partition"
sys.path.insert(0, str(HERE.parent / "runtime/backend"))
from _cp_world import thd_rows  # noqa: E402

PADDED = [0, 8, 12, 24]  # three documents, each a multiple of 2 x CP 2

SPLIT = """
import json, sys, torch
sys.path.insert(0, sys.argv[1])
from megatron.core import utils
padded = torch.tensor([json.loads(sys.argv[2])], dtype=torch.int32)
kept = {}
for rank in (0, 1):
    tokens = torch.arange(padded[0, -1].item()).view(1, -1)
    batch = {"tokens": tokens, "labels": tokens + 100, "loss_mask": torch.ones_like(tokens),
             "position_ids": tokens.clone()}
    try:
        if hasattr(utils, "get_thd_batch_on_this_cp_rank"):  # 0.16-0.17
            batch, _ = utils.get_thd_batch_on_this_cp_rank(
                batch, padded[0], padded[0], torch.tensor([12]), cp_size=2, cp_rank=rank
            )
        else:  # 0.18+: the CP group's size and rank come from torch.distributed
            torch.distributed.get_world_size = lambda group=None: 2
            torch.distributed.get_rank = lambda group=None, r=rank: r
            batch.update(cu_seqlens=padded, cu_seqlens_padded=padded)
            batch = utils._get_batch_on_this_cp_rank_per_document_balancing(batch, None)
    except Exception as exc:
        print("ERROR", type(exc).__name__, str(exc)[:300])
        raise SystemExit(0)
    assert batch["labels"].tolist() == (batch["tokens"] + 100).tolist()
    kept[rank] = batch["tokens"][0].tolist()
print(json.dumps(kept))
"""


def _split(tree: Path) -> str:
    done = subprocess.run(
        [sys.executable, "-c", SPLIT, str(tree), json.dumps(PADDED)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize(
    ("release", "diff", "unpatched"),
    [
        ("0.16.1", "v0.16.diff", "ERROR AssertionError Please update Transformer Engine"),
        ("0.19.2", "v0.18.diff", "ERROR AttributeError 'NoneType' object has no attribute"),
    ],
)
def test_packed_batches_split_per_document_without_te(
    tmp_path, monkeypatch, release, diff, unpatched
):  # noqa: ANN001
    monkeypatch.setenv("MEGATRON_ROCM_CACHE", str(DOWNLOAD_CACHE))
    tree = tmp_path / release
    assert main(["apply", "--source", "pypi", "--ref", release, "--dest", str(tree)]) == 0
    kept = {int(rank): rows for rank, rows in json.loads(_split(tree)).items()}
    assert kept == {rank: thd_rows(PADDED, 2, rank) for rank in (0, 1)}

    subprocess.run(["git", "apply", "-R", str(PATCH / diff)], cwd=tree, check=True)
    assert _split(tree).startswith(unpatched)
