#!/usr/bin/env python3
"""A corpus a model cannot memorise: tokens of a random Markov source, as an indexed dataset.

Mock data repeats a few sequences, so after a hundred iterations two runs' losses are compared
on memorised text and agree whatever the numerics do. Here every sample is fresh (the corpus is
larger than the run reads) and each token is drawn from a small random table of successors of
the token before it, the successors Zipf-distributed over the vocabulary as words are in text:
the loss falls fast to the frequent tokens' level, then toward the source's entropy rate only as
fast as the model learns the tables. FP8 against bf16 on it compares learning, not recall
(issue 45's 1% criterion).

The dataset is written with the tree's own ``IndexedDatasetBuilder``, so ``pretrain_gpt.py
--data-path PREFIX --tokenizer-type NullTokenizer --vocab-size V`` reads it as it reads
``preprocess_data.py``'s output. Token ids stay below ``V - 2``: NullTokenizer's EOD is ``V`` up to
core 0.19 and ``V - 1`` after. Prints one JSON line: tokens, documents and the empirical entropy
rate (mean negative log-probability of the sampled tokens, nats), the loss a perfect model reaches.

Usage: python3 -m scripts.training.markov_corpus TREE PREFIX [--tokens N] [--vocab V] [--seed S]
Exit 0 when written, 2 on bad input (one line on stderr).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class MarkovSource:
    """Token ``t`` is followed by one of ``candidates[t]`` with ``probabilities[t]``."""

    candidates: np.ndarray  # [vocab, k] token ids
    probabilities: np.ndarray  # [vocab, k], rows sum to 1
    vocab: int  # ids are in [0, vocab)


def zipf(vocab: int, exponent: float, rng: np.random.Generator) -> np.ndarray:
    """Probabilities of a Zipf law over a random ranking of the vocabulary."""
    weights = 1.0 / np.arange(1, vocab + 1) ** exponent
    out = np.empty(vocab)
    out[rng.permutation(vocab)] = weights / weights.sum()
    return out


def make_source(
    vocab: int, *, k: int = 16, alpha: float = 0.5, exponent: float = 1.1, seed: int = 1234
) -> MarkovSource:
    """A random source: each token's ``k`` successors drawn from a Zipf law (``exponent``) over
    the vocabulary, their probabilities Dirichlet(``alpha``): a few likely successors each."""
    rng = np.random.default_rng(seed)
    candidates = rng.choice(vocab, size=(vocab, k), p=zipf(vocab, exponent, rng))
    probabilities = rng.dirichlet(np.full(k, alpha), size=vocab)
    return MarkovSource(candidates.astype(np.int64), probabilities, vocab)


def sample(
    source: MarkovSource, documents: int, length: int, seed: int
) -> tuple[np.ndarray, float]:
    """``documents`` sequences of ``length`` tokens (all documents step together, so the cost
    is ``length`` vectorised steps) and the summed negative log-probability of the sampled
    tokens after the first of each document (which is uniform)."""
    if length < 2:
        raise ValueError(f"length must be at least 2, not {length}")
    rng = np.random.default_rng(seed)
    tokens = np.empty((documents, length), dtype=np.int64)
    tokens[:, 0] = rng.integers(0, source.vocab, size=documents)
    cumulative = np.cumsum(source.probabilities, axis=1)
    cumulative[:, -1] = 1.0  # rounding: a draw of u < 1 always lands in a column
    nll = 0.0
    for t in range(1, length):
        ctx = tokens[:, t - 1]
        u = rng.random(documents)
        column = (u[:, None] >= cumulative[ctx]).sum(axis=1)
        tokens[:, t] = source.candidates[ctx, column]
        nll -= float(np.log(source.probabilities[ctx, column]).sum())
    return tokens, nll


def entropy_rate(nll: float, documents: int, length: int) -> float:
    """Nats per token of the Markov steps (the first token of a document excluded)."""
    return nll / (documents * (length - 1))


def write_indexed_dataset(tree: Path, prefix: Path, tokens: np.ndarray, vocab: int) -> None:
    """One document per row, through the tree's ``IndexedDatasetBuilder`` (the format
    ``pretrain_gpt.py`` reads is the tree's to define)."""
    sys.path.insert(0, str(tree))
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    dtype = np.uint16 if vocab < 65500 else np.int32
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for row in tokens:
        builder.add_item(torch.from_numpy(row))  # int64 rows: the builder casts to dtype
        builder.end_document()
    builder.finalize(f"{prefix}.idx")


def _positive(text: str) -> int:
    try:
        value = int(float(text))
    except (ValueError, OverflowError):
        raise argparse.ArgumentTypeError(f"not a count: {text[:40]}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, not {text[:40]}")
    return value


def _seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text[:40]}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {value}")
    return value


def parse_cli(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python3 -m scripts.training.markov_corpus",
        description=(__doc__ or "").split("\n\n")[0],
    )
    p.add_argument("tree", type=Path, help="Megatron-LM checkout (its indexed-dataset writer)")
    p.add_argument("prefix", type=Path, help="output prefix: PREFIX.bin and PREFIX.idx")
    p.add_argument("--tokens", type=_positive, default=12_000_000, help="about this many tokens")
    p.add_argument("--vocab", type=_positive, default=31999, help="--vocab-size of the run")
    p.add_argument("--length", type=_positive, default=4096, help="tokens per document")
    p.add_argument("--seed", type=_seed, default=1234)
    opts = p.parse_args(argv)
    if opts.vocab < 3 or opts.length < 2:
        p.error("--vocab must be at least 3, --length at least 2")
    if not (opts.tree / "megatron" / "core" / "datasets" / "indexed_dataset.py").is_file():
        p.error(f"{opts.tree} is not a Megatron-LM checkout (no megatron/core/datasets)")
    return opts


def main(argv: list[str] | None = None) -> int:
    opts = parse_cli(argv)
    source_vocab = opts.vocab - 2  # below NullTokenizer's EOD in every era
    source = make_source(source_vocab, seed=opts.seed)
    documents = max(1, math.ceil(opts.tokens / opts.length))
    tokens, nll = sample(source, documents, opts.length, seed=opts.seed + 1)
    try:
        opts.prefix.parent.mkdir(parents=True, exist_ok=True)
        write_indexed_dataset(opts.tree, opts.prefix, tokens, opts.vocab)
    except OSError as exc:
        print(f"markov_corpus: cannot write {opts.prefix}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    summary = {
        "prefix": str(opts.prefix),
        "tokens": int(tokens.size),
        "documents": documents,
        "entropy_rate_nats": round(entropy_rate(nll, documents, opts.length), 4),
        "uniform_nats": round(math.log(source_vocab), 4),
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
