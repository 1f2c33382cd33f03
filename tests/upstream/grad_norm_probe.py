"""Upstream's gradient clipping without TE: is the norm kept on the device (CPU probe)?

    python grad_norm_probe.py --tree PATCHED_TREE --out RESULT.json

From 0.17 upstream's ``clip_grads`` keeps the gradient norm and the clip coefficient on the
device when ``multi_tensor_scale_tensor`` exists (TE's path): no host sync before the optimizer
step, and ``--optimizer-cuda-graph`` can capture the step. Without TE the name was None, so
``get_grad_norm_fp32`` read the norm back to the host (``.item()``) every step. The probe calls
upstream's own functions on fp32 gradients, as the optimizer does, and records what the norm
is (a tensor or a Python float), its value and the clipped gradients next to a float64
computation written out here, once where clipping scales and once where it must not.
"""

from __future__ import annotations

import argparse

import probe_cli  # beside this script (sys.path[0])


def run(args: argparse.Namespace) -> dict:
    probe_cli.one_rank_world(args)
    import torch
    from megatron.core.optimizer import clip_grads

    out: dict = {"device_path": clip_grads.multi_tensor_scale_tensor_impl is not None}
    for case, max_norm in (("clips", 1.0), ("keeps", 1e6)):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.zeros(n)) for n in (7, 300, 4096)]
        for p in params:
            p.grad = torch.randn_like(p) * 3.0
        want_grads = [p.grad.double().clone() for p in params]
        want_norm = torch.cat([g.reshape(-1) for g in want_grads]).norm().item()
        norm = clip_grads.get_grad_norm_fp32([p.grad for p in params])
        clip_grads.clip_grad_by_total_norm_fp32(params, max_norm, norm)
        coeff = min(1.0, max_norm / (want_norm + 1e-6))
        out[case] = {
            "norm_type": type(norm).__name__,
            "norm_error": abs(float(norm) - want_norm) / want_norm,
            "grad_error": max(
                float((p.grad.double() - g * coeff).abs().max()) for p, g in zip(params, want_grads)
            ),
            "coeff": coeff,
        }
    return out


if __name__ == "__main__":
    raise SystemExit(probe_cli.main(run))
