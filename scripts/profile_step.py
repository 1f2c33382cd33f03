"""Where a training step of a patched tree spends its GPU time: one process, several configs.

    python scripts/profile_step.py TREE [--layers 4] [--configs default,te,unfused,...]

Builds the 0.85B Llama-style shape (hidden 1536, FFN 5504, 12 heads, 4 KV groups, seq 2048,
micro-batch 2) with fewer layers from TREE (a patched Megatron checkout), runs forward +
backward with the fusion flags of each config, and prints step time and the top CUDA kernels.
This finds which replaced path costs what without a full ``pretrain_gpt`` launch per variant.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time

import torch
import torch.nn.functional as F

CONFIGS = {
    # name: (layer spec, fusion flags on?, SDPA on?, extra environment)
    "default": ("local", True, True, {}),
    "no-sdpa": ("local", True, False, {}),
    "unfused": ("local", False, False, {}),
    "unfused+sdpa": ("local", False, True, {}),
    # the TE spec on the native backend, SDPA's own kernel choice / cuDNN attention first
    "te": ("te", True, True, {}),
    "te-cudnn": ("te", True, True, {"MEGATRON_ROCM_SDPA_BACKENDS": "cudnn,flash,efficient"}),
    "te-flash": ("te", True, True, {"MEGATRON_ROCM_SDPA_BACKENDS": "flash,efficient"}),
}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build(tree: str, layers: int, fused: bool, seq: int, spec: str = "local"):
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(
        num_layers=layers,
        hidden_size=1536,
        ffn_hidden_size=5504,
        num_attention_heads=12,
        num_query_groups=4,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        bf16=True,
        params_dtype=torch.bfloat16,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        masked_softmax_fusion=fused,
        bias_activation_fusion=fused,
        bias_dropout_fusion=fused,
        apply_rope_fusion=fused,
        gradient_accumulation_fusion=fused,
        persist_layer_norm=fused,
    )
    model = GPTModel(
        cfg,
        get_gpt_layer_local_spec()
        if spec == "local"
        else get_gpt_layer_with_transformer_engine_spec(),
        vocab_size=32000,
        max_sequence_length=seq,
        position_embedding_type="rope",
    ).cuda()
    for p in model.parameters():
        p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
    return model


def step(model, tokens, labels, mask) -> None:
    loss = model(tokens, None, mask, labels=labels).float().mean()
    loss.backward()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("tree")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--mbs", type=int, default=2)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument(
        "--ops", action="store_true", help="group by aten op and input shape, not by kernel"
    )
    args = ap.parse_args()
    sys.path.insert(0, args.tree)
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{_port()}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1)
    tokens = torch.randint(0, 32000, (args.mbs, args.seq), device="cuda")
    labels = torch.randint(0, 32000, (args.mbs, args.seq), device="cuda")
    mask = torch.triu(torch.ones(args.seq, args.seq, dtype=torch.bool, device="cuda"), 1)
    mask = mask.view(1, 1, args.seq, args.seq)
    rows = []
    for name in args.configs.split(","):
        spec, fused, sdpa, env = CONFIGS[name]
        os.environ["MEGATRON_ROCM_LOCAL_SDPA"] = "1" if sdpa else "0"
        os.environ.pop("MEGATRON_ROCM_SDPA_BACKENDS", None)
        os.environ.update(env)
        model = build(args.tree, args.layers, fused, args.seq, spec)
        for _ in range(3):
            step(model, tokens, labels, mask)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        n = 5
        for _ in range(n):
            step(model, tokens, labels, mask)
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) / n * 1e3
        rows.append((name, ms))
        activities = [torch.profiler.ProfilerActivity.CUDA]
        if args.ops:  # aten ops with the GPU time of their kernels: says *which* op is slow
            activities.append(torch.profiler.ProfilerActivity.CPU)
        with torch.profiler.profile(activities=activities, record_shapes=args.ops) as prof:
            step(model, tokens, labels, mask)
            torch.cuda.synchronize()
        print(f"\n=== {name}: {ms:.1f} ms per fwd+bwd ({args.layers} layers)")
        print(
            prof.key_averages(group_by_input_shape=args.ops).table(
                sort_by="self_cuda_time_total" if args.ops else "cuda_time_total",
                row_limit=args.top,
                max_name_column_width=70,
                max_shapes_column_width=60,
            )
        )
        del model
        torch.cuda.empty_cache()
    print("\n| config | ms per fwd+bwd |\n|---|---|")
    for name, ms in rows:
        print(f"| {name} | {ms:.1f} |")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
