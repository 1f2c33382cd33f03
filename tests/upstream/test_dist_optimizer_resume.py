"""The ``dist-optimizer-resume`` patch on real megatron-core sdists, on CPU.

Megatron's own DistributedOptimizer, DDP buffers and ``dist_checkpointing`` run unmodified in
a gloo world of 1 or 2 processes (``distopt_roundtrip.py``; ``cpu_shim`` maps their CUDA
allocations to the CPU). Each case trains a tiny model 3 steps, saves it in one checkpoint
format, loads it into a fresh optimizer and trains on: the loaded state (main params,
exp_avg, exp_avg_sq, per-parameter step, grad scaler) must equal the saved one and the
continued losses and states must be bit-identical to the run that never stopped.

The trees get the series' ``optimizer`` patch (megatron_rocm's FusedAdam, a torch AdamW, as
on a patched tree) and, unless a case says otherwise, ``dist-optimizer-resume``. Every
variant of the patch is exercised: 0.12.0, 0.14.0 (v0.13), 0.15.0, 0.16.0, 0.19.2 (v0.17).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from cache_paths import DOWNLOAD_CACHE

from megatron_rocm.patchtool import pypi
from megatron_rocm.patchtool.series import load_series, parse_version

pytestmark = [pytest.mark.upstream, pytest.mark.slow, pytest.mark.torch, pytest.mark.full]
pytest.importorskip("torch")
WORKER = Path(__file__).with_name("distopt_roundtrip.py")
PATCH = "dist-optimizer-resume"


def tree_for(version: str, patches: tuple[str, ...], root: Path) -> Path:
    """``megatron/core`` of the sdist with ``patches`` applied (in series order) by git apply."""
    tree = root / f"{version}-{'-'.join(patches) or 'unpatched'}"
    if tree.is_dir():
        return tree
    with pytest.MonkeyPatch.context() as mp:  # the shared download cache, not the test HOME
        mp.setenv("MEGATRON_ROCM_CACHE", str(DOWNLOAD_CACHE))
        sdist = pypi.fetch_sdist(version)
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if "/megatron/core/" in m.name and m.isfile()]
        for m in members:
            m.name = m.name.split("/", 1)[1]
        tar.extractall(tree, members=members, filter="data")
    series = load_series()
    for pid in patches:
        patch = series.get(pid)
        variant = patch.variant_for(parse_version(version))
        assert variant is not None and not variant.skip, (pid, version)
        subprocess.run(
            ["git", "apply", "--include=megatron/core/*", str(patch.diff_path(variant))],
            cwd=tree,
            check=True,
        )
    return tree


@pytest.fixture(scope="module")
def trees(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("trees")
    cache: dict = {}

    def get(version: str, patched: bool = True) -> Path:
        patches = ("optimizer", PATCH) if patched else ("optimizer",)
        if (version, patches) not in cache:
            cache[(version, patches)] = tree_for(version, patches, root)
        return cache[(version, patches)]

    return get


def roundtrip(
    tree: Path, fmt: str, precision: str, world: int, tmp_path: Path, *extra: str
) -> dict:
    if fmt.startswith("torch_dist"):
        pytest.importorskip("psutil", reason="megatron's torch_dist writer needs psutil")
    out = tmp_path / "result.json"
    cmd = [sys.executable, str(WORKER), "--tree", str(tree), "--format", fmt]
    cmd += ["--precision", precision, "--world", str(world), "--out", str(out), *extra]
    subprocess.run(cmd, check=True, timeout=600)
    return json.loads(out.read_text())


CASES = [
    # (sdist, format as training picks it at that version, precision, DP ranks)
    ("0.12.0", "torch", "bf16", 2),
    ("0.12.0", "torch_dist:fully_sharded_model_space", "fp16", 2),  # 0.12-0.14 default
    ("0.14.0", "torch_dist:dp_zero_gather_scatter", "bf16", 2),  # --no-ckpt-fully-parallel-save
    ("0.15.0", "torch_dist:dp_reshardable", "fp16", 2),  # the default from 0.15
    ("0.16.0", "torch", "fp16", 2),
    ("0.16.0", "torch_dist:fully_reshardable", "bf16", 1),  # --dist-ckpt-optim-fully-reshardable
    ("0.19.2", "torch_dist:dp_reshardable", "bf16", 2),
    ("0.19.2", "torch", "fp16", 1),
]


@pytest.mark.parametrize(("version", "fmt", "precision", "world"), CASES)
def test_save_load_continues_bit_exactly(trees, tmp_path, version, fmt, precision, world):
    result = roundtrip(trees(version), fmt, precision, world, tmp_path)
    assert result["errors"] == []
    assert result["load_diffs"] == [] and result["final_diffs"] == []
    assert result["losses"]["resumed"] == result["losses"]["straight"]
    assert result["steps_after"] == [6.0]  # 3 before the save + 3 after, on every parameter
    assert result["ok"]


@pytest.mark.parametrize(
    ("version", "fmt", "error"),
    [
        # what users without TE/Apex hit (issue 12); the fresh optimizer has no 'step' yet
        ("0.16.0", "torch_dist:dp_reshardable", "load: AssertionError"),
        ("0.19.2", "torch", "load: KeyError: 'step'"),
        ("0.15.0", "torch_dist:dp_reshardable", "save: AssertionError"),  # 0-dim step as bucket
        ("0.12.0", "torch", "train: RuntimeError: Invalid Transformer Engine version"),
    ],
)
def test_without_the_patch_resume_fails(trees, tmp_path, version, fmt, error):
    result = roundtrip(trees(version, patched=False), fmt, "bf16", 1, tmp_path)
    assert not result["ok"]
    assert result["error"].startswith(error), result["error"]


def test_nd_flattened_checkpoint_survives_torch_2_11s_metadata_copy(trees, tmp_path):
    """0.12-0.14 set ``mcore_data`` as an attribute on torch's Metadata; torch 2.11 writes a
    ``dataclasses.replace`` copy, so a distributed-optimizer checkpoint lost it and the load
    died with AttributeError (smoke on 2 x H200, core_v0.12.0). The patch carries upstream's
    0.15 fix (an ``MCoreMetadata`` dataclass)."""
    fmt = "torch_dist:fully_sharded_model_space"
    result = roundtrip(trees("0.12.0"), fmt, "bf16", 2, tmp_path, "--finish-on-a-copy")
    assert result["errors"] == [] and result["ok"], result.get("error")
    assert result["losses"]["resumed"] == result["losses"]["straight"]


# The planner never writes, so psutil (imported at module level by 0.12's torch_dist writer,
# for its memory log) gets an empty stand-in where it is not installed.
PLANNER = """
import dataclasses, sys, types
try:
    import psutil
