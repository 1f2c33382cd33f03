"""The small models the training, resume and parallel checks build, through either layer spec.

Every check builds its GPTModel here so that all of them train the same network on the same
data: a 1-GPU run and its TP2 / PP2 / DP2 / EP2 / CP2 / FSDP counterparts start from the same
weights (``weights.py``) and see the same global batch, which is what makes their losses
comparable. The fusion flags are those ``pretrain_gpt.py`` turns on by default: the config's
own defaults switch every fusion off and would never reach the code the series patches.

Two specs: ``local`` (``get_gpt_layer_local_spec``) and ``te`` (upstream's default,
``get_gpt_layer_with_transformer_engine_spec``), which without TransformerEngine resolves to
megatron_rocm's native backend on a patched tree and dies with a TypeError on an unpatched one.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
from collections.abc import Iterator
from typing import Any

import torch

SEQ, GLOBAL_BATCH, MICRO_BATCH, VOCAB = 128, 4, 2, 1024
LR = 1e-3  # AdamW on 2 fixed batches of random tokens: the loss falls fast (memorisation)
SEED = 1234
SPECS = ("local", "te")
FUSIONS = {
    "masked_softmax_fusion": True,
    "bias_activation_fusion": True,
    "bias_dropout_fusion": True,
    "persist_layer_norm": True,
    "gradient_accumulation_fusion": True,
}
GPT = {"num_layers": 2, "hidden_size": 256, "num_attention_heads": 4}
LLAMA = {
    "num_layers": 2,
    "hidden_size": 256,
    "num_attention_heads": 8,
    "num_query_groups": 2,
    "ffn_hidden_size": 688,
    "normalization": "RMSNorm",
    "gated_linear_unit": True,
    "add_bias_linear": False,
    "activation_func": torch.nn.functional.silu,
    "apply_rope_fusion": True,
}
MOE = {
    **LLAMA,
    "num_moe_experts": 4,
    "moe_router_topk": 2,
    "moe_ffn_hidden_size": 344,
    "moe_token_dispatcher_type": "alltoall",
}
# Four GPUs: interleaved pipelining needs a layer for each of PP2 x 2 virtual stages, and
# expert parallel 4 needs more than one expert per rank for a grouped GEMM to group anything.
LLAMA_DEEP = {**LLAMA, "num_layers": 4}
MOE8 = {**MOE, "num_moe_experts": 8}
SHAPES = {"gpt": GPT, "llama": LLAMA, "moe": MOE, "llama_deep": LLAMA_DEEP, "moe8": MOE8}


class TESpecUnavailable(RuntimeError):
    """Upstream's TE spec cannot build here (no TransformerEngine, no native backend)."""


@dataclasses.dataclass(frozen=True)
class Layout:
    """How one run is parallelised (sizes multiply to the world size, DP fills the rest)."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    sp: bool = False
    vpp: int = 1  # virtual pipeline stages (model chunks) per pipeline rank: interleaved 1F1B

    @property
    def virtual_size(self) -> int | None:
        """What Megatron calls ``virtual_pipeline_model_parallel_size``: None without chunks."""
        return self.vpp if self.vpp > 1 else None


def grouped_gemm_available() -> bool:
    """The native grouped GEMM (TE spec, ``--moe-grouped-gemm``) is in this megatron_rocm."""
    return importlib.util.find_spec("megatron_rocm.runtime.kernels.grouped_gemm") is not None


def _accepted(func: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    params = inspect.signature(func).parameters
    return {k: v for k, v in kwargs.items() if k in params}


def build_config(
    model: str,
    layout: Layout,
    *,
    spec: str,
    gpu: bool,
    deterministic: bool = False,
    overrides: dict[str, Any] | None = None,
) -> Any:
    """A TransformerConfig with pretrain_gpt's fusion defaults; fields this tag lacks are
    dropped (so one recipe serves core_v0.12 to main). ``transformer_impl`` follows the layer
    spec as ``--transformer-impl`` does in pretrain_gpt (0.14+ read it, e.g. torch FSDP2)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    extra = dict(overrides or {})
    if "num_moe_experts" not in SHAPES[model]:  # MoE settings mean nothing to a dense model
        extra = {k: v for k, v in extra.items() if not k.startswith("moe_")}
    kwargs: dict[str, Any] = {**FUSIONS, **SHAPES[model], **extra}
    kwargs.update(
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bf16=True,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
        use_cpu_initialization=True,  # the same initial weights on every device and process
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        virtual_pipeline_model_parallel_size=layout.virtual_size,
        # what pretrain_gpt.py sets with virtual stages (--overlap-p2p-communication is on by
        # default there, and batch_p2p_comm = not overlap_p2p_comm); without them, its defaults
        overlap_p2p_comm=layout.vpp > 1,
        batch_p2p_comm=layout.vpp == 1,
        sequence_parallel=layout.sp,
        deterministic_mode=deterministic,
        transformer_impl="local" if spec == "local" else "transformer_engine",
    )
    if not gpu:
        kwargs["gradient_accumulation_fusion"] = False  # CPU (our tests): no main_grad kernel
    return TransformerConfig(**{k: v for k, v in kwargs.items() if k in fields})


