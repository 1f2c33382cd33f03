"""Options that need TransformerEngine's kernels, refused at argument validation without TE.

Without TE some of upstream's options fail late and obscurely (a MagicMock deep in the model,
an assertion at the first step) and some would be silently ignored. The ``te-spec-backend`` patch calls
:func:`reject_te_only_options` in ``validate_args``; when ``transformer_engine`` cannot be
imported, every option below that is set stops the run before any GPU work, one line per
option, naming the flag and what to do instead. With TE installed none of them is refused.
``--fp8-format`` runs on the native linears (``backend.fp8``) with delayed, current or block
scaling (``--fp8-recipe delayed``, ``tensorwise`` or ``blockwise``); :func:`fp8_problems` names
what of upstream's FP8 they cannot do.
The same call stops a run whose ``MEGATRON_ROCM_*`` switches are malformed or unknown
(``runtime.settings``), TE or not.

Every option is read with ``getattr``: each exists only at some Megatron versions.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TeOnlyOption:
    """One Megatron option that needs TransformerEngine: where it lives and what to say."""

    dest: str  # attribute on Megatron's args namespace
    flag: str  # command-line spelling, for the message
    advice: str  # what to do instead
    is_set: Callable[[Any], bool] = bool


def _is(value: str) -> Callable[[Any], bool]:
    return lambda v: v == value


def _not_in(*values: Any) -> Callable[[Any], bool]:
    return lambda v: v is not None and v not in values


_NO_FP4 = (
    "train in bf16 (--bf16) or FP8 (--fp8-format, --fp8-recipe delayed, tensorwise or "
    "blockwise) instead"
)

TE_ONLY_OPTIONS: tuple[TeOnlyOption, ...] = (
    TeOnlyOption("fp4", "--fp4-format", _NO_FP4),
    TeOnlyOption(
        "fp8_dot_product_attention",
        "--fp8-dot-product-attention",
        "remove it; the native attention runs in bf16 (the linears still run FP8)",
    ),
    TeOnlyOption(
        "fp8_multi_head_attention",
        "--fp8-multi-head-attention",
        "remove it; the native attention runs in bf16 (the linears still run FP8)",
    ),
    TeOnlyOption(
        "tp_comm_overlap",
        "--tp-comm-overlap",
        "remove it; it needs TE's userbuffers (the TP all-gather/reduce-scatter still overlap "
        "with the backward GEMMs through torch.distributed)",
    ),
    TeOnlyOption(
        "cuda_graph_impl",
        "--cuda-graph-impl transformer_engine",
        "use --cuda-graph-impl local (Megatron's own CUDA graphs)",
        _is("transformer_engine"),
    ),
    TeOnlyOption(
        "external_cuda_graph",
        "--external-cuda-graph",
        "use --cuda-graph-impl local (Megatron's own CUDA graphs)",
    ),
    TeOnlyOption("delay_wgrad_compute", "--delay-wgrad-compute", "remove it"),
    TeOnlyOption(
        "fine_grained_activation_offloading",
        "--fine-grained-activation-offloading",
        "remove it, or use activation recomputation (--recompute-granularity)",
    ),
    TeOnlyOption(
        "cpu_offloading",
        "--cpu-offloading",
        "remove it, or use activation recomputation (--recompute-granularity)",
    ),
    TeOnlyOption(
        "use_transformer_engine_op_fuser", "--use-transformer-engine-op-fuser", "remove it"
    ),
    TeOnlyOption(
        "te_rng_tracker", "--te-rng-tracker", "remove it (Megatron's RNG tracker is used)"
    ),
    TeOnlyOption("fused_residual_rmsnorm", "--fused-residual-rmsnorm", "remove it"),
    TeOnlyOption(
        "softmax_type",
        "--softmax-type",
        "use --softmax-type vanilla (attention sinks need TE's fused attention)",
        _not_in("vanilla"),
    ),
    TeOnlyOption("qk_clip", "--qk-clip", "remove it (needs TE's max-logit output)"),
    TeOnlyOption(
        "log_max_attention_logit",
        "--log-max-attention-logit",
        "remove it (needs TE's max-logit output)",
    ),
    TeOnlyOption(
        "cross_entropy_fusion_impl",
        "--cross-entropy-fusion-impl te",
        "use --cross-entropy-fusion-impl native",
        _is("te"),
    ),
    TeOnlyOption("moe_permute_fusion", "--moe-permute-fusion", "remove it"),
    TeOnlyOption("moe_router_fusion", "--moe-router-fusion", "remove it"),
    TeOnlyOption(
        "moe_latent_size",
        "--moe-latent-size",
        "remove it (upstream builds the MoE latent projections only with TE)",
        _not_in(None, 0),
    ),
    TeOnlyOption(
        "te_precision_config_file",
        "--te-precision-config-file",
        "remove it; per-module precision recipes need TE's quantized GEMMs (train in bf16)",
    ),
    TeOnlyOption(
        "use_te_activation_func",
        "--use-te-activation-func",
        "remove it; the MLP then applies --swiglu or its default activation natively",
    ),
    TeOnlyOption(
        "batch_invariant_mode",
        "--batch-invariant-mode",
        "remove it; upstream makes TE's and aten's kernels batch-invariant, not the native "
        "ones megatron-rocm puts in their place",
    ),
    TeOnlyOption(
        "cp_comm_type",
        "--cp-comm-type a2a+p2p",
        "use --cp-comm-type p2p, all_gather or a2a (hierarchical CP needs TE)",
        lambda v: "a2a+p2p" in (v if isinstance(v, list) else [v]),
    ),
    TeOnlyOption(
        "transformer_impl",
        "--transformer-impl inference_optimized",
        "use --transformer-impl transformer_engine (the native backend) or local",
        _is("inference_optimized"),
    ),
)


def _legacy_grouped_gemm_without_package(value: Any) -> bool:
    return bool(value) and importlib.util.find_spec("grouped_gemm") is None


# Not a TE option, but the same kind of late failure: the legacy grouped GEMM (0.12-0.16) needs
# the `grouped_gemm` CUDA extension, which a stock ROCm install does not have.
LEGACY_GROUPED_GEMM = TeOnlyOption(
    "moe_use_legacy_grouped_gemm",
    "--moe-use-legacy-grouped-gemm",
    "drop it: --moe-grouped-gemm alone runs the native grouped GEMM",
    _legacy_grouped_gemm_without_package,
)


def _graphs_over_documents(args: Any) -> bool:
    """``--reset-attention-mask`` data under Megatron's CUDA graphs on the native attention.

    The native attention honours that data's block-causal mask (TE ignores it) by reading its
    documents on the host every batch; a captured graph replays one batch's decision for all
    of them, so the combination cannot train as asked. The local spec's unfused softmax reads
    the mask on the GPU and is not concerned.
    """
    graphs = getattr(args, "cuda_graph_impl", "none") in ("local", "full_iteration") or bool(
        getattr(args, "enable_cuda_graph", False)
    )
    return graphs and _native_spec(args) and bool(getattr(args, "reset_attention_mask", False))


def _native_spec(args: Any) -> bool:
    return getattr(args, "transformer_impl", "transformer_engine") == "transformer_engine"


def _meta_init_on_native(args: Any) -> bool:
    """``--init-model-with-meta-device`` on the TE spec's native modules.

    TE builds its modules' parameters on the meta device for Megatron-FSDP (or FSDP2) to
    materialise shard by shard; the native column, row and norm-fused linears are upstream's
    local classes, which allocate on the GPU (so the flag would save nothing), and the others
    have no ``reset_parameters`` for FSDP to call. The local spec is upstream's own business.
    """
    return bool(getattr(args, "init_model_with_meta_device", False)) and _native_spec(args)


def _pinned_flash_on_native(args: Any) -> bool:
    """``--flash-attention-version`` on the TE spec's native attention.

    Upstream pins the training side's FlashAttention generation through TE's
    ``NVTE_FLASH_ATTN_V*`` variables, so that it matches the inference engine bit for bit; the
    native attention runs torch SDPA's kernels, which no generation number selects."""
    return getattr(args, "flash_attention_version", None) is not None and _native_spec(args)