except ImportError:
    sys.modules["psutil"] = types.ModuleType("psutil")
sys.path.insert(0, sys.argv[1])
from megatron.core.dist_checkpointing.strategies.torch import MCoreSavePlan, MCoreSavePlanner
shape = {"k": {"nd_reformulated_orig_global_shape": (2, 3)}}
_, metadata = MCoreSavePlanner(flatten_state_dict=False).create_global_plan(
    [MCoreSavePlan(items=[], mcore_data=shape)]
)
print(getattr(dataclasses.replace(metadata), "mcore_data", None) == shape)
"""


@pytest.mark.parametrize(
    ("version", "patched"),
    [("0.12.0", True), ("0.12.0", False), ("0.14.0", True), ("0.14.0", False)],
)
def test_planner_metadata_keeps_mcore_data_through_a_copy(trees, version, patched):
    tree = trees(version, patched=patched)
    out = subprocess.run(
        [sys.executable, "-c", PLANNER, str(tree)], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] == str(patched)


@pytest.mark.parametrize(
    ("version", "fmt", "step"),
    [
        ("0.19.2", "torch_dist:dp_reshardable", "1234"),
        ("0.12.0", "torch", "1234"),
        ("0.19.2", "torch_dist:dp_reshardable", "none"),
    ],
)
def test_the_step_before_the_first_optimizer_step_survives_save_and_load(
    trees, tmp_path, version, fmt, step
):
    """Upstream's ``test_optimizer_common_state_dict`` at two ranks: the param groups' ``step``
    (where FusedAdam starts each parameter's own step) was reported as None before the first
    optimizer step, so 1234 set there was saved as None (2 x H200, main); and with no step set,
    the loaded optimizer reported 0.0 (its parameters' steps) where the saved one said None."""
    result = roundtrip(trees(version), fmt, "bf16", 2, tmp_path, "--group-step", step)
    assert result["errors"] == [] and result["ok"], result
    want = None if step == "none" else int(step)
    assert result["group_steps"]["loaded"] and set(result["group_steps"]["loaded"]) == {want}