def layer_spec(spec: str, config: Any, grouped_gemm: bool = False) -> Any:
    from megatron.core.models.gpt import gpt_layer_specs as specs

    moe = {"num_experts": config.num_moe_experts, "moe_grouped_gemm": grouped_gemm}
    if not config.num_moe_experts:
        moe = {}
    if spec == "local":
        kwargs = {**moe, "normalization": config.normalization}
        return specs.get_gpt_layer_local_spec(**_accepted(specs.get_gpt_layer_local_spec, kwargs))
    if spec != "te":
        raise ValueError(f"unknown layer spec {spec!r}")
    builder = specs.get_gpt_layer_with_transformer_engine_spec
    try:
        return builder(**_accepted(builder, moe))
    except TypeError as e:  # TESpecProvider / TENorm are None without TE: upstream's error
        raise te_spec_error(e) from e


def te_spec_error(e: BaseException) -> TESpecUnavailable:
    native = importlib.util.find_spec("megatron_rocm.runtime.backend") is not None
    why = (
        "is this tree patched? the te-spec-backend patch binds the TE names to "
        "megatron_rocm.runtime.backend"
        if native
        else "this megatron_rocm has no native TE backend (megatron_rocm.runtime.backend)"
    )
    return TESpecUnavailable(
        f"upstream's TE spec does not build without TransformerEngine ({type(e).__name__}: "
        f"{e}); {why}"
    )


