"""Run inside a patched megatron-core tree (on ``sys.path``) on CPU; print one JSON object.

    python te_spec_probe.py KIND:DTYPE [KIND:DTYPE ...]     e.g. gpt:float32 llama:bfloat16

KIND is gpt, llama (RMSNorm, SwiGLU, RoPE, GQA) or moe (llama with 4 experts); the case
``modules`` checks the native modules one by one (refusals, fused wgrad, masks).

Builds the model twice from the same seed, through upstream's TE spec (``get_gpt_layer_with_
transformer_engine_spec``: the native backend, since TE is absent) and through the local spec,
runs forward + backward on one batch and reports what the tests compare: module classes,
losses, logits and gradients side by side (parameters matched through the local spec's own
key map onto TE names), and the sharded-state-dict keys and shapes of both models.

A separate process per case: Megatron keeps global parallel state.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore")
# Megatron's rotary embedding allocates on torch.cuda.current_device(); on a CPU-only torch
# that raises. Point it at the CPU (this probe's only concession to running without a GPU).
if not torch.cuda.is_available():
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]

SEQ, BATCH, VOCAB = 16, 2, 96
# local spec name -> TE spec name (upstream's TransformerLayer maps these keys the same way)
LOCAL_TO_TE = {
    "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
    "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
    # MLA: the q/kv norms fold into the up-projections
    "self_attention.q_layernorm.": "self_attention.linear_q_up_proj.layer_norm_",
    "self_attention.kv_layernorm.": "self_attention.linear_kv_up_proj.layer_norm_",
}


def config(kind: str, dtype: torch.dtype):
    from megatron.core.transformer.transformer_config import (
        MLATransformerConfig,
        TransformerConfig,
    )

    kw = dict(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        use_cpu_initialization=True,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        gradient_accumulation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        apply_rope_fusion=False,
    )
    if kind in ("llama", "moe", "moeg", "mla"):
        kw.update(
            normalization="RMSNorm",
            gated_linear_unit=True,
            add_bias_linear=False,
            num_query_groups=2,
            activation_func=torch.nn.functional.silu,
            ffn_hidden_size=96,
        )
    if kind in ("moe", "moeg"):
        kw.update(moe_grouped_gemm=kind == "moeg")
        kw.update(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48)
    if kind == "mla":  # DeepSeek-style latent attention: low-rank q and kv, decoupled RoPE
        kw.update(num_query_groups=None, qk_layernorm=True, rope_type="rope")
        kw.update(q_lora_rank=32, kv_lora_rank=24, qk_head_dim=16, qk_pos_emb_head_dim=8)
        return MLATransformerConfig(**kw, v_head_dim=12)
    return TransformerConfig(**kw)


def build(kind: str, dtype: torch.dtype, spec_name: str):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt import gpt_layer_specs as specs

    moe = {"num_experts": 4} if kind in ("moe", "moeg") else {}
    if kind == "moeg":
        moe["moe_grouped_gemm"] = True
    if kind == "mla":
        moe.update(multi_latent_attention=True, qk_layernorm=True)
    if spec_name == "te":
        spec = specs.get_gpt_layer_with_transformer_engine_spec(**moe)
    else:
        spec = specs.get_gpt_layer_local_spec(**moe)
    if kind == "mla" and spec_name == "local":
        # Upstream's local DotProductAttention takes no k_channels/v_channels: MLA has never run
        # on the local spec. The twin keeps the local linears and norms around the native core
        # attention, so the comparison checks the TE linears and LN-linears inside MLA.
        from megatron_rocm.runtime.backend.dot_product_attention import TEDotProductAttention

        spec.submodules.self_attention.submodules.core_attention = TEDotProductAttention
    torch.manual_seed(1234)
    return GPTModel(
        config=config(kind, dtype),
        transformer_layer_spec=spec,
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        position_embedding_type="rope" if kind != "gpt" else "learned_absolute",
    )


def run(model, tokens):
    positions = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
    mask = torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool).triu(1)
    logits = model(tokens, positions, mask)
    loss = logits.float().logsumexp(-1).mean()
    loss.backward()
    return logits.detach().float(), loss.item()


def te_name(local_name: str, te_names: set[str]) -> str:
    """The TE spec's name for a local-spec parameter (norms folded into the next linear)."""
    for old, new in LOCAL_TO_TE.items():
        mapped = local_name.replace(old, new)
        if old in local_name and mapped in te_names:
            return mapped
    return local_name


