"""Training checks: build a small GPT and a small Llama-style GPTModel from the patched tree,
with the fusion flags ``pretrain_gpt.py`` turns on by default, and train a few steps.

The flags matter: TransformerConfig's own defaults switch every fusion off, so a model built
with them never reaches the code the patches change. ``pretrain_gpt`` defaults switch them on
(masked softmax, bias-activation, bias-dropout, persistent LayerNorm, gradient-accumulation
fusion, RoPE fusion), which is what fails on an unpatched tree without Apex/TE.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import math
import socket
import time
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from megatron_rocm.envtools.smoke.runner import CheckFailed, Context, Skip, register

SEQ, BATCH, VOCAB = 128, 4, 1024
LR = 1e-3  # AdamW on 2 fixed batches of random tokens: loss ~7.0 -> ~1 in 30 steps (fp32, CPU)
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def megatron_parallel(backend: str) -> Iterator[None]:
    """A one-process world plus Megatron's parallel state, torn down afterwards."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    owns = not dist.is_initialized()
    if owns:
        dist.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
        )
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1234)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        if owns:
            dist.destroy_process_group()


@contextlib.contextmanager
def quiet_megatron() -> Iterator[None]:
    """Hide Megatron's chatter while a check trains: it logs whole DDP/optimizer configs at INFO,
    prints the gradient-bucket layout and warns that GPTModel is deprecated, hundreds of lines
    that bury the smoke report. Errors still raise and fail the check."""
    log = logging.getLogger("megatron")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        log.setLevel(level)


def build_config(ctx: Context, shape: dict[str, Any]) -> Any:
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    kwargs: dict[str, Any] = {k: v for k, v in {**FUSIONS, **shape}.items() if k in fields}
    kwargs.update(hidden_dropout=0.0, attention_dropout=0.0)
    if ctx.on_gpu:
        kwargs.update(bf16=True, params_dtype=torch.bfloat16)
    else:  # only reached by our CPU experiments: train() skips on CPU
        kwargs.update(use_cpu_initialization=True)
    return TransformerConfig(**kwargs)


def build_model(ctx: Context, shape: dict[str, Any]) -> Any:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    config = build_config(ctx, shape)
    spec = get_gpt_layer_local_spec(normalization=config.normalization)
    rope = shape.get("normalization") == "RMSNorm"
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        position_embedding_type="rope" if rope else "learned_absolute",
    )
    model = model.to(ctx.device)
    if config.bf16:  # as megatron.training.get_model does: bf16 compute, fp32 logits out
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(config, model)
    return model


def make_optimizer(ctx: Context, model: Any) -> tuple[Any, Any, str]:
    """Megatron's DDP + get_megatron_optimizer (what pretrain_gpt uses); FusedAdam otherwise."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = model.config
    ddp = DistributedDataParallel(
        config,
        DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False
        ),
        model,
    )
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=LR,
        weight_decay=0.01,
        adam_beta1=0.9,
        adam_beta2=0.95,
        bf16=ctx.on_gpu,
        clip_grad=1.0,
        params_dtype=config.params_dtype,
    )
    try:
        opt = get_megatron_optimizer(opt_config, [ddp])
        return ddp, opt, f"megatron {type(opt).__name__}"
    except Exception as e:  # noqa: BLE001 - reported in the check's detail, never hidden
        from megatron_rocm.runtime.kernels.optimizer import FusedAdam

        params = [p for p in ddp.parameters() if p.requires_grad]
        opt = FusedAdam(params, lr=LR, betas=(0.9, 0.95), weight_decay=0.01)
        return ddp, opt, f"FusedAdam (get_megatron_optimizer failed: {type(e).__name__}: {e})"


def _step(ddp: Any, opt: Any, megatron_opt: bool, batch: tuple[torch.Tensor, ...]) -> float:
    ids, pos, mask, labels = batch
    ddp.zero_grad_buffer()
    opt.zero_grad()
    loss = ddp(ids, pos, mask, labels=labels).float().mean()
    loss.backward()
    ddp.finish_grad_sync()
    if megatron_opt:
        result = opt.step()  # (update_successful, grad_norm, num_zeros) in 0.12 ... main
        if not (result[0] if isinstance(result, tuple) else result):
            raise CheckFailed("megatron optimizer skipped a step (overflow)")
    else:
        for p in ddp.parameters():
            if getattr(p, "main_grad", None) is not None:
                p.grad = p.main_grad.to(p.dtype)
        opt.step()
    return loss.item()


def _batches(ctx: Context) -> list[tuple[torch.Tensor, ...]]:
    """Two fixed random batches, repeated: a working model must memorise them."""
    g = torch.Generator().manual_seed(0)
    pos = torch.arange(SEQ, device=ctx.device).unsqueeze(0).expand(BATCH, -1)
    mask = torch.ones(1, 1, SEQ, SEQ, device=ctx.device).tril() < 0.5  # True = masked
    out = []
    for _ in range(2):
        tok = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g).to(ctx.device)
        out.append((tok[:, :-1], pos, mask, tok[:, 1:]))
    return out


def train(ctx: Context, shape: dict[str, Any]) -> str:
    ctx.needs_tree()
    if not ctx.on_gpu:
        raise Skip("Megatron's model code calls torch.cuda (RNG tracker, RoPE); needs a GPU")
    torch.manual_seed(0)
    with warnings.catch_warnings(), quiet_megatron(), megatron_parallel("nccl"):
        warnings.simplefilter("ignore")
        model = build_model(ctx, shape)
        ddp, opt, opt_name = make_optimizer(ctx, model)
        batches = _batches(ctx)
        losses, t0 = [], 0.0
        for i in range(ctx.steps):
            if i == 2:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
            losses.append(_step(ddp, opt, opt_name.startswith("megatron"), batches[i % 2]))
        torch.cuda.synchronize()
        tok_s = BATCH * SEQ * (ctx.steps - 2) / (time.perf_counter() - t0)
    if not all(math.isfinite(x) for x in losses):
        raise CheckFailed(f"non-finite loss: {losses}")
    first, last = sum(losses[:2]) / 2, sum(losses[-2:]) / 2
    if not last < 0.95 * first:
        raise CheckFailed(
            f"loss did not decrease: {first:.3f} -> {last:.3f} over {ctx.steps} steps ({opt_name})"
        )
    params = sum(p.numel() for p in model.parameters())
    return (
        f"{params / 1e6:.1f}M params, loss {first:.3f} -> {last:.3f} in {ctx.steps} steps, "
        f"{tok_s:,.0f} tokens/s, {opt_name}"
    )


@register("training.gpt")
def gpt(ctx: Context) -> str:
    """GPT (LayerNorm, GeLU, learned positions) with pretrain_gpt's fusions on."""
    return train(ctx, GPT)


@register("training.llama")
def llama(ctx: Context) -> str:
    """Llama-style GPTModel: RMSNorm, SwiGLU, RoPE (fused), GQA, no biases."""
    return train(ctx, LLAMA)
