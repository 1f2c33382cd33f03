"""Run inside a megatron-core tree (on ``sys.path``) under TRITON_INTERPRET=1; print one JSON line.

Upstream's fused MLA query RoPE (``fused_apply_mla_rope_for_q``, forward and backward) on 12
heads, once with the autotuner held to ``BLOCK_H=16`` (one block covers every head, so the
mask is right with or without the ``mla-rope-mask`` patch) and once to ``BLOCK_H=8`` (the
second block holds heads 8..15 of 12). The query lives inside a larger buffer with guard
cells after it, so heads written past the tensor show up as changed guards instead of a crash.
"""

from __future__ import annotations

import json
import os

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

S, B, HEADS, NOPE, EMB = 3, 2, 12, 16, 8
GUARD = 4096


def run(block_h: int) -> dict:
    from megatron.core import config
    from megatron.core.fusions import fused_mla_yarn_rope_apply as fused

    config.ENABLE_EXPERIMENTAL = True  # 0.13-0.15 gate the fused MLA RoPE behind it
    for name in dir(fused):  # hold every autotuned kernel of the module to one BLOCK_H
        kernel = getattr(fused, name)
        if hasattr(kernel, "configs") and hasattr(kernel, "fn"):
            if not hasattr(kernel, "all_configs"):
                kernel.all_configs = list(kernel.configs)
            kernel.configs = [c for c in kernel.all_configs if c.kwargs.get("BLOCK_H") == block_h]
    gen = torch.Generator().manual_seed(0)
    numel = S * B * HEADS * (NOPE + EMB)
    buffer = torch.zeros(numel + GUARD)
    buffer[:numel] = torch.randn(numel, generator=gen)
    q = buffer[:numel].view(S, B, HEADS, NOPE + EMB)  # rotated in place, guards after it
    leaf = q.clone().requires_grad_()
    angles = torch.randn(S, 1, 1, EMB, generator=gen)
    cos, sin = angles.cos(), angles.sin()
    out = fused.fused_apply_mla_rope_for_q(q, cos, sin, NOPE, EMB)
    guard_forward = buffer[numel:].abs().max().item()
    grad_out = torch.randn(S, B, HEADS, NOPE + EMB, generator=gen)
    # backward through the same kernel family, on a fresh copy with autograd
    q2 = leaf.clone()
    out2 = fused.fused_apply_mla_rope_for_q(q2, cos, sin, NOPE, EMB)
    out2.backward(grad_out)
    return {
        "out": out.detach().flatten().tolist(),
        "grad": leaf.grad.flatten().tolist(),
        "guard_changed": guard_forward != 0.0,
    }


def main() -> None:
    wide, narrow = run(16), run(8)
    print(
        json.dumps(
            {
                "out_diff": max(abs(a - b) for a, b in zip(wide["out"], narrow["out"])),
                "grad_diff": max(abs(a - b) for a, b in zip(wide["grad"], narrow["grad"])),
                "guard_changed": narrow["guard_changed"] or wide["guard_changed"],
            }
        )
    )


if __name__ == "__main__":
    main()
