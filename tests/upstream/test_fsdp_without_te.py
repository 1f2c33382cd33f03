"""What ``fsdp-without-te`` changes in torch FSDP2's wrapper, on a real sdist (0.15.3), on CPU.

Without TE a ``ColumnParallelLinear`` inside a module FSDP2 already sharded is sharded with it
(the native TE linears inside their layer: sharding them again failed on 2 x H200), and one
at the top of the model is still sharded on its own, which upstream's own
``test_fsdp2_constructor`` asserts (the patch's first form broke that test on the GPU).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from cache_paths import DOWNLOAD_CACHE
from patched_trees import without_patch

from megatron_rocm.envtools.smoke.world import free_port
from megatron_rocm.main import main

pytestmark = [pytest.mark.upstream, pytest.mark.slow, pytest.mark.torch, pytest.mark.full]
pytest.importorskip("torch")
HERE = Path(__file__).resolve().parent

WRAP = """
import sys, torch
import torch.distributed as dist
sys.path.insert(0, sys.argv[1])
dist.init_process_group("gloo", rank=0, world_size=1, init_method="tcp://127.0.0.1:" + sys.argv[2])
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.distributed.torch_fully_sharded_data_parallel import (
    TorchFullyShardedDataParallel,
)
from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_config import TransformerConfig

parallel_state.initialize_model_parallel()
model_parallel_cuda_manual_seed(1)
config = TransformerConfig(num_layers=1, hidden_size=4, num_attention_heads=1)

def column():
    return ColumnParallelLinear(4, 4, config=config, init_method=torch.nn.init.zeros_)

class Block(torch.nn.Module):  # stands for a TransformerLayer holding native TE linears
    def __init__(self):
        super().__init__()
        self.inner = column()

class Model(torch.nn.Module):
    _fsdp_modules = [Block]
    def __init__(self):
        super().__init__()
        self.config = config
        self.block = Block()
        self.head = column()

try:
    wrapped = TorchFullyShardedDataParallel(config, DistributedDataParallelConfig(), Model())
except Exception as exc:
    print("ERROR", type(exc).__name__, exc)
    raise SystemExit(0)
fsdp = lambda m: type(m).__name__.startswith("FSDP")
model = wrapped.module
print("SHARDED", fsdp(model.block), fsdp(model.block.inner), fsdp(model.head))
"""


def _wrap(tree: Path) -> str:
    env = dict(
        os.environ,
        MEGATRON_ROCM_TEST_CPU_SHIM="1",
        PYTHONPATH=str(HERE.parent / "envtools/cpu_site"),
        OMP_NUM_THREADS="1",
    )
    done = subprocess.run(
        [sys.executable, "-c", WRAP, str(tree), str(free_port())],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


def test_nested_linears_shard_with_their_block_and_a_top_level_one_alone(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGATRON_ROCM_CACHE", str(DOWNLOAD_CACHE))
    tree = tmp_path / "0.15.3"
    assert main(["apply", "--source", "pypi", "--ref", "0.15.3", "--dest", str(tree)]) == 0
    assert _wrap(tree) == "SHARDED True False True"

    without_patch(tree, "fsdp-without-te")
    assert "Invariant encountered" in _wrap(tree)  # upstream shards the nested one again
