"""scripts/training/markov_corpus.py: the source is what it says (each token a successor of the one
before it, Zipf-distributed successors, the entropy rate the tables' entropy weighted by the
chain's stationary distribution, computed here by power iteration), and the dataset it writes
reads back through a real megatron-core tree's own ``IndexedDataset`` (full tier)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from script_run import run_module

from scripts.training import markov_corpus as mc

REPO = Path(__file__).resolve().parents[2]


def test_every_token_is_a_successor_of_the_one_before_it() -> None:
    source = mc.make_source(500, k=4, seed=3)
    tokens, _ = mc.sample(source, documents=20, length=50, seed=4)
    assert tokens.shape == (20, 50) and tokens.min() >= 0 and tokens.max() < 500
    for row in tokens:
        for t in range(1, len(row)):
            assert row[t] in source.candidates[row[t - 1]]


def _stationary(source: mc.MarkovSource, steps: int = 500) -> np.ndarray:
    """The chain's long-run token distribution, by power iteration over its tables."""
    pi = np.full(source.vocab, 1.0 / source.vocab)
    for _ in range(steps):
        nxt = np.zeros_like(pi)
        np.add.at(nxt, source.candidates, pi[:, None] * source.probabilities)
        pi = nxt
    return pi


def test_entropy_rate_is_the_tables_entropy_weighted_by_how_often_each_is_used() -> None:
    source = mc.make_source(2000, seed=5)
    _, nll = mc.sample(source, documents=200, length=2048, seed=6)
    p = source.probabilities
    rate = float((_stationary(source) * -(p * np.log(p)).sum(axis=1)).sum())
    assert mc.entropy_rate(nll, 200, 2048) == pytest.approx(rate, rel=0.03)
    assert 0.5 < rate < np.log(2000) / 2  # far below uniform: there is a lot to learn


def test_successors_follow_a_zipf_law() -> None:
    """A few tokens are frequent, as words are in text: the loss falls fast at first."""
    source = mc.make_source(5000, seed=7)
    counts = np.sort(np.bincount(source.candidates.ravel(), minlength=5000))[::-1]
    assert counts[0] > 20 * counts[100] > 0
    tokens, _ = mc.sample(source, 50, 2048, seed=8)
    freq = np.bincount(tokens.ravel(), minlength=5000) / tokens.size
    nz = freq[freq > 0]
    assert -(nz * np.log(nz)).sum() < 0.8 * np.log(5000)  # unigram entropy well below uniform


def test_the_corpus_is_a_function_of_the_seed() -> None:
    source = mc.make_source(1000, seed=1)
    a, _ = mc.sample(source, 4, 64, seed=2)
    b, _ = mc.sample(source, 4, 64, seed=2)
    c, _ = mc.sample(source, 4, 64, seed=3)
    assert (a == b).all() and not (a == c).all()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--vocab", "2"], "at least 3"),
        (["--tokens", "0"], "must be positive"),
        (["--length", "1"], "at least 2"),
    ],  # fmt: skip
)
def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, args: list[str], message: str) -> None:
    (tmp_path / "megatron" / "core" / "datasets").mkdir(parents=True)
    (tmp_path / "megatron" / "core" / "datasets" / "indexed_dataset.py").write_text("")
    done = run_module("scripts.training.markov_corpus", tmp_path, "x", *args)
    assert done.returncode == 2 and message in done.stderr.splitlines()[-1]


def test_a_folder_that_is_not_megatron_is_refused(tmp_path: Path) -> None:
    (tmp_path / "megatron" / "core").mkdir(parents=True)  # no datasets/ in it
    with pytest.raises(SystemExit) as e:
        mc.parse_cli([str(tmp_path), str(tmp_path / "c")])
    assert e.value.code == 2


READ_BACK = """
import json, sys
import numpy as np
from megatron.core.datasets.indexed_dataset import IndexedDataset
ds = IndexedDataset(sys.argv[1])
print(json.dumps({"documents": len(ds), "rows": [np.asarray(ds[i]).tolist() for i in range(len(ds))],
                  "dtype": str(ds.index.dtype.__name__)}))
"""


@pytest.mark.full
@pytest.mark.slow
@pytest.mark.torch
@pytest.mark.upstream
def test_the_dataset_reads_back_through_megatron_core(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from cache_paths import DOWNLOAD_CACHE

    from megatron_rocm.main import main

    tree = tmp_path / "tree"
    with pytest.MonkeyPatch.context() as env:
        env.setenv("MEGATRON_ROCM_CACHE", str(DOWNLOAD_CACHE))
        code = main(["apply", "--source", "pypi", "--ref", "0.16.1", "--dest", str(tree)])
    if code != 0 and not os.environ.get("CI"):
        pytest.skip(f"apply --source pypi exited {code} (no package index?)")
    assert code == 0
    # in a child: the writer imports the tree's megatron, which must not stay in this process
    write = [sys.executable, "-m", "scripts.training.markov_corpus", str(tree), str(tmp_path / "c")]
    subprocess.run([*write, "--tokens", "640", "--length", "64"], cwd=REPO, check=True)
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run(
        [sys.executable, "-c", READ_BACK, str(tmp_path / "c")],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    got = json.loads(done.stdout)
    expected, _ = mc.sample(mc.make_source(31997, seed=1234), 10, 64, seed=1235)
    assert got["documents"] == 10 and got["dtype"] == "uint16"
    assert got["rows"] == expected.tolist()