def _weight_shards_beyond_tp(args: Any) -> list[str]:
    """GTP's flags (0.19+) that shard weights beyond tensor parallelism, where set.

    Upstream runs GTP on TE's collectives only (``HAVE_GTP = HAVE_TE``; without TE its module
    swaps them for mocks), whatever the spec, so a run with more shards than TP ranks would
    fail at its first forward instead of at validation."""
    tp = getattr(args, "tensor_model_parallel_size", 1) or 1
    etp = getattr(args, "expert_tensor_parallel_size", None) or tp
    given = []
    for flag, dest, ranks in (
        ("--tensor-parallel-num-weight-shards", "tensor_parallel_num_weight_shards", tp),
        ("--expert-tensor-parallel-num-weight-shards", "expert_tensor_parallel_num_weight_shards",
         etp),
    ):  # fmt: skip
        shards = getattr(args, dest, None)
        if shards is not None and shards > ranks:
            given.append(flag)
    return given


_FP8_RECIPE_ADVICE = {
    "mxfp8": "MXFP8 needs TE's block-scaled GEMMs and a GPU with them (Blackwell)",
    "custom": "a custom quantizer factory builds TE quantizers",
}


def fp8_problems(args: Any) -> list[str]:
    """Without TE, one message per part of an ``--fp8-format`` run the native FP8 linears
    (``backend.fp8``: current or delayed per-tensor scaling, or block scaling) cannot do."""
    fmt = getattr(args, "fp8", None)
    if not fmt:
        return []
    from megatron_rocm.runtime.backend.fp8 import NATIVE_RECIPES

    problems = []
    recipe = str(getattr(args, "fp8_recipe", "delayed"))
    if recipe not in NATIVE_RECIPES:
        why = _FP8_RECIPE_ADVICE.get(recipe, "it is not per-tensor scaling")
        problems.append(
            f"--fp8-recipe {recipe}: needs TransformerEngine, which is not installed ({why}); "
            "use --fp8-recipe tensorwise, delayed or blockwise (native)"
        )
    if not _native_spec(args):
        problems.append(
            f"--fp8-format with --transformer-impl {args.transformer_impl}: the local spec's "
            "linears have no FP8 path, with or without TransformerEngine (they would train in "
            "bf16); use --transformer-impl transformer_engine (the native backend)"
        )
    if getattr(args, "num_experts", None):
        problems.extend(_moe_fp8_problems(args, recipe))
    granularity = getattr(args, "recompute_granularity", None)
    modules = set(getattr(args, "recompute_modules", None) or ["core_attn"]) - {"core_attn"}
    if granularity == "full" or (granularity == "selective" and modules):
        what = (
            "--recompute-granularity full"
            if granularity == "full"
            else ("--recompute-modules " + " ".join(sorted(modules)))
        )
        problems.append(
            f"--fp8-format with {what}: upstream recomputes FP8 layers through TE's "
            "checkpoint (te_checkpoint), which needs TransformerEngine; recompute core_attn "
            "only (--recompute-granularity selective) or train in bf16"
        )
    if getattr(args, "cuda_graph_impl", "none") == "local" or getattr(
        args, "enable_cuda_graph", False
    ):
        problems.append(
            "--fp8-format with --cuda-graph-impl local: upstream's layer graphs keep FP8 state "
            "in TE's FP8GlobalStateManager, which needs TransformerEngine; use "
            "--cuda-graph-impl full_iteration or no CUDA graphs"
        )
    if getattr(args, "use_megatron_fsdp", False):
        problems.append(
            "--fp8-format with --use-megatron-fsdp: without TransformerEngine the FP8 "
            "linears need Megatron's DDP; use --use-distributed-optimizer"
        )
    problems.extend(fp8_param_gather_problems(args))
    from megatron_rocm.runtime.kernels.fp8 import unsupported_gpu_reason

    gpu = unsupported_gpu_reason()
    if gpu is not None:
        problems.append(f"--fp8-format {fmt}: this GPU ({gpu}); train in bf16")
    return problems


