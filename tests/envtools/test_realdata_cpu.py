"""The real-data path on the CPU, extra (mirror) variant: upstream's ``preprocess_data.py`` and
``pretrain_gpt.py`` of a patched full Megatron-LM tree applied from a git mirror
(``MEGATRON_ROCM_TEST_MIRROR``; sdists have neither), one gloo rank.

The tier CI runs everywhere is ``test_realdata_sdist.py`` (a PyPI sdist, megatron.core's own
dataset and training code); the tests here that need the mirror skip without one and add what
only a full tree has: upstream's two scripts, the Makefile behind ``compile_helpers``, the
``tools/checkpoint`` saver, Megatron-Bridge on a full tree.

``real_data_results`` is what the ``real-data.pretrain_gpt`` smoke check runs on a GPU; here
``realdata/cpu_pretrain.py`` launches it with ``cpu_shim``. Also: the two patches this path
needs, each shown failing without its diff.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from cache_paths import MIRROR
from patched_trees import without_patch

from megatron_rocm.envtools.smoke import runner
from megatron_rocm.main import main

pytestmark = [pytest.mark.full, pytest.mark.slow, pytest.mark.torch]
pytest.importorskip("torch")
TRAINING_IMPORTS = (
    ("psutil", "Megatron's torch_dist checkpoint writer"),
    ("six", "megatron.training's BERT tokenizer module"),
    ("yaml", "megatron.training"),
    ("pydantic", "megatron.training (megatron.rl) from 0.16"),
    ("einops", "megatron.training"),
    ("pybind11", "Megatron's C++ dataset helpers"),
)


def needs_training_imports() -> None:
    """What pretrain_gpt.py imports and no megatron-core declares (the cpu-test extra has it)."""
    for mod, why in TRAINING_IMPORTS:
        pytest.importorskip(mod, reason=f"{why} imports it ({mod}); `install` adds it")


from megatron_rocm.envtools.smoke import checks_realdata  # noqa: E402

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
needs_mirror = pytest.mark.skipif(
    not (MIRROR / "HEAD").exists(),
    reason="extra (mirror) variant: needs a Megatron-LM git mirror (MEGATRON_ROCM_TEST_MIRROR); "
    "test_realdata_sdist.py is the real-data tier without one",
)
# Full trees whose requires-python admits 3.11: the oldest and newest by default (0.14.0 and
# 0.15.3 pass too); MEGATRON_ROCM_TEST_REALDATA_REFS=ref,ref,... picks others
NEWEST = "core_v0.16.0"  # the newest full tree for Python 3.11
_DEFAULT_REFS = f"core_v0.12.0,{NEWEST}"
CPU_STEP_TIMEOUT = 900  # seconds per step (preprocess, each training run)
REFS = [
    r for r in os.environ.get("MEGATRON_ROCM_TEST_REALDATA_REFS", _DEFAULT_REFS).split(",") if r
]


@pytest.fixture(scope="module")
def trees(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("full-trees")
    made: dict[str, Path] = {}

    def get(ref: str) -> Path:
        if ref not in made:
            dest = root / ref
            assert main(["apply", "--source", str(MIRROR), "--ref", ref, "--dest", str(dest)]) == 0
            made[ref] = dest
        return made[ref]

    return get


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _foreign_python3(tmp: Path) -> Path:
    """A PATH folder whose ``python3``/``python3-config`` are not this interpreter (a venv
    run by its path under pyenv or conda): they fail, as one without pybind11 does."""
    bin_dir = tmp / "foreign-bin"
    bin_dir.mkdir(exist_ok=True)
    for name in ("python3", "python3-config"):
        (bin_dir / name).write_text("#!/bin/sh\necho 'not this interpreter' >&2\nexit 1\n")
        (bin_dir / name).chmod(0o755)
    return bin_dir


def cpu_env(tmp: Path) -> dict[str, str]:
    return {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "OMP_NUM_THREADS": "1",
        "PATH": f"{_foreign_python3(tmp)}{os.pathsep}{os.environ['PATH']}",
    }


@needs_mirror
@pytest.mark.parametrize("ref", REFS)
def test_mirror_pretrain_gpt_jsonl_to_trained_resumed_checkpoint(trees, tmp_path, ref: str) -> None:
    """preprocess, build the index (helpers compiled for this interpreter although python3
    on PATH is another), train the TE spec 20 iterations, save, resume to 40: the loss ends
    well below the unigram entropy and the resumed run continues from the saved loss."""
    needs_training_imports()
    ctx = runner.Context(tree=trees(ref), device="cpu", gpu_count=0, log=print)
    ctx._workdir = str(tmp_path / "work")
    launcher = [sys.executable, str(HERE / "realdata" / "cpu_pretrain.py")]
    # a shared CPU runner is slower than the GPU the default limits are sized for
    r = checks_realdata.real_data_results(
        ctx, launcher, "gloo", env=cpu_env(tmp_path), timeout=CPU_STEP_TIMEOUT
    )
    detail = checks_realdata.judge(r)
    print(detail)
    assert r.tokens == r.expected_tokens > 30_000
    assert 3.0 < r.entropy < 4.5
    assert r.first.losses[1] > r.entropy  # a fresh model knows not even the frequencies
    assert r.resumed.losses[checks_realdata.ITERS] < checks_realdata.BELOW_ENTROPY * r.entropy
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    assert (trees(ref) / "megatron/core/datasets" / f"helpers_cpp{suffix}").is_file()


def test_judge_refuses_a_restart_and_no_learning() -> None:
    """A resumed run that starts over (loss back at the start), or a loss that never gets
    below the entropy, fails the check with the reason."""
    half, iters = checks_realdata.ITERS // 2, checks_realdata.ITERS

    def results(first: list[float], resumed: list[float]) -> checks_realdata.Results:
        a = checks_realdata.Run(dict(zip(range(1, half + 1), first, strict=True)))
        b = checks_realdata.Run(dict(zip(range(half + 1, iters + 1), resumed, strict=True)))
        return checks_realdata.Results(100, 100, 3.7, a, b)

    falling = [6.2 - 0.15 * i for i in range(half)]  # 6.2 -> 3.35
    good = [3.3 - 0.03 * i for i in range(half)]  # -> 2.73
    assert "resumed 3.30" in checks_realdata.judge(results(falling, good))
    restarted = [6.2 - 0.15 * i for i in range(half)]
    with pytest.raises(runner.CheckFailed, match="did not continue"):
        checks_realdata.judge(results(falling, restarted))
    flat = [3.35] * half
    with pytest.raises(runner.CheckFailed, match="did not learn"):
        checks_realdata.judge(results(falling, flat))


def test_real_data_check_skips_without_gpu_or_full_tree(tmp_path) -> None:
    sdist_like = tmp_path / "tree"
    (sdist_like / "megatron/core").mkdir(parents=True)
    ctx = runner.Context(tree=sdist_like, device="cpu", gpu_count=0)
    with pytest.raises(runner.Skip, match="pretrain_gpt.py, tools/preprocess_data.py not in"):
        checks_realdata.pretrain_gpt_real_data(ctx)
    (sdist_like / "tools").mkdir()
    (sdist_like / "pretrain_gpt.py").write_text("")
    (sdist_like / "tools/preprocess_data.py").write_text("")
    with pytest.raises(runner.Skip, match="needs 1 GPU"):
        checks_realdata.pretrain_gpt_real_data(ctx)


def _unpatched(tree: Path, tmp: Path, patch: str) -> Path:
    copy = tmp / f"without-{patch}"
    shutil.copytree(tree, copy, symlinks=True)
    without_patch(copy, patch)
    return copy


COMPILE = "from megatron.core.datasets.utils import compile_helpers; compile_helpers()"


@needs_mirror
def test_mirror_compile_helpers_builds_for_this_interpreter_and_needs_the_patch(
    trees, tmp_path
) -> None:
    pytest.importorskip("pybind11")
    env = dict(os.environ, PATH=cpu_env(tmp_path)["PATH"])
    tree = trees(NEWEST)
    unfixed = _unpatched(tree, tmp_path, "dataset-helpers-interpreter")
    for t in (tree, unfixed):
        for old in (t / "megatron/core/datasets").glob("helpers_cpp*"):
            old.unlink()
    ok = subprocess.run([sys.executable, "-c", COMPILE], cwd=tree, env=env, capture_output=True)
    assert ok.returncode == 0, ok.stderr.decode()[-800:]
    load = "from megatron.core.datasets import helpers_cpp; print(helpers_cpp.__file__)"
    where = subprocess.run([sys.executable, "-c", load], cwd=tree, capture_output=True, text=True)
    assert where.stdout.strip().endswith(sysconfig.get_config_var("EXT_SUFFIX")), where.stderr
    bad = subprocess.run([sys.executable, "-c", COMPILE], cwd=unfixed, env=env, capture_output=True)
    assert bad.returncode != 0
    assert b"Failed to compile the C++ dataset helper" in bad.stdout + bad.stderr


SAVER = """
import sys, types
sys.path.insert(0, "tools/checkpoint")
from saver_base import MegatronCheckpointSaverBase as S
saver = S.__new__(S)
saver.args = types.SimpleNamespace(megatron_path=None)
saver.insert_megatron_path_and_check_te()
print("checked")
"""


@needs_mirror
def test_mirror_checkpoint_saver_starts_without_te_and_needs_the_patch(trees, tmp_path) -> None:
    pytest.importorskip("packaging")
    tree = trees(NEWEST)
    ok = subprocess.run([sys.executable, "-c", SAVER], cwd=tree, capture_output=True, text=True)
    assert ok.stdout.strip() == "checked", ok.stderr[-800:]
    unfixed = _unpatched(tree, tmp_path, "checkpoint-tools-without-te")
    bad = subprocess.run([sys.executable, "-c", SAVER], cwd=unfixed, capture_output=True, text=True)
    assert "PackageNotFoundError" in bad.stderr and "transformer-engine" in bad.stderr


BRIDGE = "megatron-bridge==0.3.1"  # the newest release for megatron-core < 0.17 (Python 3.11)


@pytest.fixture(scope="module")
def bridge_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Megatron-Bridge's wheel, unpacked; ``--no-deps``: its metadata requires
    transformer-engine, mamba-ssm and nvidia-resiliency-ext, which it does not need here."""
    from cache_paths import DOWNLOAD_CACHE

    cache = DOWNLOAD_CACHE / "megatron-bridge"
    wheels = sorted(cache.glob("megatron_bridge-0.3.1-*.whl"))
    if not wheels:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", BRIDGE, "-d", str(cache)]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            pytest.skip(f"cannot download {BRIDGE}: {res.stderr.strip().splitlines()[-1:]}")
        wheels = sorted(cache.glob("megatron_bridge-0.3.1-*.whl"))
    dest = tmp_path_factory.mktemp("bridge")
    shutil.unpack_archive(str(wheels[0]), dest, "zip")
    return dest


