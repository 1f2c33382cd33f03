"""``thd-cp-partition`` on real sdists, on CPU: upstream's packed-batch CP split without TE.

0.16's ``get_thd_batch_on_this_cp_rank`` and 0.19's per-document balancing (what
``pretrain_gpt.py --sft --context-parallel-size 2`` calls), and from 0.17 MIMO's
``PartitionAdapter.shard`` (multimodal THD inputs under CP), split a packed batch of three
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
from patched_trees import without_patch

from megatron_rocm.main import main

pytestmark = [pytest.mark.upstream, pytest.mark.slow, pytest.mark.torch, pytest.mark.full]
pytest.importorskip("torch")
HERE = Path(__file__).resolve().parent
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

MIMO_SPLIT = """
import inspect, json, sys, torch
sys.path.insert(0, sys.argv[1])
padded = torch.tensor(json.loads(sys.argv[2]), dtype=torch.int32)
total = int(padded[-1])
torch.distributed.is_initialized = lambda: True  # get_pg_size/get_pg_rank then ask the group
from megatron.core.models.mimo.partition.utils import PartitionAdapter, PartitionConfig
from megatron.core.packed_seq_params import PackedSeqParams

class Group:  # the CP group's size and rank, as get_pg_size / get_pg_rank read them
    def __init__(self, rank): self._rank = rank
    def size(self): return 2
    def rank(self): return self._rank

kept = {}
for rank in (0, 1):
    cfg = PartitionConfig(seq_parallel=False, use_cp=True, tp_comm_overlap=False,
                          max_seq_len=total, kv_format="thd", cp_group=Group(rank))
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=padded, cu_seqlens_kv=padded,
                             cu_seqlens_q_padded=padded, cu_seqlens_kv_padded=padded)
    positions = torch.arange(total)
    embeddings = positions.view(total, 1, 1).float().expand(total, 1, 4)  # [S, B, H]
    kwargs = dict(labels=positions.view(1, -1) + 100, loss_mask=positions.view(1, -1) + 200.0,
                  packed_seq_params=params)
    batch_first = "attention_mask" in inspect.signature(PartitionAdapter.shard).parameters
    if batch_first:  # 0.17-0.18: [B, S, H] in and out, and a mask argument
        kwargs["attention_mask"] = None
    kwargs["embeddings"] = embeddings.transpose(0, 1) if batch_first else embeddings
    try:
        out = PartitionAdapter(cfg).shard(**kwargs)
    except Exception as exc:
        print("ERROR", type(exc).__name__, str(exc)[:300])
        raise SystemExit(0)
    embeddings, labels, loss_mask = out[0], out[1], out[2]
    embeddings = embeddings.transpose(0, 1) if batch_first else embeddings
    rows = (labels[0] - 100).tolist()
    # the embeddings ([S/cp, B, H] here) and the loss mask hold the same positions as the labels
    assert embeddings.shape == (total // 2, 1, 4), tuple(embeddings.shape)
    assert embeddings[:, 0, 0].long().tolist() == rows
    assert (loss_mask[0] - 200).long().tolist() == rows
    kept[rank] = rows
print(json.dumps(kept))
"""


def _split(tree: Path, script: str = SPLIT) -> str:
    done = subprocess.run(
        [sys.executable, "-c", script, str(tree), json.dumps(PADDED)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


TE_ASSERTION = "ERROR AssertionError Please update Transformer Engine"


@pytest.mark.parametrize(
    ("release", "unpatched"),
    [  # the thd-cp-partition variants v0.16, v0.17 and v0.18
        ("0.16.1", {SPLIT: TE_ASSERTION}),
        ("0.17.1", {SPLIT: TE_ASSERTION, MIMO_SPLIT: TE_ASSERTION}),
        (
            "0.19.2",
            {
                SPLIT: "ERROR AttributeError 'NoneType' object has no attribute",
                MIMO_SPLIT: TE_ASSERTION,
            },
        ),
    ],
)
def test_packed_batches_split_per_document_without_te(tmp_path, monkeypatch, release, unpatched):  # noqa: ANN001
    monkeypatch.setenv("MEGATRON_ROCM_CACHE", str(DOWNLOAD_CACHE))
    tree = tmp_path / release
    assert main(["apply", "--source", "pypi", "--ref", release, "--dest", str(tree)]) == 0
    for script in unpatched:
        kept = {int(rank): rows for rank, rows in json.loads(_split(tree, script)).items()}
        assert kept == {rank: thd_rows(PADDED, 2, rank) for rank in (0, 1)}

    without_patch(tree, "thd-cp-partition")
    for script, error in unpatched.items():
        assert _split(tree, script).startswith(error)
