"""FP8 training saves and resumes through upstream's own ``pretrain_gpt.py`` (CPU, full tier).

A patched full tree from the Megatron-LM mirror (``MEGATRON_ROCM_TEST_MIRROR``), one gloo rank
on the CPU harness of the real-data tests, a tiny Llama on the TE spec (native backend) with
``--fp8-format hybrid --fp8-recipe tensorwise`` (on the CPU the FP8 GEMMs are emulated in fp32
from the quantized operands, the quantization is the GPU's bit for bit). Eight iterations
straight, against four saved with ``torch_dist`` then four resumed in a fresh process: the
resumed losses are the straight run's, as printed, judged by the distributed optimizer's resume
check (``validate_distopt_resume.judge``: from 0.16 upstream's ``training_log`` prints the mean
of a process's first two iterations on its second line, so the resumed run's iteration 6 is
mean(5, 6)). A bf16 run of the same model ends elsewhere, so FP8 did run. Under delayed scaling
(upstream's default recipe, at the 8B example's history of 1024 and ``max``) the checkpoint
holds the amax histories (``backend.fp8_checkpoint``), so the resume repeats the straight run's
losses too. With ``--fp8-param-gather`` (both recipes, no clipping) the run prints the losses of
the run without it; its delayed-scaling resume repeats them (the dequantized weights load back
to their bytes at the restored scale), and a tensorwise resume stays within 1% (the loaded
weight is quantized by its own amax, which its dequantized value may move).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from cache_paths import MIRROR

from megatron_rocm.envtools.smoke.world import free_port
from megatron_rocm.main import main
from scripts.training.validate_distopt_resume import averages_second_log, judge

pytestmark = [pytest.mark.full, pytest.mark.slow, pytest.mark.torch, pytest.mark.upstream]
pytest.importorskip("torch")
REF = "core_v0.16.0"  # the newest full tree for Python 3.11
LAUNCHER = Path(__file__).resolve().parents[1] / "envtools" / "realdata" / "cpu_pretrain.py"
ITERS = 8
MODEL = [
    "--num-layers=2", "--hidden-size=64", "--ffn-hidden-size=128", "--num-attention-heads=4",
    "--group-query-attention", "--num-query-groups=2", "--seq-length=64",
    "--max-position-embeddings=64", "--micro-batch-size=4", "--global-batch-size=4",
    "--normalization=RMSNorm", "--swiglu", "--position-embedding-type=rope",
    "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--attention-dropout=0.0",
    "--hidden-dropout=0.0", "--lr=3e-3", "--min-lr=3e-4", "--lr-decay-style=cosine",
    "--lr-warmup-iters=2", "--clip-grad=1.0", "--seed=1234", "--bf16", "--mock-data",
    "--tokenizer-type=NullTokenizer", "--vocab-size=255", "--split=98,2,0", "--log-interval=1",
    "--eval-iters=0", "--eval-interval=1000", "--transformer-impl=transformer_engine",
    "--distributed-backend=gloo", "--use-distributed-optimizer", f"--train-iters={ITERS}",
]  # fmt: skip
FP8 = ["--fp8-format=hybrid", "--fp8-recipe=tensorwise"]
_LOSS = re.compile(r"\biteration\s+(\d+)/\s*\d+\s*\|.*?\blm loss:\s*(\S+)")

needs_mirror = pytest.mark.skipif(
    not (MIRROR / "HEAD").exists(),
    reason="needs a Megatron-LM git mirror (MEGATRON_ROCM_TEST_MIRROR)",
)


def train(tree: Path, log: Path, *extra: str) -> dict[int, float]:
    """One ``pretrain_gpt.py`` process; its losses by iteration, as printed."""
    env = {
        **os.environ,
        "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1",
        "CUDA_DEVICE_MAX_CONNECTIONS": "1", "CPU_PRETRAIN_CAPABILITY": "9.0",
        "PYTHONPATH": os.pathsep.join([str(tree), str(LAUNCHER.parents[3])]),
    }  # fmt: skip
    cmd = [sys.executable, str(LAUNCHER), "pretrain_gpt.py", *MODEL, *extra]
    done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=900)
    log.write_text(done.stdout + done.stderr)
    assert done.returncode == 0, "\n".join((done.stdout + done.stderr).splitlines()[-30:])
    return {int(m.group(1)): float(m.group(2)) for m in _LOSS.finditer(done.stdout + done.stderr)}


def resumes_as_straight(tree: Path, straight: dict[int, float], resumed: dict[int, float]) -> None:
    """The resumed run's losses are the straight run's, as printed (upstream's averaging of
    a process's first two lines allowed for)."""
    after = range(ITERS // 2 + 1, ITERS + 1)
    assert sorted(resumed) == list(after)  # it loaded iteration 4
    status, detail = judge(
        [straight[i] for i in after], [resumed[i] for i in after], averages_second_log(tree),
        first=after[0],
    )  # fmt: skip
    assert status == "pass", detail


@needs_mirror
def test_fp8_training_resumes_where_it_stopped(tmp_path: Path) -> None:
    tree = tmp_path / REF
    assert main(["apply", "--source", str(MIRROR), "--ref", REF, "--dest", str(tree)]) == 0
    straight = train(tree, tmp_path / "straight.log", *FP8)
    ckpt = tmp_path / "ckpt"
    save = [f"--save={ckpt}", f"--load={ckpt}", f"--save-interval={ITERS // 2}"]
    first = train(tree, tmp_path / "first.log", *FP8, *save, f"--exit-interval={ITERS // 2}")
    resumed = train(tree, tmp_path / "resumed.log", *FP8, *save)
    assert sorted(straight) == list(range(1, ITERS + 1))
    assert sorted(first) == list(range(1, ITERS // 2 + 1))
    assert {i: straight[i] for i in first} == first  # the same start, as printed
    resumes_as_straight(tree, straight, resumed)
    bf16 = train(tree, tmp_path / "bf16.log")
    assert bf16[ITERS] != straight[ITERS]  # FP8's rounding shows by the last iteration


@needs_mirror
def test_fp8_delayed_scaling_resumes_where_it_stopped(tmp_path: Path) -> None:
    """The amax histories are in the checkpoint: without them the resumed run's first
    quantizes scale by their own amax and its losses move off the straight run's."""
    tree = tmp_path / REF
    assert main(["apply", "--source", str(MIRROR), "--ref", REF, "--dest", str(tree)]) == 0
    delayed = ["--fp8-format=hybrid", "--fp8-recipe=delayed", "--fp8-amax-history-len=1024",
               "--fp8-amax-compute-algo=max"]  # fmt: skip
    straight = train(tree, tmp_path / "straight.log", *delayed)
    ckpt = tmp_path / "ckpt"
    save = [f"--save={ckpt}", f"--load={ckpt}", f"--save-interval={ITERS // 2}"]
    train(tree, tmp_path / "first.log", *delayed, *save, f"--exit-interval={ITERS // 2}")
    resumes_as_straight(tree, straight, train(tree, tmp_path / "resumed.log", *delayed, *save))
    tensorwise = train(tree, tmp_path / "tensorwise.log", *FP8)
    assert tensorwise[ITERS] != straight[ITERS]  # the recipes differ: delayed did run


@needs_mirror
@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_fp8_param_gather_trains_as_without_it_and_resumes(tmp_path: Path, recipe: str) -> None:
    """``--fp8-param-gather``: the FP8 weights live as bytes in the distributed optimizer's
    buffer and are cast from its fp32 mains, bit for bit the quantize the linears make without
    the flag, so the losses are the same, as printed (no clipping: the grad norm's summation
    order follows the buffers' layout, which the uint8 buffer changes). A resume from the
    checkpoint (the dequantized weights) stays within 1% of the run that never stopped: until
    its first optimizer step the FP8 weight is the saved bf16 weight quantized again."""
    tree = tmp_path / REF
    assert main(["apply", "--source", str(MIRROR), "--ref", REF, "--dest", str(tree)]) == 0
    flags = ["--fp8-format=hybrid", f"--fp8-recipe={recipe}", "--clip-grad=0"]
    if recipe == "delayed":
        flags += ["--fp8-amax-history-len=1024", "--fp8-amax-compute-algo=max"]
    without = train(tree, tmp_path / "without.log", *flags)
    gathered = train(tree, tmp_path / "gathered.log", *flags, "--fp8-param-gather")
    assert sorted(gathered) == list(range(1, ITERS + 1)) and gathered == without
    # the FP8 weights did move to a buffer of their own (uint8), as upstream does with TE's
    buffers = "Number of buckets for gradient all-reduce"
    assert (tmp_path / "without.log").read_text().count(buffers) == 1
    assert (tmp_path / "gathered.log").read_text().count(buffers) == 2
    ckpt = tmp_path / "ckpt"
    save = [f"--save={ckpt}", f"--load={ckpt}", f"--save-interval={ITERS // 2}"]
    train(tree, tmp_path / "first.log", *flags, "--fp8-param-gather", *save,
          f"--exit-interval={ITERS // 2}")  # fmt: skip
    resumed = train(tree, tmp_path / "resumed.log", *flags, "--fp8-param-gather", *save)
    if recipe == "delayed":
        resumes_as_straight(tree, gathered, resumed)
    else:
        assert sorted(resumed) == list(range(ITERS // 2 + 1, ITERS + 1))  # loaded iteration 4
        assert abs(resumed[ITERS] - gathered[ITERS]) <= 0.01 * gathered[ITERS]