def sharded_layout(model) -> dict[str, list[int] | None]:
    """Checkpoint keys -> global shapes (None for non-tensor entries such as _extra_state)."""
    return {
        key: (list(value.global_shape) if hasattr(value, "global_shape") else None)
        for key, value in model.sharded_state_dict().items()
    }


def case(kind: str, dtype: torch.dtype, tokens: torch.Tensor) -> dict:
    te_model, local_model = build(kind, dtype, "te"), build(kind, dtype, "local")
    te_logits, te_loss = run(te_model, tokens)
    local_logits, local_loss = run(local_model, tokens)
    te_params = dict(te_model.named_parameters())
    grad_diff, weight_diff, unmatched = {}, {}, []
    for name, param in local_model.named_parameters():
        twin = te_params.get(te_name(name, set(te_params)))
        if twin is None or twin.shape != param.shape:
            unmatched.append(name)
            continue
        weight_diff[name] = (twin.detach().float() - param.detach().float()).abs().max().item()
        grad_diff[name] = (twin.grad.float() - param.grad.float()).abs().max().item()
    te_layout, local_layout = sharded_layout(te_model), sharded_layout(local_model)
    layer = te_model.decoder.layers[0]
    attn = layer.self_attention
    return {
        "classes": {  # MLA has no linear_qkv: its down- and up-projections instead
            name: type(getattr(attn, name)).__module__
            for name in (
                "linear_qkv",
                "linear_q_down_proj",
                "linear_q_up_proj",
                "linear_kv_down_proj",
                "linear_kv_up_proj",
                "core_attention",
                "linear_proj",
            )
            if hasattr(attn, name)
        }
        | {"mlp": type(layer.mlp).__name__},
        "te_loss": te_loss,
        "local_loss": local_loss,
        "logits_max_diff": (te_logits - local_logits).abs().max().item(),
        "logits_scale": local_logits.abs().max().item(),
        "weight_max_diff": max(weight_diff.values()),
        "grad_max_diff": max(grad_diff.values()),
        "grad_scale": max(p.grad.float().abs().max().item() for p in te_params.values()),
        "grads_finite": all(torch.isfinite(p.grad).all().item() for p in te_params.values()),
        "unmatched_local_params": unmatched,
        "te_param_count": sum(p.numel() for p in te_params.values()),
        "local_param_count": sum(p.numel() for p in local_model.parameters()),
        "te_layout": te_layout,
        "local_layout_as_te": {te_name(k, set(te_layout)): v for k, v in local_layout.items()},
        **(split_case(attn) if kind == "mla" else {}),
    }


def split_case(attn) -> dict:  # noqa: ANN001
    """MLA's latent cache splits its norm-fused up-projection with the extension's
    ``split_te_layernorm_column_parallel_linear``: norm then linear must equal the fused one."""
    from megatron.core.transformer import multi_latent_attention as mla

    fused = attn.linear_kv_up_proj
    split = getattr(mla, "split_te_layernorm_column_parallel_linear", None)
    if split is None:  # before 0.17 MLA had no latent cache
        return {"split_is_ours": None}
    norm, linear = split(fused, attn.config, None, None)
    with torch.no_grad():
        x = torch.randn(5, 2, fused.input_size, generator=torch.Generator().manual_seed(8))
        whole, _ = fused(x.to(fused.weight.dtype))
        apart, _ = linear(norm(x.to(fused.weight.dtype)))
    return {
        "split_is_ours": "megatron_rocm" in Path(split.__code__.co_filename).parts,
        "split_classes": [type(norm).__module__, type(linear).__module__],
        "split_max_diff": (whole - apart).abs().max().item(),
    }


def grouped_case(tokens: torch.Tensor) -> dict:
    """MoE through the TE spec with --moe-grouped-gemm: the experts must really be grouped."""
    from megatron_rocm.runtime.kernels import grouped_gemm

    model = build("moeg", torch.float32, "te")
    _, loss = run(model, tokens)
    experts = model.decoder.layers[0].mlp.experts
    return {
        "experts": type(experts).__name__,
        "fc1": type(experts.linear_fc1).__module__,
        "loss": loss,
        "grads_finite": all(torch.isfinite(p.grad).all().item() for p in model.parameters()),
        "grouped_impl": getattr(grouped_gemm.last_run(), "implementation", None),
    }


def _raises(fn, text: str) -> bool:
    try:
        fn()
    except ValueError as exc:
        return text in str(exc)
    return False


