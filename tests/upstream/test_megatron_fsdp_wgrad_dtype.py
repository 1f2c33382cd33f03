"""The ``megatron-fsdp-wgrad-dtype`` patch on a real sdist (0.16.0), on CPU.

Megatron-FSDP hands ``layers.py`` its gradient buffer per backward (``get_main_grad()``); bf16
training keeps it in fp32 by default, and upstream wrote into it with
``torch.matmul(..., out=buffer)``, which refuses bf16 operands (both specs failed that way in
the smoke parallel tier, 2 x H200). The patched backward must leave exactly
``grad_output^T @ input`` in the buffer, whatever it held before (``out=`` overwrites).
"""

from __future__ import annotations

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

BACKWARD = """
import sys, torch
import torch.distributed as dist
sys.path.insert(0, sys.argv[1])
dist.init_process_group("gloo", rank=0, world_size=1, init_method="tcp://127.0.0.1:" + sys.argv[2])
from megatron.core.tensor_parallel.layers import (
    linear_with_grad_accumulation_and_async_allreduce as linear,
)
torch.manual_seed(0)
x = torch.randn(4, 2, 8, dtype=torch.bfloat16, requires_grad=True)
w = torch.nn.Parameter(torch.randn(6, 8, dtype=torch.bfloat16))
buffer = torch.full((6, 8), 7.0)  # what the bucket held before: out= overwrites it
w.__fsdp_param__ = True
w.get_main_grad = lambda: buffer
y = linear(x, w, None, gradient_accumulation_fusion=True, allreduce_dgrad=False,
           sequence_parallel=False, tp_group=dist.group.WORLD)
(y.float() * torch.arange(y.numel()).reshape(y.shape)).sum().backward()
grad_output = torch.arange(y.numel()).reshape(-1, 6).to(torch.bfloat16).double()
expected = grad_output.t() @ x.detach().reshape(-1, 8).double()
print("MAXREL", float(((buffer.double() - expected).abs() / expected.abs().max()).max()))
"""


def _backward(tree: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", BACKWARD, str(tree), str(free_port())],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_fp32_main_grad_from_bf16_operands(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("MEGATRON_ROCM_CACHE", str(DOWNLOAD_CACHE))
    tree = tmp_path / "0.16.0"
    assert main(["apply", "--source", "pypi", "--ref", "0.16.0", "--dest", str(tree)]) == 0
    done = _backward(tree)
    assert done.returncode == 0, done.stderr[-3000:]
    assert float(done.stdout.split("MAXREL")[-1]) < 1e-6  # fp32 accumulation of bf16 products

    without_patch(tree, "megatron-fsdp-wgrad-dtype")
    unpatched = _backward(tree)
    assert unpatched.returncode != 0
    assert "Expected out tensor to have dtype" in unpatched.stderr