def build_model(
    model: str,
    spec: str,
    config: Any,
    *,
    grouped_gemm: bool = False,
    device: Any = "cpu",
    vp_stage: int = 0,
) -> Any:
    """GPTModel for this pipeline stage and virtual stage ``vp_stage`` (the first chunk of the
    first stage holds the embedding, the last chunk of the last stage the output layer). The
    caller sets Megatron's virtual rank to ``vp_stage`` (``engine.virtual_stage``): trees
    before 0.13 read the layer offset from it, later ones from ``vp_stage``."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    chunks = config.virtual_pipeline_model_parallel_size or 1
    kwargs = dict(
        config=config,
        transformer_layer_spec=layer_spec(spec, config, grouped_gemm),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=True) and vp_stage == 0,
        post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=True)
        and vp_stage == chunks - 1,
        share_embeddings_and_output_weights=model == "gpt",
        position_embedding_type="learned_absolute" if model == "gpt" else "rope",
    )
    if chunks > 1 and "vp_stage" in inspect.signature(GPTModel.__init__).parameters:
        kwargs["vp_stage"] = vp_stage
    try:
        net = GPTModel(**kwargs)
    except TypeError as e:
        if spec == "te" and "NoneType" in str(e):
            raise te_spec_error(e) from e
        raise
    return net.to(device)


def global_batch(step: int, device: Any) -> dict[str, torch.Tensor]:
    """Batch ``step % 2`` of two fixed random batches: a working model memorises them."""
    g = torch.Generator().manual_seed(step % 2)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=g)
    return {
        "tokens": tokens[:, :-1].to(device),
        "labels": tokens[:, 1:].to(device),
        "position_ids": torch.arange(SEQ).unsqueeze(0).expand(GLOBAL_BATCH, -1).to(device),
    }


def cp_slice(t: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """The sequence chunks context-parallel rank ``rank`` holds: upstream's load-balanced
    layout (``get_batch_on_this_cp_rank``), chunks ``rank`` and ``2*cp - 1 - rank`` of 2*cp."""
    if cp == 1:
        return t
    chunks = t.chunk(2 * cp, dim=1)
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]], dim=1)


def micro_batch_size(dp: int) -> int:
    """MICRO_BATCH, or what is left of the global batch per data-parallel rank when that is
    less (DP4 on a global batch of 4): every layout trains on the same global batch."""
    if GLOBAL_BATCH % dp:
        raise ValueError(f"a global batch of {GLOBAL_BATCH} does not split over DP {dp}")
    return min(MICRO_BATCH, GLOBAL_BATCH // dp)


def microbatches(
    step: int, device: Any, *, dp: int, dp_rank: int, cp: int, cp_rank: int
) -> Iterator[dict[str, torch.Tensor]]:
    """This rank's share of the global batch of ``step``, in micro-batches of
    ``micro_batch_size(dp)``."""
    batch = global_batch(step, device)
    per_rank, micro = GLOBAL_BATCH // dp, micro_batch_size(dp)
    for start in range(dp_rank * per_rank, (dp_rank + 1) * per_rank, micro):
        part = {k: v[start : start + micro] for k, v in batch.items()}
        yield {k: cp_slice(v, cp, cp_rank) for k, v in part.items()}


# Packed sequences: each sample of SEQ tokens holds these documents as (real, padded) lengths.
# Padded lengths are multiples of 2 x CP 2, as upstream's SFT data pads them for CP; the
# padding rows are inputs no real token attends to and carry no loss.
PACKED_DOCUMENTS = ((37, 40), (50, 52), (17, 20), (16, 16))


def packed_microbatches(
    step: int, device: Any, *, dp: int, dp_rank: int, cp: int, cp_rank: int
) -> Iterator[dict[str, Any]]:
    """Like ``microbatches``, with each micro-batch packed (THD): its samples flattened into
    one row of documents (``cu_seqlens`` real, ``cu_seqlens_padded`` storage, positions
    restarting per document, ``loss_mask`` 0 on padding) and split for context parallelism
    per document (TE's ``thd_get_partitioned_indices``, what upstream's packed data path
    calls)."""
    from megatron_rocm.runtime.backend.packed.thd_partition import thd_get_partitioned_indices

    if micro_batch_size(dp) != MICRO_BATCH:  # each row packs MICRO_BATCH samples
        raise ValueError(
            f"packed batches need {MICRO_BATCH} samples per DP rank; DP {dp} leaves fewer"
        )
    real, padded, positions, mask = [0], [0], [], []
    for length, room in PACKED_DOCUMENTS * MICRO_BATCH:
        real.append(real[-1] + length)
        padded.append(padded[-1] + room)
        positions += range(room)
        mask += [1.0] * length + [0.0] * (room - length)
    cu = torch.tensor(real, dtype=torch.int32)
    cu_padded = torch.tensor(padded, dtype=torch.int32)
    total = int(cu_padded[-1])
    if total != MICRO_BATCH * SEQ:
        raise AssertionError(f"PACKED_DOCUMENTS fill {total} rows, not {MICRO_BATCH * SEQ}")
    index = thd_get_partitioned_indices(cu_padded, total, cp, cp_rank).long()
    extra = {
        "position_ids": torch.tensor(positions).unsqueeze(0),
        "loss_mask": torch.tensor(mask).unsqueeze(0),
    }
    layout = {
        "loss_tokens": float(sum(mask)),  # the whole micro-batch's, on every CP rank
        "cu_seqlens": cu.to(device),
        "cu_seqlens_padded": cu_padded.to(device),
        "max_seqlen": max(room for _, room in PACKED_DOCUMENTS),
    }
    for part in microbatches(step, "cpu", dp=dp, dp_rank=dp_rank, cp=1, cp_rank=0):
        flat = {k: part[k].reshape(1, -1) for k in ("tokens", "labels")}
        flat.update(extra)
        batch: dict[str, Any] = {k: v.index_select(1, index).to(device) for k, v in flat.items()}
        yield {**batch, **layout}


def packed_seq_params(batch: dict[str, Any]) -> Any:
    """upstream's ``PackedSeqParams`` for a ``packed_microbatches`` batch."""
    from megatron.core.packed_seq_params import PackedSeqParams

    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=batch["cu_seqlens"],
        cu_seqlens_kv=batch["cu_seqlens"],
        cu_seqlens_q_padded=batch["cu_seqlens_padded"],
        cu_seqlens_kv_padded=batch["cu_seqlens_padded"],
        max_seqlen_q=batch["max_seqlen"],
        max_seqlen_kv=batch["max_seqlen"],
    )


def causal_mask(seq: int, device: Any) -> torch.Tensor:
    """Megatron's boolean mask, True = masked."""
    return torch.ones(1, 1, seq, seq, device=device).tril() < 0.5
