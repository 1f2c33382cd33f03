"""The command line every single-process upstream probe shares: ``--tree`` and ``--out``, and
the probe's result (or the error it raised, with its trace) written to ``--out`` as JSON, so
the test reports a probe's failure instead of a missing file; and ``applied_and_probed``, the
tests' side: apply the series to a PyPI sdist and run a probe on it (``probed``: run a probe on
a tree as it is); ``one_rank_world``, the probe's side: the tree, the CPU and a one-rank world;
``small_block_config``, the FP8 probes' block."""

from __future__ import annotations

import argparse
import json
import traceback
from collections.abc import Callable
from pathlib import Path


def main(run: Callable[[argparse.Namespace], dict]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tree", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    try:
        result = run(args)
    except Exception as exc:  # the test reports it with the trace
        result = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
    Path(args.out).write_text(json.dumps(result))
    return 0


def one_rank_world(args: argparse.Namespace, cpu: bool = True) -> None:
    """The probe's setting: ``--tree`` first on the path, warnings off, upstream's CUDA
    allocations on the CPU (``cpu_shim``; ``cpu=False`` leaves them), and a one-rank gloo world
    with Megatron's parallel state, its store beside the result (not left in /tmp)."""
    import sys
    import warnings

    sys.path.insert(0, args.tree)
    warnings.simplefilter("ignore")
    import torch.distributed as dist

    if cpu:
        sys.path.insert(0, str(Path(__file__).parent))
        import cpu_shim

        cpu_shim.install()
    store = Path(args.out).with_name("gloo.store")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel()


def applied_and_probed(probe: Path, release: str, dest: Path, timeout: int = 900) -> dict:
    """The test side: the series applied to the PyPI sdist ``release`` in ``dest`` (downloads
    cached in the test cache), ``probe`` run on that tree in a fresh interpreter, its result;
    a probe that raised fails the test with its trace."""
    import pytest
    from cache_paths import DOWNLOAD_CACHE

    from megatron_rocm.main import main as megatron_rocm

    with pytest.MonkeyPatch.context() as env:
        env.setenv("MEGATRON_ROCM_CACHE", str(DOWNLOAD_CACHE))
        argv = ["apply", "--source", "pypi", "--ref", release, "--dest", str(dest)]
        assert megatron_rocm(argv) == 0
    return probed(probe, dest, dest.parent / f"{probe.stem}-{release}.json", timeout)


def probed(probe: Path, tree: Path, out: Path, timeout: int = 900) -> dict:
    """``probe`` run on ``tree`` in a fresh interpreter, its result (also left in ``out``); a
    probe that raised fails the test with its trace."""
    import os
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), str(repo)])}
    cmd = [sys.executable, str(probe), "--tree", str(tree), "--out", str(out)]
    subprocess.run(cmd, cwd=tree, env=env, check=True, timeout=timeout)
    result = json.loads(out.read_text())
    assert "error" not in result, f"{result['error']}\n{result.get('trace')}"
    return result


def relative_error(a: list, b: list) -> float:
    """``|a - b| / |b|`` (Frobenius norms, float64) of two results a probe wrote as lists: how
    far a run's output or gradient is from its reference's."""
    import torch

    a, b = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    return ((a - b).norm() / b.norm()).item()


def small_block_config(layers: int, hidden: int, heads: int, **settings):  # noqa: ANN003, ANN201
    """The FP8 probes' ``TransformerConfig``: a small bf16 RMSNorm block without biases,
    dropout, gradient-accumulation fusion or upstream's fused kernels, initialised on the CPU;
    ``settings`` add the recipe, the parallelism or the experts."""
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=layers, hidden_size=hidden, num_attention_heads=heads, ffn_hidden_size=128,
        normalization="RMSNorm", add_bias_linear=False, use_cpu_initialization=True,
        hidden_dropout=0.0, attention_dropout=0.0, gradient_accumulation_fusion=False,
        bias_dropout_fusion=False, masked_softmax_fusion=False, bias_activation_fusion=False,
        apply_rope_fusion=False, bf16=True, params_dtype=torch.bfloat16, **settings,
    )  # fmt: skip


def count_blockwise_forwards(calls: dict) -> bool:
    """Count the block-scaled FP8 linear's forwards in ``calls["blockwise"]``; whether this
    megatron-core offers ``--fp8-recipe blockwise`` at all (its choices have it from 0.13)."""
    from megatron.core import enums

    from megatron_rocm.runtime.backend import fp8_blockwise

    forward = fp8_blockwise.Fp8BlockwiseLinearFunction.forward

    def counted(ctx, *a):  # noqa: ANN001, ANN002, ANN202
        calls["blockwise"] = calls.get("blockwise", 0) + 1
        return forward(ctx, *a)

    fp8_blockwise.Fp8BlockwiseLinearFunction.forward = staticmethod(counted)
    return hasattr(getattr(enums, "Fp8Recipe", None), "blockwise")
