"""FP8 MoE experts without TE, on real megatron-core sdists (CPU).

The series is applied to three sdists, one per ``fp8-without-te`` variant of upstream's
experts: 0.14.0 (its ``TEGroupedMLP`` asserts "FP8 requires TE."), 0.17.1 ("FP8 and FP4
requires TE.") and 0.19.2 (the same, its padding taking an ``align_size``); ``main``'s variant
runs in the GPU stage ``fp8moe``. ``fp8_moe_probe.py`` builds upstream's TE-spec block with
four experts (top-2) under ``--fp8-format hybrid --fp8-recipe tensorwise`` and in bf16, with
``--moe-grouped-gemm`` (``TEGroupedMLP`` on the native grouped linears) and without
(``SequentialMLP`` on the native column and row linears). The grouped experts hold the native
``Fp8Padding``, every expert GEMM runs in FP8 (the grouped experts in one FP8 function, each
expert's rows in buckets of 128; the sequential experts' padded to 16 by upstream), and the FP8 blocks stay within FP8's error of
the bf16 ones.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from probe_cli import applied_and_probed, relative_error

pytestmark = [pytest.mark.full, pytest.mark.upstream, pytest.mark.torch, pytest.mark.slow]
torch = pytest.importorskip("torch")
PROBE = Path(__file__).with_name("fp8_moe_probe.py")
LAYERS, EXPERTS, TOKENS, TOPK = 2, 4, 32, 2


@pytest.fixture(scope="module", params=["0.14.0", "0.17.1", "0.19.2"])
def probed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    dest = tmp_path_factory.mktemp("fp8-moe") / request.param
    return applied_and_probed(PROBE, request.param, dest)


def test_grouped_experts_pad_with_the_native_fp8_padding(probed) -> None:  # noqa: ANN001
    assert probed["grouped-fp8"]["experts"] == "TEGroupedMLP"
    assert probed["grouped-fp8"]["padding"] == "megatron_rocm.runtime.backend.fp8_padding"
    assert probed["sequential-fp8"]["experts"] == "SequentialMLP"


@pytest.mark.parametrize("experts", ["grouped", "sequential"])
def test_every_expert_gemm_runs_fp8_on_aligned_rows(probed, experts: str) -> None:  # noqa: ANN001
    rows = probed[f"{experts}-fp8"]["fp8_rows"]
    assert probed[f"{experts}-bf16"]["fp8_rows"] == []
    # per layer: QKV and the output projection over every token, then fc1 and fc2 per expert
    assert len(rows) == LAYERS * (2 + 2 * EXPERTS)
    expert_rows = [r for i, r in enumerate(rows) if i % (2 + 2 * EXPERTS) >= 2]
    routed = LAYERS * 2 * TOKENS * TOPK  # fc1 and fc2 see every routed token
    if experts == "grouped":  # each expert's rows in buckets of 128 (fp8_experts)
        assert all(r % 128 == 0 for r in expert_rows)
        assert routed <= sum(expert_rows) < routed + LAYERS * 2 * EXPERTS * 128
    else:  # upstream's SequentialMLP pads each expert's rows to the FP8 GEMMs' 16
        assert all(r % 16 == 0 for r in expert_rows)
        assert routed <= sum(expert_rows) < routed + LAYERS * 2 * EXPERTS * 16


@pytest.mark.parametrize("experts", ["grouped", "sequential"])
@pytest.mark.parametrize(("what", "bound"), [("out", 0.02), ("dx", 0.02), ("fc1_grad", 0.15)])
def test_fp8_experts_stay_within_fp8_error_of_bf16(probed, experts, what, bound) -> None:  # noqa: ANN001
    rel = relative_error(probed[f"{experts}-fp8"][what], probed[f"{experts}-bf16"][what])
    assert 1e-4 < rel < bound, rel  # quantized (not bf16's result), within FP8's error
