#!/usr/bin/env python3
"""How far apart two training runs' losses are, iteration by iteration (same seed, same data).

Usage: python3 -m scripts.training.compare_losses REFERENCE.log OTHER.log [--first 10] [--last 10]

Reads the ``lm loss`` of every logged iteration from two ``pretrain_gpt.py`` logs (the format
``train_small.py`` parses) and reports, over the iterations both logged, the largest relative
difference in the first ``--first`` iterations and over all of them. Parallel layouts of one
model (CP=1 against TP2 x CP2, say) start from the same weights and see the same batches, so
their first iterations agree to bf16 rounding; later ones drift as rounding differences grow,
which is why the two spans are reported apart; a non-finite loss counts as an infinite
difference. Where a run ends is compared on the mean of the last ``--last`` shared iterations
(one iteration's loss moves with its batch): ``rel_diff_last_mean``, what "within 1% of bf16
after 300 iterations" reads. Prints one JSON object. Exit 0 when both logs hold the same iterations, 1 when
one logged iterations the other did not (a run that stopped early: the JSON says which), 2
when a log is missing or the two share no iteration with a loss.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from scripts.training.train_small import parse_log


def losses(path: Path) -> dict[int, float]:
    records, _ = parse_log(path.read_text(errors="replace").splitlines())
    return {r.iteration: r.loss for r in records if r.loss is not None}


def _json_number(x: float) -> float | str:
    """A finite value rounded, a non-finite one as text: the output stays strict JSON."""
    return round(x, 6) if math.isfinite(x) else str(x)


def _relative(reference: float, other: float) -> float:
    if not (math.isfinite(reference) and math.isfinite(other)):
        return math.inf
    return abs(other - reference) / abs(reference) if reference else abs(other)


def compare(
    reference: dict[int, float], other: dict[int, float], first: int, last: int = 10
) -> dict:
    common = sorted(set(reference) & set(other))
    rel = {i: _relative(reference[i], other[i]) for i in common}
    head = [rel[i] for i in common[:first]]
    tail = common[-last:]
    reference_tail = sum(reference[i] for i in tail) / len(tail)
    other_tail = sum(other[i] for i in tail) / len(tail)
    return {
        "iterations": len(common),
        "only_in_reference": sorted(set(reference) - set(other)),
        "only_in_other": sorted(set(other) - set(reference)),
        "first": len(head),
        "max_rel_diff_first": _json_number(max(head)),
        "max_rel_diff_all": _json_number(max(rel.values())),
        "last": len(tail),
        "last_iterations": [tail[0], tail[-1]],
        "reference_last_mean": _json_number(reference_tail),
        "other_last_mean": _json_number(other_tail),
        "rel_diff_last_mean": _json_number(_relative(reference_tail, other_tail)),
        "reference_losses": [_json_number(reference[i]) for i in common[:first]],
        "other_losses": [_json_number(other[i]) for i in common[:first]],
    }


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reference", type=Path)
    parser.add_argument("other", type=Path)
    parser.add_argument("--first", type=_positive, default=10, help="the early span (default 10)")
    parser.add_argument(
        "--last", type=_positive, default=10, help="the final span, compared on means (default 10)"
    )
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
    result = compare(a, b, args.first, args.last)
    print(json.dumps(result, allow_nan=False))
    return 1 if result["only_in_reference"] or result["only_in_other"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
