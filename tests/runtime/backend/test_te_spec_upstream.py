"""Upstream's TE spec on the native backend, on real megatron-core sdists with TE absent (CPU).

For each supported release line, the series (with ``te-spec-backend``) is applied to the PyPI
sdist, then ``te_spec_probe.py`` builds a GPT, a Llama-style model (RMSNorm, SwiGLU, RoPE, GQA)
and a Llama-style MoE through ``get_gpt_layer_with_transformer_engine_spec()`` *and* through the
local spec from one seed, and runs forward + backward. The native TE modules are the local
classes underneath, so the two models must agree exactly: same weights, logits and gradients
(fp32 and bf16), and the same checkpoint layout once the local norms take their TE names.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cache_paths import DOWNLOAD_CACHE

from megatron_rocm.main import main

pytestmark = [pytest.mark.upstream, pytest.mark.torch, pytest.mark.slow, pytest.mark.full]
pytest.importorskip("torch")

# One release per variant of the te-spec-backend patch (and the newest of each line).
RELEASES = ["0.12.3", "0.13.1", "0.14.0", "0.15.3", "0.16.1", "0.17.1", "0.18.2", "0.19.2"]
CASES = ["gpt:float32", "llama:float32", "moe:float32", "llama:bfloat16"]
MLA = "mla:float32"  # DeepSeek-style latent attention: TE-only upstream (see the probe)
PROBE = Path(__file__).with_name("te_spec_probe.py")
REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def probe_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """release -> case -> probe result, one apply and one probe process per release."""
    results: dict[str, dict] = {}
    root = tmp_path_factory.mktemp("te-spec")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("MEGATRON_ROCM_CACHE", str(DOWNLOAD_CACHE))
        for release in RELEASES:
            dest = root / release
            code = main(["apply", "--source", "pypi", "--ref", release, "--dest", str(dest)])
            if code != 0:
                results[release] = {"apply": f"exit {code}"}
                continue
            proc = subprocess.run(
                [sys.executable, str(PROBE), *CASES, MLA, "modules", "grouped"],
                cwd=dest,
                env={**os.environ, "PYTHONPATH": os.pathsep.join([str(dest), str(REPO)])},
                capture_output=True,
                text=True,
                timeout=600,
            )
            lines = proc.stdout.strip().splitlines()
            results[release] = (
                json.loads(lines[-1])
                if proc.returncode == 0 and lines
                else {"probe": f"exit {proc.returncode}: {proc.stderr.strip().splitlines()[-3:]}"}
            )
    return results


@pytest.mark.parametrize("release", RELEASES)
@pytest.mark.parametrize("case", CASES)
def test_te_spec_matches_local_spec(probe_results: dict, release: str, case: str) -> None:
    per_release = probe_results[release]
    assert "apply" not in per_release and "probe" not in per_release, per_release
    result = per_release[case]
    assert "error" not in result, result.get("error")
    classes = result["classes"]
    assert classes["linear_qkv"] == "megatron_rocm.runtime.backend.layernorm_linear"
    assert classes["core_attention"] == "megatron_rocm.runtime.backend.dot_product_attention"
    assert classes["linear_proj"] == "megatron_rocm.runtime.backend.linear"
    assert classes["mlp"] == ("MoELayer" if case.startswith("moe") else "MLP")
    assert result["grads_finite"] and result["grad_scale"] > 0
    assert result["unmatched_local_params"] == []
    assert result["te_param_count"] == result["local_param_count"]
    # Same weights from the same seed; same math: exact agreement, not a tolerance.
    assert result["weight_max_diff"] == 0.0
    assert result["logits_max_diff"] == 0.0
    assert result["grad_max_diff"] == 0.0
    assert result["te_loss"] == result["local_loss"]


@pytest.mark.parametrize("release", RELEASES)
def test_mla_on_the_te_spec_matches_its_local_twin(probe_results: dict, release: str) -> None:
    """``--multi-latent-attention`` through the TE spec: every projection is a native module
    (0.17+ refused them, ``Unsupported linear_q_down_proj``, until the patch bound the names),
    and the model equals its twin of local linears and norms exactly, checkpoint layout too."""
    result = probe_results[release][MLA]
    assert "error" not in result, result.get("error")
    classes = result["classes"]
    for name in ("linear_q_down_proj", "linear_kv_down_proj", "linear_proj"):
        assert classes[name] == "megatron_rocm.runtime.backend.linear", name
    for name in ("linear_q_up_proj", "linear_kv_up_proj"):  # the q/kv norms folded in
        assert classes[name] == "megatron_rocm.runtime.backend.layernorm_linear", name
    assert result["grads_finite"] and result["grad_scale"] > 0
    assert result["unmatched_local_params"] == []
    assert result["te_param_count"] == result["local_param_count"]
    assert result["logits_max_diff"] == 0.0 and result["grad_max_diff"] == 0.0
    assert result["te_loss"] == result["local_loss"]
    assert result["te_layout"] == result["local_layout_as_te"]
    # the latent cache's split of the norm-fused up-projection (MLA imports it from 0.16.1):
    # the native helper, norm then linear equal to the fused module
    if release >= "0.17" or result["split_is_ours"] is not None:
        assert result["split_is_ours"], result
        assert result["split_max_diff"] == 0.0


@pytest.mark.parametrize("release", RELEASES)
def test_checkpoint_layout_is_the_te_layout(probe_results: dict, release: str) -> None:
    """The TE spec's sharded state dict (what a TE checkpoint holds) has the local spec's keys
    and shapes once the local norms take their TE names: checkpoints move between backends."""
    result = probe_results[release]["llama:float32"]
    assert "error" not in result, result.get("error")
    assert result["te_layout"] == result["local_layout_as_te"]
    assert any(k.endswith("linear_qkv.layer_norm_weight") for k in result["te_layout"])


@pytest.mark.parametrize("release", RELEASES)
def test_native_modules_in_the_tree(probe_results: dict, release: str) -> None:
    """TE's refusals and contracts, fused wgrad into main_grad, honoured block-causal masks."""
    result = probe_results[release]["modules"]
    assert "error" not in result, result.get("error")
    assert result["gather_output_refused"] and result["unknown_value_refused"]
    assert result["telinear_forward_diff"] == 0.0 and result["telinear_bias_returned"]
    assert result["telinear_main_grad_diff"] < 1e-5 and result["telinear_flagged"]
    # the a2a handoff: only an offered input runs on LinearFunction, whose backward starts the
    # exchange before the weight gradient and posts it after, with upstream's numbers (bias
    # added or returned); a frozen weight or a layer that is more than a GEMM keeps upstream's
    ours = ["ours", "begin", "wgrad", "post"]
    assert result["row_handoff_events"] == [
        "none/plain", "none/plain", *ours, "added/plain", "added/plain", *ours,
        "skipped/plain", "skipped/plain", *ours,
        "none/frozen", "none/sequence_parallel", "skipped/explicit_expert_comm",
        # an early output: the GEMM over its columns in place, then it lands, then the rest
        "none/plain", "none/plain/early", "ours", "landed", "begin", "wgrad", "post",
        "added/plain", "added/plain/early", "ours", "landed", "begin", "wgrad", "post",
        "none/sequence_parallel", "none/sequence_parallel/early", "landed",
    ]  # fmt: skip
    assert result["row_handoff_diff"] == 0.0
    assert result["row_early_diff"] < 1e-5  # NaN (read before landing) fails it too
    assert result["telinear_extra_state"] == ["torch.uint8", 0]  # TE's value without FP8
    assert result["zero_centered_init"] and result["zero_centered_diff"] < 1e-5
    assert result["ln_param_order"] == ["layer_norm_weight", "weight"]  # TE's order
    assert result["attention_causal_diff"] < 1e-5
    assert result["attention_block_causal_diff"] < 1e-5
    assert result["attention_block_causal_differs"] > 1e-2  # the mask really changed things
    assert result.get("sinks_refused", True)
    # config fields only TE's modules honour: every native module refuses them
    refused = result["te_only_config_refused"]
    assert all(all(flags) for flags in refused.values()), refused
    if tuple(map(int, release.split("."))) >= (0, 19):  # all three exist from 0.19
        assert set(refused) == {"quant_recipe", "use_te_activation_func", "batch_invariant_mode"}
        assert [len(flags) for flags in refused.values()] == [4, 4, 1]
    # the cross-entropy patch: upstream's two loss functions, wrapped, same numbers
    assert result["ce_files"] == ["cross_entropy.py"]  # the wrapper's code, not upstream's
    assert result["ce_wrapper_is_ours"]
    assert result["ce_wraps"] == [
        "megatron.core.tensor_parallel.cross_entropy",
        "megatron.core.fusions.fused_cross_entropy",
    ]
    assert result["ce_diff"] == 0.0 and result["ce_fused_diff"] < 1e-5
    # the swiglu patch: upstream's entry point wrapped where the MLP imports it, same numbers
    assert result["swiglu_wrapper_is_ours"] and result["swiglu_mlp_uses_it"]
    assert result["swiglu_diff"] == 0.0 and result["swiglu_bias_diff"] == 0.0
    # experimental attention variants (0.16+) build on the native provider, not a NameError
    provider = result["experimental_spec_provider"]
    assert provider is None if release < "0.16" else provider.startswith("megatron_rocm."), provider
    # recompute-without-te: upstream sets fp8=True even for fp8=False and then calls TE
    assert result["checkpoint_without_output_fp8"] is (None if release < "0.13" else False)
    # TE initialises without Megatron's tracker until it is seeded; the native classes too
    assert "is not added" in result["unseeded_upstream_init"]
    assert result["unseeded_te_init_is_default_generator"] and result["unseeded_fork_restored"]
    assert "is not added" in result["unseeded_build_local"]  # the local class forks and raises
    assert [result[f"unseeded_build_{n}"] for n in ("column", "row", "ln_column")] == ["", "", ""]


@pytest.mark.parametrize("release", RELEASES)
def test_moe_grouped_gemm_really_groups(probe_results: dict, release: str) -> None:
    """--moe-grouped-gemm on the TE spec builds TEGroupedMLP on the native grouped linears."""
    result = probe_results[release]["grouped"]
    assert "error" not in result, result.get("error")
    assert result["experts"] == "TEGroupedMLP"
    assert result["fc1"] == "megatron_rocm.runtime.backend.grouped_linear"
    assert result["grads_finite"] and result["grouped_impl"] is not None