@pytest.mark.upstream
@needs_mirror
def test_mirror_megatron_bridge_llama_round_trip_without_te(trees, bridge_wheel, tmp_path) -> None:
    """HF Llama (config-made) -> Megatron (the TE spec on the native backend) -> HF: logits
    equal HF's and every exported tensor equals the original, TE never imported."""
    needs_training_imports()
    for mod in ("transformers", "rich", "omegaconf"):
        pytest.importorskip(mod, reason=f"Megatron-Bridge imports {mod} (pip install it)")
    tree = trees(NEWEST)  # the bridge 0.3 requires megatron-core >= 0.15, < 0.17
    env = _bridge_env(bridge_wheel, tree, MASTER_PORT=str(_free_port()), OMP_NUM_THREADS="1")
    got = _result_of("bridge_roundtrip.py", [str(tmp_path)], env)
    assert got["have_te"] is False
    assert got["qkv_module"].startswith("megatron_rocm.runtime.backend")
    assert got["max_logit_diff"] < 1e-4
    assert got["same_names"] and got["exact"]


def _bridge_env(bridge_wheel: Path, tree: Path, **extra: str) -> dict[str, str]:
    """This environment with ``extra``, and the unpacked bridge and the tree importable."""
    env = dict(os.environ, **extra)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(bridge_wheel), str(tree), str(REPO), env.get("PYTHONPATH", "")]
    )
    return env


