"""Judging loss curves: does a run learn, does it match the 1-GPU run, does a resume continue
exactly. Pure Python (no torch), so every rule is unit-tested on any machine.

Tolerances (relative to the reference loss, which is ~7 at the start and falls from there):

* ``FIRST_STEP_RTOL`` 2e-3: the first step's loss is a forward pass at identical weights on
  the identical global batch; TP/PP/CP/EP/FSDP only change reduction orders in bf16 GEMMs,
  all-reduces and the averaging over micro-batches. A wrong shard, a missing reduction or a
  wrong loss scaling moves it by whole percents.
* ``CURVE_RTOL`` 2e-2 over the first ``CURVE_STEPS`` steps: after each update bf16 rounding
  differences compound; a wrong gradient (scaling by the DP/CP size, a lost expert or
  pipeline-stage gradient) changes the second step already by far more.
* ``RESUME_RTOL`` 1e-4: a resume with upstream's determinism settings is expected to be
  bit-exact; when it is not (a kernel without a deterministic algorithm), the difference
  must stay below what one lost Adam step count or moment causes (several percent).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

FIRST_STEP_RTOL = 2e-3
CURVE_RTOL = 2e-2
CURVE_STEPS = 5
RESUME_RTOL = 1e-4
DECREASE = 0.95  # the mean of the last two losses must be below 95% of the first two


class Verdict(AssertionError):
    """The run's losses say it is wrong; the message says how."""


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def learns(losses: Sequence[float]) -> str:
    """Finite and falling: the mean of the last two below DECREASE x the first two."""
    if len(losses) < 4:
        raise Verdict(f"only {len(losses)} losses; need at least 4 steps")
    if not all(math.isfinite(x) for x in losses):
        raise Verdict(f"non-finite loss: {[round(x, 4) for x in losses]}")
    first, last = sum(losses[:2]) / 2, sum(losses[-2:]) / 2
    if not last < DECREASE * first:
        raise Verdict(f"loss did not decrease: {first:.4f} -> {last:.4f} in {len(losses)} steps")
    return f"loss {first:.3f} -> {last:.3f} in {len(losses)} steps"


def matches_reference(losses: Sequence[float], reference: Sequence[float]) -> str:
    """The same run on one GPU: equal first step, close curve (see the module docstring)."""
    if not reference:
        raise Verdict("no 1-GPU reference losses to compare with")
    first = rel(losses[0], reference[0])
    if first > FIRST_STEP_RTOL:
        raise Verdict(
            f"first-step loss {losses[0]:.6f} differs from the 1-GPU run's {reference[0]:.6f} "
            f"(rel {first:.1e} > {FIRST_STEP_RTOL:.0e}): same weights, same batch"
        )
    n = min(CURVE_STEPS, len(losses), len(reference))
    worst, at = max((rel(losses[i], reference[i]), i) for i in range(n))
    if worst > CURVE_RTOL:
        raise Verdict(
            f"loss at step {at + 1} is {losses[at]:.5f}, the 1-GPU run's {reference[at]:.5f} "
            f"(rel {worst:.1e} > {CURVE_RTOL:.0e}); first step matched (rel {first:.1e})"
        )
    exact = " (bit-exact)" if first == 0.0 else ""
    return (
        f"first step {losses[0]:.5f} = 1-GPU {reference[0]:.5f}{exact} (rel {first:.1e}); "
        f"steps 1-{n} within rel {worst:.1e}"
    )


def resumes(
    straight: Sequence[float], first_half: Sequence[float], resumed: Sequence[float]
) -> str:
    """``straight``: N steps without a stop; ``first_half``: the run that saved after N/2;
    ``resumed``: the fresh process that loaded it and ran the last N/2."""
    half = len(first_half)
    if half < 1 or len(resumed) != len(straight) - half:
        raise Verdict(f"steps do not add up: {len(straight)} = {half} + {len(resumed)}?")
    repro = max(rel(a, b) for a, b in zip(first_half, straight))
    if repro > RESUME_RTOL:
        raise Verdict(
            f"two runs from the same seed differ before any restart (max rel {repro:.1e}): "
            "training here is not reproducible, so a resume cannot be judged"
        )
    tail = list(straight[half:])
    if list(resumed) == tail and repro == 0.0:
        return f"steps {half + 1}-{len(straight)} after the restart are bit-exact"
    worst, at = max((rel(resumed[i], tail[i]), i) for i in range(len(tail)))
    where = f"step {half + at + 1}: {resumed[at]:.6f} vs {tail[at]:.6f} without the restart"
    if worst > RESUME_RTOL:
        raise Verdict(f"the resumed run diverges at {where} (rel {worst:.1e} > {RESUME_RTOL:.0e})")
    return (
        f"not bit-exact but within rel {RESUME_RTOL:.0e} (worst {worst:.1e} at {where}; "
        f"two uninterrupted runs differ by up to {repro:.1e})"
    )