def _moe_fp8_problems(args: Any, recipe: str) -> list[str]:
    """What the native FP8 experts (current scaling, bf16 weights, core 0.13 and later) cannot
    do in an ``--fp8-format --num-experts`` run."""
    problems = []
    if recipe == "delayed":  # mxfp8 and the others get their own line above
        problems.append(
            f"--fp8-format with --num-experts under --fp8-recipe {recipe}: without "
            "TransformerEngine the experts scale by current amaxes only (an expert's history "
            "would be reduced with other ranks' experts); use --fp8-recipe tensorwise"
        )
    if recipe == "blockwise":
        problems.append(
            "--fp8-format with --num-experts under --fp8-recipe blockwise: without "
            "TransformerEngine the experts scale per tensor only; use --fp8-recipe tensorwise"
        )
    if getattr(args, "fp8_param_gather", False):
        problems.append(
            "--fp8-param-gather with --num-experts: without TransformerEngine the experts' "
            "weights stay bf16; drop --fp8-param-gather"
        )
    legacy = getattr(args, "moe_use_legacy_grouped_gemm", False)
    if legacy and not _legacy_grouped_gemm_without_package(legacy):  # else refused as such
        problems.append(
            "--fp8-format with --moe-use-legacy-grouped-gemm: without TransformerEngine the "
            "legacy GroupedMLP has no FP8 path; use --moe-grouped-gemm alone (the native "
            "grouped experts run FP8)"
        )
    try:
        from megatron.core import package_info
    except ImportError:
        return problems
    if (int(package_info.MAJOR), int(package_info.MINOR)) < (0, 13):
        problems.append(
            "--fp8-format with --num-experts: without TransformerEngine core 0.12's experts "
            "import TE's FP8 padding; use core 0.13 or later, or train in bf16"
        )
    return problems