def _te_only_config_refused(cfg, common: dict) -> dict:  # noqa: ANN001
    """Config fields of this tag that only TE's modules honour -> whether each native module
    refuses to build with it set (one flag per module, in the order built below)."""
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_rocm.runtime.backend.te_names import (
        TEColumnParallelLinear,
        TEDotProductAttention,
        TELayerNormColumnParallelLinear,
        TELinear,
        TERowParallelLinear,
    )

    linears = [
        lambda: TEColumnParallelLinear(8, 8, gather_output=False, **common),
        lambda: TERowParallelLinear(8, 8, input_is_parallel=True, **common),
        lambda: TELayerNormColumnParallelLinear(8, 8, gather_output=False, **common),
        lambda: TELinear(
            8, 8, parallel_mode="duplicated", skip_weight_param_allocation=False, **common
        ),
    ]
    cases = {
        "quant_recipe": ("precision recipe", linears),
        "use_te_activation_func": ("activation ops", linears),
        "batch_invariant_mode": (
            "batch_invariant_mode",
            [lambda: TEDotProductAttention(cfg, 1, AttnMaskType.causal, "self")],
        ),
    }
    refused = {}
    for field, (text, builds) in cases.items():
        if not hasattr(cfg, field):
            continue
        before = getattr(cfg, field)
        setattr(cfg, field, object() if field == "quant_recipe" else True)
        try:
            refused[field] = [_raises(build, text) for build in builds]
        finally:
            setattr(cfg, field, before)
    return refused


def _row_linear_handoff(cfg, common: dict) -> dict:  # noqa: ANN001
    """TERowParallelLinear at one TP rank: an input an a2a attention offered runs on
    ``LinearFunction``, whose backward starts the attention's exchange before the weight
    gradient and posts it after; the same numbers as upstream's forward, which any other input,
    a frozen weight or a layer that is more than a GEMM still takes. An early output (the
    peers' half of its columns landing later) is computed on while it lands: upstream's
    numbers but for the order of the sums (``row_early_diff``)."""
    from megatron_rocm.runtime.backend import _linear_function
    from megatron_rocm.runtime.backend.cp import early_output as _cp_early_output
    from megatron_rocm.runtime.backend.cp import handoff as _cp_handoff
    from megatron_rocm.runtime.backend.te_names import TERowParallelLinear

    events: list[str] = []

    class Exchange:  # no attention takes it here: each run forgets its own (``_open``)
        def post(self) -> None:
            events.append("post")

    apply, weight_gradient = (
        _linear_function.LinearFunction.apply,
        _linear_function._weight_gradient,
    )

    def spying_apply(*args):  # noqa: ANN002, ANN202
        events.append("ours")
        return apply(*args)

    def spying_weight_gradient(*args):  # noqa: ANN002, ANN202
        events.append("wgrad")
        return weight_gradient(*args)

    def run(
        offered: bool, bias: str = "none", change: str = "", early: bool = False
    ) -> list[torch.Tensor]:
        torch.manual_seed(5)
        kw = {**common, "bias": bias != "none", "skip_bias_add": bias == "skipped"}
        row = TERowParallelLinear(8, 6, input_is_parallel=True, **kw)
        if row.bias is not None:
            torch.nn.init.normal_(row.bias)
        row.weight.main_grad = torch.zeros(6, 8)
        row.weight.grad_added_to_main_grad = False
        if change == "frozen":
            row.weight.requires_grad_(False)
        elif change:  # a layer that is more than a GEMM here
            setattr(row, change, True)
        x = torch.randn(5, 2, 8, requires_grad=True)
        handoff = _cp_handoff.Handoff(lambda grad: events.append("begin") or Exchange(), "probe")
        if offered:
            _cp_handoff.offer(handoff, x)
        events.append(f"{bias}/{change or 'plain'}{'/early' if early else ''}")
        given = x
        if early:  # columns 4-7 land later: NaN until then, so a GEMM reading them early shows
            arriving = x.detach()[..., 4:].clone()
            _cp_early_output.untracked(x)[..., 4:] = float("nan")

            def land() -> None:
                events.append("landed")
                _cp_early_output.untracked(x)[..., 4:] = arriving

            given = _cp_early_output.hand_on_early(x, slice(0, 4), land, "probe")
        y, returned = row(given)
        _cp_handoff._offered = None
        if returned is not None:
            y = y + returned
        y.backward(torch.linspace(-1, 1, y.numel()).view_as(y))
        _cp_handoff._open.clear()
        _cp_early_output._landings.clear()
        return [
            y.detach(),
            x.grad,
            row.weight.main_grad,
            torch.tensor(row.weight.grad_added_to_main_grad),
        ]

    def gap(bias: str = "none", change: str = "", early: bool = False) -> list[float]:
        """Per result, how far ours is from upstream's run of the same layer."""
        upstream, ours = run(False, bias, change), run(True, bias, change, early)
        return [(a.float() - b.float()).abs().max().item() for a, b in zip(upstream, ours)]

    _linear_function.LinearFunction.apply = spying_apply
    _linear_function._weight_gradient = spying_weight_gradient
    try:
        diffs = [d for bias in ("none", "added", "skipped") for d in gap(bias)]
        run(True, change="frozen")
        run(True, change="sequence_parallel")
        run(True, "skipped", change="explicit_expert_comm")  # upstream asserts skip_bias_add
        early_diffs = [d for bias in ("none", "added") for d in gap(bias, early=True)]
        # upstream's path: it lands on upstream's first read of its input
        early_diffs += gap(change="sequence_parallel", early=True)
    finally:
        _linear_function.LinearFunction.apply = apply
        _linear_function._weight_gradient = weight_gradient
    return {
        "row_handoff_events": events,
        "row_handoff_diff": max(diffs),
        "row_early_diff": max(early_diffs),
    }


