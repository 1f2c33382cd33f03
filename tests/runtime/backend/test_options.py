"""TE-only options are refused at argument validation when TransformerEngine is absent."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from megatron_rocm.runtime.backend import options
from megatron_rocm.runtime.backend.options import (
    TE_ONLY_OPTIONS,
    reject_te_only_options,
    te_only_options_in_use,
)

DEFAULTS = {
    "fp4": None,
    "fp8_dot_product_attention": False,
    "fp8_multi_head_attention": False,
    "tp_comm_overlap": False,
    "cuda_graph_impl": "none",
    "external_cuda_graph": False,
    "delay_wgrad_compute": False,
    "fine_grained_activation_offloading": False,
    "cpu_offloading": False,
    "use_transformer_engine_op_fuser": False,
    "te_rng_tracker": False,
    "fused_residual_rmsnorm": False,
    "softmax_type": "vanilla",
    "qk_clip": False,
    "log_max_attention_logit": False,
    "cross_entropy_fusion_impl": "native",
    "moe_permute_fusion": False,
    "moe_router_fusion": False,
    "moe_latent_size": None,
    "transformer_impl": "transformer_engine",
    "cp_comm_type": ["p2p"],
    "te_precision_config_file": None,
    "use_te_activation_func": False,
    "batch_invariant_mode": False,
}
SET = {
    "te_precision_config_file": "precision.yaml",
    "fp4": "nvfp4",
    "cuda_graph_impl": "transformer_engine",
    "softmax_type": "learnable",
    "cross_entropy_fusion_impl": "te",
    "transformer_impl": "inference_optimized",
    "cp_comm_type": ["p2p", "a2a+p2p"],
    "moe_latent_size": 256,
}


@pytest.fixture(autouse=True)
def no_te(monkeypatch):
    monkeypatch.setattr(options, "transformer_engine_installed", lambda: False)


def test_upstream_defaults_pass():
    reject_te_only_options(SimpleNamespace(**DEFAULTS))
    reject_te_only_options(SimpleNamespace())  # an old tag without any of these options


@pytest.mark.parametrize("opt", TE_ONLY_OPTIONS, ids=lambda o: o.dest)
def test_each_option_is_refused_with_its_flag(opt):
    args = SimpleNamespace(**{**DEFAULTS, opt.dest: SET.get(opt.dest, True)})
    with pytest.raises(ValueError) as err:
        reject_te_only_options(args)
    message = str(err.value)
    assert opt.flag in message and "TransformerEngine" in message
    assert len(message.splitlines()) == 1


def test_every_default_is_in_the_table():
    assert {o.dest for o in TE_ONLY_OPTIONS} == set(DEFAULTS)


def test_local_cuda_graphs_and_vanilla_softmax_are_fine():
    args = SimpleNamespace(**{**DEFAULTS, "cuda_graph_impl": "local", "transformer_impl": "local"})
    assert te_only_options_in_use(args) == []


def test_several_options_one_line_each():
    args = SimpleNamespace(**{**DEFAULTS, "fp4": "nvfp4", "tp_comm_overlap": True})
    assert len(te_only_options_in_use(args)) == 2


def test_nothing_is_refused_when_te_is_installed(monkeypatch):
    monkeypatch.setattr(options, "transformer_engine_installed", lambda: True)
    reject_te_only_options(SimpleNamespace(**{**DEFAULTS, "fp8": "hybrid"}))


def test_legacy_grouped_gemm_needs_its_package(monkeypatch):
    monkeypatch.setattr(options.importlib.util, "find_spec", lambda name: None)
    args = SimpleNamespace(**{**DEFAULTS, "moe_use_legacy_grouped_gemm": True})
    (message,) = te_only_options_in_use(args)
    assert "--moe-use-legacy-grouped-gemm" in message and "--moe-grouped-gemm" in message
    assert te_only_options_in_use(SimpleNamespace(**DEFAULTS)) == []


@pytest.mark.parametrize(
    ("graphs", "impl", "refused"),
    [
        ({"cuda_graph_impl": "local"}, "transformer_engine", True),
        ({"cuda_graph_impl": "full_iteration"}, "transformer_engine", True),
        ({"enable_cuda_graph": True}, "transformer_engine", True),  # the older spelling
        ({"cuda_graph_impl": "local"}, "local", False),  # the unfused softmax reads it on the GPU
        ({"cuda_graph_impl": "none"}, "transformer_engine", False),
    ],
)
def test_document_masks_under_cuda_graphs_are_refused_on_the_native_attention(
    graphs, impl, refused
):
    args = SimpleNamespace(
        **{**DEFAULTS, **graphs, "transformer_impl": impl, "reset_attention_mask": True}
    )
    want = [
        "--reset-attention-mask with --cuda-graph-impl: without TransformerEngine the attention "
        "reads each batch's documents on the host, which a CUDA graph cannot follow; drop one "
        "of the two, or use --transformer-impl local"
    ]
    assert te_only_options_in_use(args) == (want if refused else [])


@pytest.mark.parametrize(
    ("dest", "value", "unset", "flag"),
    [
        ("init_model_with_meta_device", True, False, "--init-model-with-meta-device"),
        ("flash_attention_version", 3, None, "--flash-attention-version"),
    ],
)
@pytest.mark.parametrize(("impl", "refused"), [("transformer_engine", True), ("local", False)])
def test_options_refused_on_the_native_spec_only(dest, value, unset, flag, impl, refused):
    args = SimpleNamespace(**{**DEFAULTS, "transformer_impl": impl, dest: value})
    problems = te_only_options_in_use(args)
    assert len(problems) == int(refused)
    if refused:
        assert problems[0].startswith(f"{flag}: ")
        assert len(problems[0].splitlines()) == 1
    assert te_only_options_in_use(SimpleNamespace(**{**DEFAULTS, dest: unset})) == []


@pytest.mark.parametrize(
    ("extra", "refused"),
    [
        ({"tensor_parallel_num_weight_shards": 4}, ["--tensor-parallel-num-weight-shards"]),
        ({"tensor_parallel_num_weight_shards": 2}, []),  # equal to TP: no GTP
        ({"expert_tensor_parallel_num_weight_shards": 4, "expert_tensor_parallel_size": 2},
         ["--expert-tensor-parallel-num-weight-shards"]),
        ({"expert_tensor_parallel_num_weight_shards": 2}, []),  # ETP defaults to TP
        ({"tensor_parallel_num_weight_shards": None}, []),
    ],
)  # fmt: skip
def test_weight_shards_beyond_tensor_parallelism_need_te(extra, refused):
    args = SimpleNamespace(**{**DEFAULTS, "tensor_model_parallel_size": 2, **extra})
    problems = te_only_options_in_use(args)
    assert [p.split(" above ")[0] for p in problems] == refused
    assert all(len(p.splitlines()) == 1 for p in problems)


@pytest.mark.parametrize(
    ("dispatcher", "backend", "refused"),
    [("flex", "ncclep", True), ("flex", "deepep", False), ("alltoall", "ncclep", False)],
)
def test_the_nccl_ep_flex_dispatcher_needs_te(dispatcher, backend, refused):
    args = SimpleNamespace(
        **{**DEFAULTS, "moe_token_dispatcher_type": dispatcher,
           "moe_flex_dispatcher_backend": backend}
    )  # fmt: skip
    problems = te_only_options_in_use(args)
    assert [p.split(":")[0] for p in problems] == (
        ["--moe-flex-dispatcher-backend ncclep"] if refused else []
    )


# -- FP8 on the native linears --------------------------------------------------------------

FP8_RUN = {"fp8": "hybrid", "fp8_recipe": "tensorwise", "tensor_model_parallel_size": 1}


@pytest.fixture
def no_gpu(monkeypatch):
    from megatron_rocm.runtime.kernels import fp8

    monkeypatch.setattr(fp8, "unsupported_gpu_reason", lambda: None)


@pytest.mark.parametrize("fmt", ["hybrid", "e4m3"])
@pytest.mark.parametrize("recipe", ["tensorwise", "delayed", "blockwise"])
def test_fp8_with_a_native_recipe_is_accepted(no_gpu, fmt, recipe) -> None:
    reject_te_only_options(
        SimpleNamespace(**{**DEFAULTS, **FP8_RUN, "fp8": fmt, "fp8_recipe": recipe})
    )
    graphs = {"cuda_graph_impl": "full_iteration", "check_for_nan_in_loss_and_grad": False}
    reject_te_only_options(SimpleNamespace(**{**DEFAULTS, **FP8_RUN, **graphs}))
    selective = {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]}
    reject_te_only_options(SimpleNamespace(**{**DEFAULTS, **FP8_RUN, **selective}))
    gathered = {"fp8_param_gather": True, "use_distributed_optimizer": True}
    reject_te_only_options(SimpleNamespace(**{**DEFAULTS, **FP8_RUN, **gathered}))
    run = {**DEFAULTS, **FP8_RUN, "fp8": fmt, "fp8_recipe": recipe}
    tensor_parallel = {"tensor_model_parallel_size": 2, "sequence_parallel": True}
    reject_te_only_options(SimpleNamespace(**{**run, **tensor_parallel}))
    if recipe == "tensorwise":  # delayed scaling's FP8 weights are refused with TP, MoE too
        reject_te_only_options(SimpleNamespace(**{**run, **tensor_parallel, **gathered}))
        reject_te_only_options(SimpleNamespace(**{**run, "num_experts": 8}))


@pytest.mark.parametrize(
    ("change", "flag", "advice"),
    [
        ({"fp8_recipe": "mxfp8"}, "--fp8-recipe mxfp8", "Blackwell"),
        (
            {"fp8_recipe": "blockwise", "fp8_param_gather": True},
            "--fp8-param-gather with --fp8-recipe blockwise",
            "drop --fp8-param-gather",
        ),
        (
            {"num_experts": 8, "fp8_recipe": "blockwise"},
            "--num-experts under --fp8-recipe blockwise",
            "use --fp8-recipe tensorwise",
        ),
        ({"fp8_recipe": "custom"}, "--fp8-recipe custom", "quantizer"),
        (
            {"fp8_param_gather": True, "fp8_recipe": "delayed", "tensor_model_parallel_size": 2},
            "--fp8-param-gather with delayed scaling and --tensor-model-parallel-size 2",
            "--fp8-recipe tensorwise",
        ),
        (
            {"num_experts": 8, "fp8_recipe": "delayed"},
            "--num-experts under --fp8-recipe delayed",
            "use --fp8-recipe tensorwise",
        ),
        (
            {"num_experts": 8, "fp8_param_gather": True},
            "--fp8-param-gather with --num-experts",
            "drop --fp8-param-gather",
        ),
        ({"transformer_impl": "local"}, "--transformer-impl local", "transformer_engine"),
        ({"use_megatron_fsdp": True}, "--use-megatron-fsdp", "--use-distributed-optimizer"),
        ({"cuda_graph_impl": "local"}, "--cuda-graph-impl local", "full_iteration"),
        ({"enable_cuda_graph": True}, "--cuda-graph-impl local", "FP8GlobalStateManager"),
        (
            {"fp8_param_gather": True, "use_torch_fsdp2": True},
            "--fp8-param-gather with --use-torch-fsdp2",
            "--use-distributed-optimizer alone",
        ),
        (
            {"fp8_param_gather": True, "use_precision_aware_optimizer": True},
            "--fp8-param-gather with --use-precision-aware-optimizer",
            "FusedAdam",
        ),
        (
            {"fp8_param_gather": True, "use_cpu_initialization": True},
            "--fp8-param-gather with --use-cpu-initialization",
            "built on the GPU",
        ),
        (
            {"fp8_param_gather": True, "optimizer": "muon"},
            "--fp8-param-gather with --optimizer muon",
            "--optimizer adam or sgd",
        ),
        ({"fp8_dot_product_attention": True}, "--fp8-dot-product-attention", "bf16"),
        ({"fp8_multi_head_attention": True}, "--fp8-multi-head-attention", "bf16"),
        ({"recompute_granularity": "full"}, "--recompute-granularity full", "te_checkpoint"),
        (
            {"recompute_granularity": "selective", "recompute_modules": ["core_attn", "mlp"]},
            "--recompute-modules mlp",
            "core_attn only",
        ),
    ],
)
def test_what_the_native_fp8_cannot_do_is_one_line_each(no_gpu, change, flag, advice) -> None:
    (message,) = te_only_options_in_use(SimpleNamespace(**{**DEFAULTS, **FP8_RUN, **change}))
    assert flag in message and advice in message and "TransformerEngine" in message
    assert "\n" not in message


def test_fp8_on_a_gpu_without_fp8_gemms_is_refused(monkeypatch) -> None:
    from megatron_rocm.runtime.kernels import fp8

    monkeypatch.setattr(fp8, "unsupported_gpu_reason", lambda: "gfx90a has no FP8 GEMMs")
    (message,) = te_only_options_in_use(SimpleNamespace(**{**DEFAULTS, **FP8_RUN}))
    assert message == "--fp8-format hybrid: this GPU (gfx90a has no FP8 GEMMs); train in bf16"


def test_gpu_fp8_support_by_arch(monkeypatch) -> None:
    import torch

    from megatron_rocm.runtime.kernels import fp8

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "hip", "6.4")
    for arch, ok in (("gfx942", True), ("gfx950", True), ("gfx90a", False)):
        monkeypatch.setattr(fp8, "gpu_arch", lambda arch=arch: arch)
        assert (fp8.unsupported_gpu_reason() is None) is ok, arch
    monkeypatch.setattr(torch.version, "hip", None)
    for cap, ok in (((9, 0), True), ((8, 9), True), ((8, 0), False)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda cap=cap: cap)
        assert (fp8.unsupported_gpu_reason() is None) is ok, cap


def test_fp8_experts_on_core_0_12_are_refused(no_gpu, monkeypatch) -> None:
    """Core 0.12's experts import TE's FP8 padding without the extension module."""
    import sys
    import types

    for version, refused in (("12", True), ("13", False)):
        info = types.SimpleNamespace(MAJOR="0", MINOR=version)
        core = types.ModuleType("megatron.core")
        core.package_info = info
        monkeypatch.setitem(sys.modules, "megatron", types.ModuleType("megatron"))
        monkeypatch.setitem(sys.modules, "megatron.core", core)
        args = SimpleNamespace(**{**DEFAULTS, **FP8_RUN, "num_experts": 8})
        problems = te_only_options_in_use(args)
        assert problems == (
            ["--fp8-format with --num-experts: without TransformerEngine core 0.12's experts "
             "import TE's FP8 padding; use core 0.13 or later, or train in bf16"]
            if refused else []
        )  # fmt: skip


def test_fp8_with_the_legacy_grouped_experts_is_refused(no_gpu, monkeypatch) -> None:
    """With the ``grouped_gemm`` package installed (else its own refusal says so), the legacy
    GroupedMLP would train FP8 runs' experts in bf16."""
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: object() if name == "grouped_gemm" else find_spec(name, *a),
    )
    args = {**DEFAULTS, **FP8_RUN, "num_experts": 8, "moe_use_legacy_grouped_gemm": True}
    (message,) = te_only_options_in_use(SimpleNamespace(**args))
    assert "--moe-use-legacy-grouped-gemm" in message and "--moe-grouped-gemm alone" in message
