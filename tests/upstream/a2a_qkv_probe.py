"""Upstream's GPT with the TE spec under a2a context parallelism, QKV projection on and off (CPU).

    python a2a_qkv_probe.py --tree PATCHED_TREE --out RESULT.json [--qk-layernorm]

Launches a gloo world of two ranks (CP=2, ``--cp-comm-type a2a``), each running this file on
the patched tree: upstream's ``GPTModel`` built through ``get_gpt_layer_with_transformer_engine_
spec()`` (the native backend, TE being absent), forward and backward on the rank's zigzag shard
of one batch, twice from the same seed: with ``MEGATRON_ROCM_CP_A2A_QKV=1`` (the
``a2a-qkv-projection`` hunk hands the projection to ``cp.a2a_qkv``) and ``=0`` (upstream's
path). Each rank writes its losses, logits and gradients of both runs side by side, how often
the projected path ran in each, and what ``a2a_projection`` logged.
"""

from __future__ import annotations

import argparse
import os

SEQ, BATCH, VOCAB, CP = 16, 2, 96, 2


def shard(x, dim: int, rank: int):  # noqa: ANN001, ANN201
    """Upstream's CP split along ``dim``: chunks ``rank`` and ``2cp-1-rank``."""
    import torch

    chunks = x.chunk(2 * CP, dim=dim)
    return torch.cat([chunks[rank], chunks[2 * CP - 1 - rank]], dim=dim)


def defer_parameters(model) -> None:  # noqa: ANN001
    """Each module's own parameters hold zeros until its forward pre-hook puts them back, as
    Megatron's DDP with ``--overlap-param-gather`` waits for a module's all-gather only in
    that module's pre-hook: a path that reads a module's weight without calling the module
    reads zeros here (on a GPU: a stale or half-gathered weight)."""
    import torch

    for module in model.modules():
        params = list(module.parameters(recurse=False))
        if not params:
            continue
        saved = [p.detach().clone() for p in params]
        with torch.no_grad():
            for p in params:
                p.zero_()

        def gather(_module, _args, params=params, saved=saved) -> None:  # noqa: ANN001
            with torch.no_grad():
                for p, value in zip(params, saved):
                    p.copy_(value)

        module.register_forward_pre_hook(gather)


def run_rank(args: argparse.Namespace) -> dict:
    from gloo_ranks import join_rank_world  # beside this script, on sys.path when it runs

    rank = join_rank_world(args.tree, CP)  # cpu_shim: upstream's CUDA allocations on the CPU
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_with_transformer_engine_spec,
    )
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_rocm.runtime.backend.cp import a2a_projection
    from megatron_rocm.runtime.backend.cp import a2a_qkv as _cp_a2a_qkv
    from megatron_rocm.runtime.kernels import launch as _runtime

    parallel_state.initialize_model_parallel(context_parallel_size=CP)
    projected, logged = [], []
    forward = _cp_a2a_qkv.ProjectedUlyssesAttention.forward
    _cp_a2a_qkv.ProjectedUlyssesAttention.forward = staticmethod(
        lambda *a, **k: projected.append(1) or forward(*a, **k)
    )
    log_once = a2a_projection.log_fallback_once
    a2a_projection.log_fallback_once = lambda key, msg: logged.append(msg) or log_once(key, msg)
    _runtime._logged.clear()
    config = TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=4,
        ffn_hidden_size=96, normalization="RMSNorm", gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False,
        add_qkv_bias=args.qkv_bias, qk_layernorm=args.qk_layernorm,
        context_parallel_size=CP, cp_comm_type="a2a", use_cpu_initialization=True,
        hidden_dropout=0.0, attention_dropout=0.0, gradient_accumulation_fusion=False,
        bias_dropout_fusion=False, masked_softmax_fusion=False, bias_activation_fusion=False,
        apply_rope_fusion=args.rope_fusion,
    )  # fmt: skip
    spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=args.qk_layernorm)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(7))
    positions = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
    local_tokens, local_positions = shard(tokens, 1, rank), shard(positions, 1, rank)
    runs = {}
    for setting in ("1", "0"):
        os.environ[a2a_projection.QKV_ENV] = setting
        before = len(projected)
        torch.manual_seed(1234)
        model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB,
                         max_sequence_length=SEQ, position_embedding_type="rope")  # fmt: skip
        if args.deferred_parameters:
            defer_parameters(model)
        logits = model(local_tokens, local_positions, None)
        loss = logits.float().logsumexp(-1).mean()
        loss.backward()
        runs[setting] = {
            "loss": loss.item(),
            "logits": logits.detach().float().flatten().tolist(),
            "grads": {
                n: p.grad.float().flatten().tolist()
                for n, p in model.named_parameters()
                if p.grad is not None
            },  # fmt: skip
            "projected_calls": len(projected) - before,
        }
    dist.barrier()
    dist.destroy_process_group()
    return {"on": runs["1"], "off": runs["0"], "logged": logged}


def main() -> int:
    from gloo_ranks import rank_main  # beside this script, on sys.path when it runs

    ap = argparse.ArgumentParser()
    ap.add_argument("--tree", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--qk-layernorm", action="store_true")
    ap.add_argument("--qkv-bias", action="store_true")
    ap.add_argument("--rope-fusion", action="store_true")
    ap.add_argument("--deferred-parameters", action="store_true", help="see defer_parameters")
    ap.add_argument("--timeout", type=float, default=300)
    return rank_main(__file__, run_rank, CP, ap)


if __name__ == "__main__":
    raise SystemExit(main())
