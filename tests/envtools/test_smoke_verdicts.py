"""The loss-curve rules of the training, resume and parallel checks (no torch, no GPU)."""

from __future__ import annotations

import math

import pytest

from megatron_rocm.envtools.smoke import verdicts
from megatron_rocm.envtools.smoke.verdicts import Verdict

CURVE = [6.97, 6.98, 6.31, 6.35, 5.77, 5.71, 5.19, 5.13]


def test_learns_reports_the_drop() -> None:
    assert verdicts.learns(CURVE) == "loss 6.975 -> 5.160 in 8 steps"


@pytest.mark.parametrize(
    ("losses", "message"),
    [
        ([7.0, 7.0, 6.9, 6.9], "loss did not decrease: 7.0000 -> 6.9000"),  # only 1.4% down
        ([7.0, math.nan, 5.0, 4.0], "non-finite loss"),
        ([7.0, math.inf, 5.0, 4.0], "non-finite loss"),
        ([7.0, 6.0, 5.0], "only 3 losses"),
    ],
)
def test_learns_rejects(losses, message) -> None:
    with pytest.raises(Verdict, match=message):
        verdicts.learns(losses)


def test_learns_threshold_is_five_percent() -> None:
    verdicts.learns([10.0, 10.0, 9.0, 9.0, 9.49, 9.49])  # 5.1% down
    with pytest.raises(Verdict):
        verdicts.learns([10.0, 10.0, 9.0, 9.0, 9.5, 9.5])  # exactly 5%: not below


def test_matches_reference_exact_and_close() -> None:
    assert "(bit-exact)" in verdicts.matches_reference(CURVE, CURVE)
    drift = [x * (1 + 1e-3 * (i + 1)) for i, x in enumerate(CURVE)]  # 0.1% .. 0.5% by step 5
    text = verdicts.matches_reference(drift, CURVE)
    assert "bit-exact" not in text and "steps 1-5 within rel 5.0e-03" in text


def test_matches_reference_first_step_tolerance() -> None:
    ok = [CURVE[0] * (1 + 1.9e-3), *CURVE[1:]]  # the curve allowance is wider, 2e-2
    verdicts.matches_reference(ok, CURVE)
    bad = [CURVE[0] * (1 + 2.1e-3), *CURVE[1:]]
    with pytest.raises(Verdict, match=r"first-step loss 6\.98\d+ differs from the 1-GPU"):
        verdicts.matches_reference(bad, CURVE)


def test_matches_reference_curve_tolerance_names_the_step() -> None:
    bad = list(CURVE)
    bad[2] = CURVE[2] * 1.03  # a wrong gradient shows after the first update
    with pytest.raises(
        Verdict, match=r"loss at step 3 is .* \(rel 3\.0e-02 > 2e-02\); first step matched"
    ):
        verdicts.matches_reference(bad, CURVE)
    late = list(CURVE)
    late[6] = CURVE[6] * 1.5  # beyond CURVE_STEPS: bf16 drift is not judged that far
    verdicts.matches_reference(late, CURVE)


def test_matches_reference_needs_a_reference() -> None:
    with pytest.raises(Verdict, match="no 1-GPU reference"):
        verdicts.matches_reference(CURVE, [])


def test_resume_bit_exact() -> None:
    text = verdicts.resumes(CURVE, CURVE[:4], CURVE[4:])
    assert text == "steps 5-8 after the restart are bit-exact"


def test_resume_within_tolerance_is_not_called_bit_exact() -> None:
    resumed = [x * (1 + 5e-5) for x in CURVE[4:]]
    text = verdicts.resumes(CURVE, CURVE[:4], resumed)
    assert text.startswith("not bit-exact but within rel 1e-04 (worst 5.0e-05 at step")


def test_resume_divergence_is_caught() -> None:
    resumed = [CURVE[4], CURVE[5] * 1.003, CURVE[6], CURVE[7]]  # lost Adam state: step 6 moves
    with pytest.raises(Verdict, match=r"diverges at step 6: .* \(rel 3\.0e-03 > 1e-04\)"):
        verdicts.resumes(CURVE, CURVE[:4], resumed)


def test_resume_needs_reproducible_training() -> None:
    first_half = [CURVE[0], CURVE[1] * 1.01, CURVE[2], CURVE[3]]
    with pytest.raises(Verdict, match="differ before any restart .* not reproducible"):
        verdicts.resumes(CURVE, first_half, CURVE[4:])
    noisy = [CURVE[0], CURVE[1] * (1 + 2e-5), CURVE[2], CURVE[3]]  # nondeterministic but close
    assert "two uninterrupted runs differ by up to 2.0e-05" in verdicts.resumes(
        CURVE, noisy, CURVE[4:]
    )


def test_resume_step_counts_must_add_up() -> None:
    with pytest.raises(Verdict, match="steps do not add up"):
        verdicts.resumes(CURVE, CURVE[:4], CURVE[5:])
