"""The real-data tier's corpus and GPT-2 BPE trainer (``envtools/smoke/realdata.py``): the
same files for the same seed, an encoding that decodes back to the text, and the entropy."""

from __future__ import annotations

import json
import math

import pytest

from megatron_rocm.envtools.smoke import realdata


def _decode(ids: list[int], vocab: dict[str, int]) -> str:
    inverse = {i: t for t, i in vocab.items()}
    byte_of = {c: b for b, c in realdata.bytes_to_unicode().items()}
    return bytes(byte_of[c] for i in ids for c in inverse[i]).decode("utf-8")


def test_corpus_and_tokenizer_are_deterministic(tmp_path) -> None:
    a, b = realdata.corpus(50), realdata.corpus(50)
    assert a == b and realdata.corpus(50, seed=1) != a
    for name in ("x", "y"):
        vocab, merges = realdata.train_bpe(a, 60)
        realdata.save_tokenizer(vocab, merges, tmp_path / name)
    for f in ("vocab.json", "merges.txt"):
        assert (tmp_path / "x" / f).read_bytes() == (tmp_path / "y" / f).read_bytes()
    lines = (tmp_path / "x" / "merges.txt").read_text().splitlines()
    assert lines[0].startswith("#version") and len(lines) == 61  # GPT-2's layout
    vocab = json.loads((tmp_path / "x" / "vocab.json").read_text())
    assert vocab[realdata.EOD] == len(vocab) - 1 and len(set(vocab.values())) == len(vocab)


def test_encoding_round_trips_and_merges_shorten_it() -> None:
    texts = realdata.corpus(30)
    vocab, merges = realdata.train_bpe(texts, 80)
    text = texts[0] + " Ünïcode, 12 tabs\tand 'quotes're fine."
    ids = realdata.encode(text, merges, vocab)
    assert _decode(ids, vocab) == text
    assert len(ids) < len(text.encode("utf-8")) * 0.6  # learned merges of the grammar's words


def test_unigram_entropy() -> None:
    assert realdata.unigram_entropy([1, 2, 3, 4]) == pytest.approx(math.log(4))
    assert realdata.unigram_entropy([7, 7, 7]) == 0
    with pytest.raises(ValueError):
        realdata.unigram_entropy([])


def test_saved_folder_is_a_hugging_face_tokenizer_with_the_same_encoding(
    tmp_path, monkeypatch
) -> None:
    """0.17+ trees read the folder through ``AutoTokenizer`` (``--tokenizer-type
    HuggingFaceTokenizer``): offline, the same ids as the BPE here, EOD the end of text."""
    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    texts = realdata.corpus(80)
    vocab, merges = realdata.train_bpe(texts, 80)
    folder = realdata.save_tokenizer(vocab, merges, tmp_path / "tok")
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    assert tok.eos_token == realdata.EOD and tok.eos_token_id == vocab[realdata.EOD]
    extra = " Ünïcode, 12 tabs\tand 'quotes're fine.  two  spaces\n\nnext"
    for text in [*texts, texts[0] + extra]:
        assert tok(text).input_ids == realdata.encode(text, merges, vocab)