def modules_case() -> dict:
    """Module-level behaviour of the native TE classes inside a real Megatron tree."""
    from megatron.core.transformer.enums import AttnMaskType
    from te_attention_oracle import attention_reference_te  # beside this probe (sys.path[0])

    from megatron_rocm.runtime.backend.te_names import (  # the extension's names (0.13+)
        TEColumnParallelLinear,
        TEDotProductAttention,
        TELayerNormColumnParallelLinear,
        TELinear,
    )

    cfg = config("llama", torch.float32)
    init = torch.nn.init.normal_
    out: dict = {}
    common = dict(config=cfg, init_method=init, bias=False, skip_bias_add=False, is_expert=False)
    out["gather_output_refused"] = _raises(
        lambda: TEColumnParallelLinear(8, 8, gather_output=True, **common), "gather_output"
    )
    out["unknown_value_refused"] = _raises(
        lambda: TEColumnParallelLinear(
            8, 8, gather_output=False, symmetric_ar_type="two_shot", **common
        ),
        "symmetric_ar_type",
    )
    # duplicated TELinear: plain math, and wgrad straight into main_grad when fused
    cfg.gradient_accumulation_fusion = True
    lin = TELinear(
        8,
        6,
        parallel_mode="duplicated",
        config=cfg,
        init_method=init,
        bias=True,
        skip_bias_add=False,
        skip_weight_param_allocation=False,
    )
    lin.weight.main_grad = torch.zeros(6, 8)
    lin.weight.grad_added_to_main_grad = False
    x = torch.randn(5, 2, 8, requires_grad=True)
    y, bias = lin(x)
    want = torch.nn.functional.linear(x, lin.weight, lin.bias)
    y.sum().backward()
    expected_wgrad = torch.ones(10, 6).t() @ x.detach().reshape(10, 8)
    out["telinear_forward_diff"] = (y - want).abs().max().item()
    out["telinear_bias_returned"] = bias is None
    out["telinear_main_grad_diff"] = (lin.weight.main_grad - expected_wgrad).abs().max().item()
    # TE's no-FP8 extra state: an empty uint8 tensor (upstream's DSA test detaches every value)
    extra = lin.state_dict()["_extra_state"]
    out["telinear_extra_state"] = [str(extra.dtype), extra.numel()]
    lin.load_state_dict({**lin.state_dict(), "_extra_state": None})  # older checkpoints
    lin.load_state_dict(lin.state_dict())
    out["telinear_flagged"] = bool(lin.weight.grad_added_to_main_grad)
    out.update(_row_linear_handoff(cfg, common))
    cfg.gradient_accumulation_fusion = False
    # zero-centred gamma in the LN-linear: gamma is stored as w - 1
    cfg.layernorm_zero_centered_gamma = True
    lnl = TELayerNormColumnParallelLinear(8, 4, gather_output=False, **common)
    out["zero_centered_init"] = bool((lnl.layer_norm_weight == 0).all())
    xs = torch.randn(3, 2, 8)
    got, _ = lnl(xs)
    normed = torch.nn.functional.rms_norm(
        xs, (8,), lnl.layer_norm_weight + 1, cfg.layernorm_epsilon
    )
    out["zero_centered_diff"] = (got - normed @ lnl.weight.t()).abs().max().item()
    out["ln_param_order"] = [n for n, _ in lnl.named_parameters()]
    cfg.layernorm_zero_centered_gamma = False
    # core attention: causal ignores a plain mask, honours a block-causal (packed) one
    attn = TEDotProductAttention(cfg, 1, AttnMaskType.causal, "self")
    s = 12
    q, k, v = (torch.randn(s, 2, n, cfg.kv_channels) for n in (4, 2, 2))
    plain = torch.ones(1, 1, s, s, dtype=torch.bool).triu(1)
    base = attn(q, k, v, plain, AttnMaskType.causal)
    ref = attention_reference_te(q, k, v, mask_type="causal")
    out["attention_causal_diff"] = (base - ref).abs().max().item()
    block = plain.clone().repeat(2, 1, 1, 1)
    block[1, :, 5:, :5] = True  # sample 1: documents [0, 5) and [5, 12)
    packed = attn(q, k, v, block, AttnMaskType.causal)
    ref_block = attention_reference_te(q, k, v, mask_type="arbitrary", attention_mask=block)
    out["attention_block_causal_diff"] = (packed - ref_block).abs().max().item()
    out["attention_block_causal_differs"] = (packed - base).abs().max().item()
    cfg.softmax_type = "learnable" if hasattr(cfg, "softmax_type") else None
    if cfg.softmax_type:
        out["sinks_refused"] = _raises(
            lambda: TEDotProductAttention(cfg, 1, AttnMaskType.causal, "self"), "softmax_type"
        )
        cfg.softmax_type = "vanilla"
    out["te_only_config_refused"] = _te_only_config_refused(cfg, common)
    out.update(cross_entropy_wiring())
    out.update(swiglu_wiring())
    out["experimental_spec_provider"] = _experimental_attention_spec_provider(cfg)
    out["checkpoint_without_output_fp8"] = _checkpoint_without_output_fp8()
    out.update(unseeded_tracker_case())
    return out