# what the native FP8 weights (backend.fp8_param) are not written by, each with its flag
_FP8_PARAM_GATHER_WITHOUT = (
    ("use_torch_fsdp2", "--use-torch-fsdp2", "FSDP2 gathers TE's FP8 tensors"),
    ("use_megatron_fsdp", "--use-megatron-fsdp", "Megatron-FSDP gathers TE's FP8 tensors"),
    (
        "use_precision_aware_optimizer",
        "--use-precision-aware-optimizer",
        "TE's FusedAdam writes the FP8 weights there",
    ),
    ("optimizer_cpu_offload", "--optimizer-cpu-offload", "the offloaded step writes TE's"),
    (
        "use_cpu_initialization",
        "--use-cpu-initialization",
        "the FP8 weights are built on the GPU",
    ),
)


def fp8_param_gather_problems(args: Any) -> list[str]:
    """Without TE, what of an ``--fp8-param-gather`` run the native FP8 weights
    (``backend.fp8_param``: written by the distributed optimizer's step, gathered by
    Megatron's DDP) cannot do."""
    if not getattr(args, "fp8_param_gather", False):
        return []
    problems = [
        f"--fp8-param-gather with {flag}: without TransformerEngine {why}; use "
        "--use-distributed-optimizer alone, or drop --fp8-param-gather"
        for dest, flag, why in _FP8_PARAM_GATHER_WITHOUT
        if getattr(args, dest, False)
    ]
    if str(getattr(args, "fp8_recipe", "delayed")) == "blockwise":
        from megatron_rocm.runtime.backend.fp8 import BLOCKWISE_PARAM_GATHER

        problems.append(BLOCKWISE_PARAM_GATHER)
    tp = getattr(args, "tensor_model_parallel_size", 1) or 1
    if tp > 1 and str(getattr(args, "fp8_recipe", "delayed")) == "delayed":
        problems.append(
            f"--fp8-param-gather with delayed scaling and --tensor-model-parallel-size {tp}: "
            "without TransformerEngine the optimizer step does not reduce the weight amax over "
            "TP ranks; use --fp8-recipe tensorwise, TP 1, or drop --fp8-param-gather"
        )
    optimizer = getattr(args, "optimizer", "adam")
    if optimizer not in ("adam", "sgd"):
        problems.append(
            f"--fp8-param-gather with --optimizer {optimizer}: without TransformerEngine the "
            "FP8 weights are written by the distributed optimizer's step (--optimizer adam or "
            "sgd); use one of those or drop --fp8-param-gather"
        )
    return problems


