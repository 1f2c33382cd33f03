#!/usr/bin/env python3
"""How far apart two training runs' losses are, iteration by iteration (same seed, same data).

Usage: python3 scripts/compare_losses.py REFERENCE.log OTHER.log [--first 10] [--json]

Reads the ``lm loss`` of every logged iteration from two ``pretrain_gpt.py`` logs (the format
``train_small.py`` parses) and reports, over the iterations both logged, the largest relative
difference in the first ``--first`` iterations and over all of them. Parallel layouts of one
model (CP=1 against TP2 x CP2, say) start from the same weights and see the same batches, so
their first iterations agree to bf16 rounding; later ones drift as rounding differences grow,
which is why the two spans are reported apart. Exit 2 when a log has no losses.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_small import parse_log  # noqa: E402


def losses(path: Path) -> dict[int, float]:
    records, _ = parse_log(path.read_text(errors="replace").splitlines())
    return {r.iteration: r.loss for r in records if r.loss is not None}


def compare(reference: dict[int, float], other: dict[int, float], first: int) -> dict:
    common = sorted(set(reference) & set(other))
    rel = {i: abs(other[i] - reference[i]) / abs(reference[i]) for i in common}
    head = [rel[i] for i in common[:first]]
    return {
        "iterations": len(common),
        "first": len(head),
        "max_rel_diff_first": round(max(head), 6),
        "max_rel_diff_all": round(max(rel.values()), 6),
        "reference_losses": [reference[i] for i in common[:first]],
        "other_losses": [other[i] for i in common[:first]],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reference", type=Path)
    parser.add_argument("other", type=Path)
    parser.add_argument("--first", type=int, default=10, help="the early span (default 10)")
    args = parser.parse_args()
    found = {}
    for path in (args.reference, args.other):
        if not path.is_file():
            print(f"compare_losses: {path}: no such file", file=sys.stderr)
            return 2
        found[path] = losses(path)
    a, b = found[args.reference], found[args.other]
    if not set(a) & set(b):
        print("compare_losses: the two logs share no iteration with a loss", file=sys.stderr)
        return 2
    print(json.dumps(compare(a, b, args.first)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
