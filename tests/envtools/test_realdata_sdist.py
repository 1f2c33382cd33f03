"""The real-data tier in CI: a patched megatron-core sdist from PyPI, trained on a real corpus, CPU.

What CI can reach is a package index, not GitHub, and sdists hold ``megatron/core`` only (no
``tools/preprocess_data.py``, no ``pretrain_gpt.py``; ``test_realdata_cpu.py`` runs those from
a Megatron-LM mirror where there is one). So ``realdata/sdist_pretrain.py`` takes the same path
through megatron.core itself: the corpus and BPE of ``envtools.smoke.realdata``, the
``.bin/.idx`` written by upstream's ``IndexedDatasetBuilder`` (one EOD per document, as
preprocess_data.py appends), the C++ helpers built as ``install`` builds them, the GPT dataset
from ``BlendedMegatronDatasetBuilder``, a GPTModel on the TE spec (native backend) trained by
Megatron's DDP, optimizer, LR scheduler and forward-backward schedule, saved with
``dist_checkpointing`` (torch_dist) and resumed in a fresh process. The verdict is the smoke
check's (``checks_realdata.judge``): the loss ends well below the corpus's unigram entropy and
the resumed run continues from the saved loss.

In CI (``CI`` set) nothing here skips: a missing sdist or import fails the test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cache_paths import DOWNLOAD_CACHE

from megatron_rocm.main import main

pytestmark = [pytest.mark.full, pytest.mark.slow, pytest.mark.torch, pytest.mark.upstream]
IN_CI = os.environ.get("CI", "").lower() not in ("", "0", "false")
RELEASE = "0.16.1"  # the newest megatron-core whose sdist installs on Python 3.11
WORKER = Path(__file__).resolve().parent / "realdata" / "sdist_pretrain.py"
REPO = Path(__file__).resolve().parents[2]
IMPORTS = (
    ("torch", "training"),
    ("numpy", "Megatron's indexed dataset"),
    ("psutil", "Megatron's torch_dist checkpoint writer"),
    ("einops", "megatron.core's models"),
    ("pybind11", "Megatron's C++ dataset helpers"),
    ("regex", "the GPT-2 pre-tokenizer of the local BPE"),
)


def unavailable(why: str) -> None:
    """Skip where a developer lacks a package or the index; in CI that is a failure."""
    if IN_CI:
        pytest.fail(f"{why} (CI must run the real-data tier, not skip it)")
    pytest.skip(why)


def needs_imports() -> None:
    import importlib.util

    for mod, why in IMPORTS:
        if importlib.util.find_spec(mod) is None:
            unavailable(f"{why} imports {mod}; the cpu-test extra installs it")


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The series applied to the PyPI sdist (downloaded once into the tests' cache)."""
    dest = tmp_path_factory.mktemp("sdist") / RELEASE
    with pytest.MonkeyPatch.context() as env:
        env.setenv("MEGATRON_ROCM_CACHE", str(DOWNLOAD_CACHE))
        code = main(["apply", "--source", "pypi", "--ref", RELEASE, "--dest", str(dest)])
    if code != 0:
        unavailable(f"`apply --source pypi --ref {RELEASE}` exited {code} (no package index?)")
    return dest


def phase(name: str, tree: Path, work: Path, lr: float | None = None) -> dict:
    """One process of the worker (a gloo rank of its own); its JSON, or the end of its log."""
    from megatron_rocm.envtools.smoke.world import free_port

    env = dict(os.environ, MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    if lr is not None:
        env["SDIST_PRETRAIN_LR"] = str(lr)
    out = work / f"{name}.json"
    cmd = [sys.executable, str(WORKER), name, "--tree", str(tree), "--work", str(work)]
    res = subprocess.run(
        [*cmd, "--out", str(out)], env=env, capture_output=True, text=True, timeout=600
    )
    if res.returncode != 0 or not out.is_file():
        tail = "\n".join((res.stdout + res.stderr).splitlines()[-25:])
        pytest.fail(f"sdist_pretrain.py {name} exited {res.returncode}:\n{tail}")
    return json.loads(out.read_text())


def results(tree: Path, work: Path, lr: float | None = None):  # noqa: ANN201 - checks' Results
    """Both processes, as the smoke check's ``Results``; plus the raw JSON of each."""
    from megatron_rocm.envtools.smoke import checks_realdata as checks

    first = phase("first", tree, work, lr)
    resumed = phase("resume", tree, work, lr)
    texts, vocab, ranks = checks.corpus_and_tokenizer(work / "expected")
    r = checks.Results(
        first["tokens"],
        checks.expected_tokens(texts, vocab, ranks),
        first["entropy"],
        checks.Run({int(k): v for k, v in first["losses"].items()}),
        checks.Run({int(k): v for k, v in resumed["losses"].items()}),
    )
    return r, first, resumed


def test_corpus_to_trained_resumed_checkpoint_on_a_pypi_sdist(tree, tmp_path) -> None:
    """JSONL-equivalent corpus -> .bin/.idx -> GPT dataset -> 40 iterations of the TE spec
    with a torch_dist save at 20 and a resume in a fresh process: the smoke check's verdict."""
    needs_imports()
    from megatron_rocm.envtools.smoke import checks_realdata as checks

    r, first, resumed = results(tree, tmp_path / "work")
    detail = checks.judge(r)  # raises CheckFailed with the reason
    print(detail)
    assert r.tokens == r.expected_tokens > 30_000
    assert 3.0 < r.entropy < 4.5
    assert r.first.losses[1] > r.entropy  # a fresh model knows not even the frequencies
    assert first["linear_qkv"].startswith("megatron_rocm.runtime.backend"), first["linear_qkv"]
    half = checks.ITERS // 2
    gbs = int(checks.HPARAMS["global-batch-size"])
    # the optimizer and LR schedule came back from the checkpoint, not only the weights
    assert resumed["loaded"] == {"scheduler_samples": half * gbs, "adam_steps": [float(half)]}
    meta = json.loads((tmp_path / "work" / "checkpoint" / "metadata.json").read_text())
    assert meta["sharded_backend"] == "torch_dist"
