"""The ``modelopt-without-te`` patch on a real megatron-core sdist, on CPU.

The series is applied to the 0.16.1 and 0.19.2 sdists (the patch's two variants with the mask;
0.13.1 for the norm alone) and ``modelopt_probe.py`` builds upstream's ModelOpt
spec layer (the one ModelOpt's EAGLE draft is built from) and runs its self-attention as EAGLE's
training does: past the prompt of a ``StaticInferenceContext``, in training. Without TE,
upstream's ``Norm`` raised ImportError, and past the prompt the attention's mask was turned off
(only TE >= 2.2 keeps it): the draft then attended to keys its mask hides. With the patch the
norms are the native backend's, the arbitrary mask reaches the native attention with the cached
keys, what it computes equals masked attention recomputed here, and the backward runs through
every step (the next step's in-place cache write no longer changes what the first saved).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from probe_cli import applied_and_probed

pytestmark = [pytest.mark.upstream, pytest.mark.torch, pytest.mark.slow, pytest.mark.full]
torch = pytest.importorskip("torch")
PROBE = Path(__file__).with_name("modelopt_probe.py")
MASKED = ["0.16.1", "0.19.2"]  # v0.16.diff, v0.17.diff: the norm and the mask past the prompt
SEQ, STEPS = 6, 3  # modelopt_probe's


@pytest.fixture(scope="module")
def probed(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    """release -> the probe's findings on the patched sdist, each run once."""
    found: dict[str, dict] = {}

    def get(release: str) -> dict:
        if release not in found:
            dest = tmp_path_factory.mktemp("modelopt") / release
            found[release] = applied_and_probed(PROBE, release, dest)
        return found[release]

    return get


@pytest.fixture(params=MASKED)
def result(request: pytest.FixtureRequest, probed) -> dict:  # noqa: ANN001
    return probed(request.param)


@pytest.mark.parametrize("release", ["0.13.1", *MASKED])
def test_the_modelopt_norms_are_the_native_ones(release: str, probed) -> None:  # noqa: ANN001
    for kind, norm in probed(release)["norms"].items():
        assert norm["module"].startswith("megatron_rocm.runtime."), kind
        assert "_extra_state" not in norm["state"] and norm["finite"], kind


def test_the_mask_reaches_the_attention_past_the_prompt(result) -> None:  # noqa: ANN001
    got = [(c["mask_type"], len(c["q"]), len(c["k"])) for c in result["calls"]]
    assert got == [("arbitrary", SEQ, SEQ * (t + 1)) for t in range(STEPS)]


def masked_attention(call: dict) -> torch.Tensor:
    """Attention of [s, b, h, d] queries on [sk, b, g, d] keys and values, masked where the
    [b, 1, s, sk] mask is True (Megatron's GQA: query head i reads group i // (h / g))."""
    q, k, v = (torch.tensor(call[n], dtype=torch.float64) for n in ("q", "k", "v"))
    heads, groups = q.shape[2], k.shape[2]
    k, v = (t.repeat_interleave(heads // groups, dim=2) for t in (k, v))
    scores = torch.einsum("sbhd,kbhd->bhsk", q, k) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(torch.tensor(call["mask"]), float("-inf"))
    out = torch.einsum("bhsk,kbhd->sbhd", scores.softmax(-1), v)
    return out.reshape(out.shape[0], out.shape[1], -1)


def test_the_native_attention_computes_the_masked_attention(result) -> None:  # noqa: ANN001
    for step, call in enumerate(result["calls"]):
        got = torch.tensor(call["out"], dtype=torch.float64)
        torch.testing.assert_close(got, masked_attention(call), rtol=1e-4, atol=1e-5,
                                   msg=lambda m, step=step: f"step {step}: {m}")  # fmt: skip


def test_the_backward_runs_through_every_step(result) -> None:  # noqa: ANN001
    assert result["backward_error"] is None
    assert result["qkv_grad"] and result["qkv_grad"] > 0