def _error_message(fn) -> str:  # noqa: ANN001
    """What ``fn()`` raised ("" when it did not): the probe reports whatever upstream raises."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001
        return str(exc)
    return ""


def unseeded_tracker_case() -> dict:
    """Weights built before anyone seeds Megatron's CUDA RNG tracker: upstream's own GPU init
    (``_initialize_affine_weight_gpu``, run here on a CPU tensor) raises, as it does for the
    local linears; under the native classes' ``te_style_init`` it initialises from the default
    generator, as TE does, and the tracker's ``fork`` is its own again afterwards."""
    from megatron.core.tensor_parallel import layers, random

    from megatron_rocm.runtime.backend._init_rng import te_style_init

    tracker = random.get_cuda_rng_tracker()
    tracker.reset()

    def init() -> torch.Tensor:
        weight = torch.nn.Parameter(torch.empty(4, 3))
        layers._initialize_affine_weight_gpu(weight, torch.nn.init.normal_, 0)
        return weight

    out = {"unseeded_upstream_init": _error_message(init)}
    with te_style_init():
        torch.manual_seed(3)
        got = init()
    torch.manual_seed(3)
    out["unseeded_te_init_is_default_generator"] = torch.equal(got, torch.randn(4, 3))
    out["unseeded_fork_restored"] = "fork" not in vars(tracker) and _error_message(init) != ""
    out.update(_unseeded_native_linears())
    return out