def _result_of(script: str, args: list[str], env: dict[str, str]) -> dict:
    """The ``RESULT {json}`` line of ``realdata/<script>``, which must exit 0 in time."""
    import json

    res = subprocess.run(
        [sys.executable, str(HERE / "realdata" / script), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=CPU_STEP_TIMEOUT,
    )
    line = [x for x in res.stdout.splitlines() if x.startswith("RESULT ")]
    assert res.returncode == 0 and line, res.stderr[-2000:]
    return json.loads(line[0][len("RESULT ") :])


@pytest.mark.upstream
@needs_mirror
def test_mirror_hf_llama_trained_on_jsonl_by_pretrain_gpt_and_back_to_hf(
    trees, bridge_wheel, tmp_path, monkeypatch
) -> None:
    """The whole user path of docs/real-data.md: a Hugging Face Llama -> a Megatron checkpoint
    (Megatron-Bridge converts, dist_checkpointing writes) -> upstream's preprocess_data.py on a
    JSONL corpus -> pretrain_gpt.py --load --finetune on it (TE spec, native backend) -> back to
    Hugging Face, whose logits equal Megatron's. TE is never imported."""
    import math

    needs_training_imports()
    for mod in ("transformers", "rich", "omegaconf"):
        pytest.importorskip(mod, reason=f"Megatron-Bridge imports {mod} (pip install it)")
    monkeypatch.syspath_prepend(str(HERE / "realdata"))
    from tiny_llama import MEGATRON_ARGS, VOCAB

    tree = trees(NEWEST)  # the bridge 0.3 requires megatron-core >= 0.15, < 0.17
    env = _bridge_env(bridge_wheel, tree, **cpu_env(tmp_path))
    imported = _result_of("bridge_finetune.py", ["import", str(tmp_path)], env)
    assert imported["have_te"] is False
    assert imported["hf_loss_on_random_tokens"] > math.log(VOCAB) + 2  # the scaled-up head

    ctx = runner.Context(tree=tree, device="cpu", gpu_count=0, log=print)
    ctx._workdir = str(tmp_path / "work")
    work = tmp_path / "work" / "real-data"
    work.mkdir(parents=True)
    full_env = checks_realdata._env(tree, cpu_env(tmp_path))
    data, entropy, _, _ = checks_realdata.prepare(ctx, tree, work, full_env, CPU_STEP_TIMEOUT)
    iters = 30
    log = tmp_path / "finetune.log"
    cmd = [
        sys.executable, str(HERE / "realdata" / "cpu_pretrain.py"), "pretrain_gpt.py",
        *MEGATRON_ARGS, *checks_realdata._tokenizer_args(tree, work / "tokenizer"),
        f"--data-path={data}", "--split=98,2,0", "--micro-batch-size=8", "--global-batch-size=8",
        "--lr=3e-3", "--min-lr=3e-4", "--lr-decay-style=cosine", "--lr-warmup-iters=2",
        f"--train-iters={iters}", "--log-interval=1", "--eval-iters=1", "--eval-interval=1000",
        "--transformer-impl=transformer_engine", "--distributed-backend=gloo",
        f"--load={tmp_path / 'megatron'}", "--finetune", "--no-load-optim", "--no-load-rng",
        f"--save={tmp_path / 'trained'}", f"--save-interval={iters}",
    ]  # fmt: skip
    with log.open("w") as f:
        rc = subprocess.run(
            cmd, cwd=tree, env=full_env, stdout=f, stderr=subprocess.STDOUT
        ).returncode
    text = log.read_text()
    assert rc == 0, text[-3000:]
    losses = checks_realdata.losses(text)
    print(f"finetune: loss {losses[1]:.2f} -> {losses[iters]:.2f}, unigram entropy {entropy:.2f}")
    assert losses[1] > math.log(VOCAB) + 2, losses  # it started from the HF weights
    assert losses[iters] < entropy, losses  # and learned the text

    exported = _result_of("bridge_finetune.py", ["export", str(tmp_path)], env)
    assert exported["have_te"] is False
    assert exported["changed"] == exported["tensors"]  # every tensor trained
    print(
        f"decoder cosine to HF's: {exported['decoder_cosine']:.2f} (fresh {exported['fresh_cosine']:.2f})"
    )
    assert exported["decoder_cosine"] > 0.3 > abs(exported["fresh_cosine"])  # from HF's weights
    assert exported["max_logit_diff"] < 1e-4 * exported["logit_scale"]
