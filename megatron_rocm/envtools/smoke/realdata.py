"""The real-data path without downloads: a corpus, a GPT-2 style BPE tokenizer, its entropy.

``real-data`` checks (and the CPU tests) need text a model can learn and a tokenizer
upstream's ``tools/preprocess_data.py`` and ``pretrain_gpt.py`` read with
``--tokenizer-type GPT2BPETokenizer`` (``vocab.json`` + ``merges.txt``). Both are made here,
deterministically, from a small English-like grammar and a byte-level BPE trainer of our own:
no Hugging Face package, no file fetched at run time. Plain Python (``regex`` only), no torch.
"""

from __future__ import annotations

import collections
import json
import math
import random
from collections.abc import Iterable
from pathlib import Path

import regex

EOD = "<|endoftext|>"
# GPT-2's pre-tokenizer, the one Megatron's gpt2_tokenization.py splits words with
_WORDS = regex.compile(
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
)

_SUBJECTS = ["the miller", "a young fox", "the old sailor", "my sister", "the baker", "a farmer"]
_ADJECTIVES = ["quiet", "bright", "heavy", "small", "green", "ancient", "warm", "broken"]
_OBJECTS = ["lamp", "river", "garden", "letter", "boat", "bridge", "window", "orchard"]
_VERBS = ["carried", "painted", "watched", "repaired", "found", "followed", "crossed"]
_PLACES = ["near the mill", "before dawn", "in the village", "after the storm", "by the sea"]
_REASONS = ["because it was late", "while the bells rang", "as the rain stopped"]


def sentence(rng: random.Random) -> str:
    """One sentence of the grammar: a subject, a verb, an object, an adverbial, maybe a reason."""
    words = [
        rng.choice(_SUBJECTS),
        rng.choice(_VERBS),
        "the",
        rng.choice(_ADJECTIVES),
        rng.choice(_OBJECTS),
        rng.choice(_PLACES),
    ]
    if rng.random() < 0.4:
        words.append(rng.choice(_REASONS))
    text = " ".join(words)
    return text[0].upper() + text[1:] + "."


def corpus(documents: int, seed: int = 1234) -> list[str]:
    """``documents`` texts of 3-8 sentences each, the same for the same seed."""
    rng = random.Random(seed)
    return [" ".join(sentence(rng) for _ in range(rng.randint(3, 8))) for _ in range(documents)]


def write_jsonl(texts: Iterable[str], path: Path) -> Path:
    """One ``{"text": ...}`` object a line: what ``preprocess_data.py --json-keys text`` reads."""
    with open(path, "w", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")
    return path


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (the vocabulary's alphabet)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars = keep[:]
    n = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(keep, map(chr, chars), strict=True))


def _words(texts: Iterable[str]) -> collections.Counter[tuple[str, ...]]:
    """Pre-tokenized words as tuples of mapped byte characters, with their counts."""
    table = bytes_to_unicode()
    counts: collections.Counter[str] = collections.Counter()
    for t in texts:
        counts.update(_WORDS.findall(t))
    return collections.Counter(
        {tuple(table[b] for b in w.encode("utf-8")): c for w, c in counts.items()}
    )


def _merge(word: tuple[str, ...], pair: tuple[str, str]) -> tuple[str, ...]:
    out, i = [], 0
    while i < len(word):
        if i + 1 < len(word) and (word[i], word[i + 1]) == pair:
            out.append(word[i] + word[i + 1])
            i += 2
        else:
            out.append(word[i])
            i += 1
    return tuple(out)


def train_bpe(texts: Iterable[str], merges: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Byte-level BPE: up to ``merges`` most frequent pairs (ties broken by the pair itself, so
    the result is deterministic). Returns (vocab: token -> id, merges in rank order)."""
    words = _words(texts)
    vocab = {c: i for i, c in enumerate(bytes_to_unicode().values())}
    ranks: list[tuple[str, str]] = []
    for _ in range(merges):
        pairs: collections.Counter[tuple[str, str]] = collections.Counter()
        for w, c in words.items():
            for a, b in zip(w, w[1:], strict=False):
                pairs[(a, b)] += c
        if not pairs:
            break
        best = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))[0]
        ranks.append(best)
        vocab.setdefault(best[0] + best[1], len(vocab))
        words = collections.Counter({_merge(w, best): c for w, c in words.items()})
    vocab[EOD] = len(vocab)
    return vocab, ranks


def save_tokenizer(vocab: dict[str, int], ranks: list[tuple[str, str]], folder: Path) -> Path:
    """``vocab.json`` and ``merges.txt`` as GPT-2 ships them (merges after a version line),
    and a ``tokenizer_config.json`` naming the class, so that the folder is also a Hugging Face
    tokenizer that ``AutoTokenizer.from_pretrained(folder)`` loads offline (0.17+ trees)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    lines = ["#version: 0.2"] + [f"{a} {b}" for a, b in ranks]
    (folder / "merges.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    config = {
        "tokenizer_class": "GPT2Tokenizer",
        "bos_token": EOD,
        "eos_token": EOD,
        "unk_token": EOD,
        "add_prefix_space": False,
        "add_bos_token": False,
        "model_max_length": 1_000_000,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1), encoding="utf-8")
    return folder


def encode(text: str, ranks: list[tuple[str, str]], vocab: dict[str, int]) -> list[int]:
    """GPT-2 BPE encoding (lowest-rank pair first), for the entropy and the tests."""
    table = bytes_to_unicode()
    rank = {p: i for i, p in enumerate(ranks)}
    ids: list[int] = []
    for w in _WORDS.findall(text):
        word = tuple(table[b] for b in w.encode("utf-8"))
        while len(word) > 1:
            pair = min(zip(word, word[1:], strict=False), key=lambda p: rank.get(p, math.inf))
            if pair not in rank:
                break
            word = _merge(word, pair)
        ids += [vocab[t] for t in word]
    return ids


def unigram_entropy(token_ids: Iterable[int]) -> float:
    """Entropy of the token frequencies in nats: the loss of the best context-free model.
    A model whose loss falls well below it uses context, i.e. it learned the text."""
    counts = collections.Counter(token_ids)
    total = sum(counts.values())
    if total == 0:
        raise ValueError("no tokens")
    return -sum(c / total * math.log(c / total) for c in counts.values())