def _unseeded_native_linears() -> dict:
    """The native linears themselves on the GPU init path (``use_cpu_initialization=False``;
    ``torch.cuda.current_device`` answers "cpu" so the weights land on this CPU), tracker
    unseeded: upstream's local linear raises, the three native ones build."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    from megatron_rocm.runtime.backend.te_names import (
        TEColumnParallelLinear,
        TELayerNormColumnParallelLinear,
        TERowParallelLinear,
    )

    cfg = config("llama", torch.float32)
    cfg.use_cpu_initialization = False
    common = dict(
        config=cfg, init_method=torch.nn.init.normal_, bias=False, skip_bias_add=False,
        is_expert=False,
    )  # fmt: skip
    builds = {
        "local": lambda: ColumnParallelLinear(8, 8, gather_output=False, **common),
        "column": lambda: TEColumnParallelLinear(8, 8, gather_output=False, **common),
        "row": lambda: TERowParallelLinear(8, 8, input_is_parallel=True, **common),
        "ln_column": lambda: TELayerNormColumnParallelLinear(8, 8, gather_output=False, **common),
    }
    real = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"
    try:
        return {f"unseeded_build_{name}": _error_message(build) for name, build in builds.items()}
    finally:
        torch.cuda.current_device = real


def _checkpoint_without_output_fp8() -> bool | None:
    """The recompute-without-te patch: no FP8 branch without TE (None where there is no flag)."""
    from megatron.core.tensor_parallel import random

    ckpt = getattr(random, "CheckpointWithoutOutput", None)
    fp8 = getattr(ckpt(), "fp8", None) if ckpt is not None else None
    return None if fp8 is None else bool(fp8)


def cross_entropy_wiring() -> dict:
    """Both of upstream's loss entry points are the cross-entropy patch's wrappers around
    upstream's own functions, and (on the CPU, where they defer to upstream) agree with them."""
    from megatron.core import tensor_parallel
    from megatron.core.fusions import fused_cross_entropy
    from megatron.core.parallel_state import get_tensor_model_parallel_group

    plain = tensor_parallel.vocab_parallel_cross_entropy
    fused = fused_cross_entropy.fused_vocab_parallel_cross_entropy
    logits = torch.randn(4, 2, VOCAB, generator=torch.Generator().manual_seed(3))
    target = torch.randint(0, VOCAB, (4, 2), generator=torch.Generator().manual_seed(4))
    # clones: upstream's fp32 path exponentiates its input in place
    ours = plain(logits.clone(), target)
    theirs = plain.__wrapped__(logits.clone(), target)
    group = get_tensor_model_parallel_group()
    return {
        "ce_files": sorted({Path(f.__code__.co_filename).name for f in (plain, fused)}),
        "ce_wrapper_is_ours": all(
            "megatron_rocm" in Path(f.__code__.co_filename).parts for f in (plain, fused)
        ),
        "ce_wraps": [plain.__wrapped__.__module__, fused.__wrapped__.__module__],
        "ce_diff": (ours - theirs).abs().max().item(),
        "ce_fused_diff": (fused(logits.clone(), target, group) - theirs).abs().max().item(),
    }


def _experimental_attention_spec_provider(cfg) -> str | None:  # noqa: ANN001
    """The TE spec provider of upstream's experimental attention variants (DSA, gated delta
    net; 0.16+), where ``TESpecProvider`` was imported only with TE (None before 0.16)."""
    try:
        from megatron.core.models.gpt import experimental_attention_variant_module_specs as specs
    except ImportError:
        return None
    cfg.transformer_impl = "transformer_engine"
    provider = specs._get_backend_spec_provider(cfg)
    return f"{type(provider).__module__}.{type(provider).__name__}"


def swiglu_wiring() -> dict:
    """The swiglu patch: upstream's ``bias_swiglu_impl`` is wrapped where it is defined, so the
    MLP's import sees the wrapper; on the CPU it agrees with upstream's function, forward and
    backward, and a bias still takes upstream's path."""
    from megatron.core.fusions import fused_bias_swiglu
    from megatron.core.transformer import mlp

    impl = fused_bias_swiglu.bias_swiglu_impl
    y = torch.randn(3, 2, 10, generator=torch.Generator().manual_seed(5))
    g = torch.randn(3, 2, 5, generator=torch.Generator().manual_seed(6))
    grads = []
    for fn in (impl, impl.__wrapped__):
        x = y.clone().requires_grad_()
        out = fn(x, None)
        out.backward(g)
        grads.append((out.detach(), x.grad))
    bias = torch.randn(10)
    return {
        "swiglu_wrapper_is_ours": "megatron_rocm" in Path(impl.__code__.co_filename).parts,
        "swiglu_mlp_uses_it": mlp.bias_swiglu_impl is impl,
        "swiglu_diff": max((a - b).abs().max().item() for a, b in zip(*grads)),
        "swiglu_bias_diff": (impl(y, bias) - impl.__wrapped__(y, bias)).abs().max().item(),
    }


def main() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(1, 1)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(7))
    results = {}
    for item in sys.argv[1:]:
        try:
            if item == "modules":
                results[item] = modules_case()
                continue
            if item == "grouped":
                results[item] = grouped_case(tokens)
                continue
            kind, dtype_name = item.split(":")
            results[item] = case(kind, getattr(torch, dtype_name), tokens)
        except Exception as exc:  # reported per case: one broken variant must not hide others
            results[item] = {"error": f"{type(exc).__name__}: {exc}"}
    print(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