def transformer_engine_installed() -> bool:
    """Whether ``import transformer_engine`` can work (without importing it)."""
    return importlib.util.find_spec("transformer_engine") is not None


def te_only_options_in_use(args: Any) -> list[str]:
    """One message per TE-only option set on ``args``."""
    problems = [
        f"{opt.flag}: needs TransformerEngine, which is not installed; {opt.advice}"
        for opt in TE_ONLY_OPTIONS
        if hasattr(args, opt.dest) and opt.is_set(getattr(args, opt.dest))
    ]
    problems.extend(fp8_problems(args))
    if _graphs_over_documents(args):
        problems.append(
            "--reset-attention-mask with --cuda-graph-impl: without TransformerEngine the "
            "attention reads each batch's documents on the host, which a CUDA graph cannot "
            "follow; drop one of the two, or use --transformer-impl local"
        )
    if _meta_init_on_native(args):
        problems.append(
            "--init-model-with-meta-device: without TransformerEngine the TE spec's linears are "
            "built on the GPU, as upstream's local ones are, so it would save no memory; remove "
            "it (or install TransformerEngine)"
        )
    if _pinned_flash_on_native(args):
        problems.append(
            "--flash-attention-version: without TransformerEngine the TE spec's attention runs "
            "torch SDPA's kernels, which no FlashAttention generation pins; remove it "
            "(--attention-backend flash picks SDPA's flash kernel)"
        )
    problems.extend(
        f"{flag} above the tensor-parallel size (GTP): needs TransformerEngine, which is not "
        "installed (upstream runs no GTP path without it); set it to the tensor-parallel size "
        "or leave it out"
        for flag in _weight_shards_beyond_tp(args)
    )
    if (
        getattr(args, "moe_token_dispatcher_type", None) == "flex"
        and getattr(args, "moe_flex_dispatcher_backend", None) == "ncclep"
    ):
        problems.append(
            "--moe-flex-dispatcher-backend ncclep: needs TransformerEngine built with NCCL EP, "
            "which is not installed; use --moe-token-dispatcher-type alltoall"
        )
    legacy = LEGACY_GROUPED_GEMM
    if hasattr(args, legacy.dest) and legacy.is_set(getattr(args, legacy.dest)):
        problems.append(
            f"{legacy.flag}: needs the grouped_gemm package, which is not installed; "
            f"{legacy.advice}"
        )
    return problems


def reject_te_only_options(args: Any) -> None:
    """Without TE, raise one ``ValueError`` listing each TE-only option in use; with or
    without TE, each malformed or unknown ``MEGATRON_ROCM_*`` switch too (``settings``: they
    are read where they act, minutes into a run, and a misspelt one never)."""
    from megatron_rocm.runtime import settings

    problems = settings.problems()
    if not transformer_engine_installed():
        problems += te_only_options_in_use(args)
    if problems:
        raise ValueError("megatron-rocm: " + "\n".join(problems))
