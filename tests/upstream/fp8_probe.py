"""Upstream's TE-spec transformer block under ``--fp8-format`` without TE (CPU).

    python fp8_probe.py --tree PATCHED_TREE --out RESULT.json

One gloo rank. Builds upstream's ``TransformerBlock`` from the TE layer spec (the native
backend's linears) four times from one seed: with ``fp8="hybrid", fp8_recipe="tensorwise"``
and ``first_last_layers_bf16`` (one layer kept in bf16 at each end); with upstream's default
recipe, ``delayed``, at the 8B example's ``--fp8-amax-history-len 1024
--fp8-amax-compute-algo max``; with ``blockwise`` (core 0.13 and later, whose choices have it);
and in bf16. Each block takes two steps, the second on a batch
half the first's size (the delayed block scales it by the first's amaxes). Records which
linears got an FP8 recipe, how many GEMMs ran through the FP8 function, where the delayed
histories stand, and the blocks' outputs and gradients of the second step for the test to
compare.

Then each FP8 block built with ``fp8_param`` (``--fp8-param-gather``) against the same block
without it, one step each (``param_gather``). Then the FP8 weight's reuse across micro-batches under upstream's own schedule
(``get_forward_backward_func``): two iterations of two micro-batches each with an SGD step in
between, every layer in FP8, with the reuse and with ``disable_parameter_transpose_cache``;
records the losses, how many forwards reused the weight, and the delayed weight histories.
"""

from __future__ import annotations

import argparse
import os
import sys

import probe_cli  # beside this script (sys.path[0])

SEQ, BATCH, HIDDEN, HEADS, LAYERS = 16, 2, 64, 4, 4


RECIPES = {
    "fp8": dict(fp8="hybrid", fp8_recipe="tensorwise", first_last_layers_bf16=True,
                num_layers_at_start_in_bf16=1, num_layers_at_end_in_bf16=1),
    "delayed": dict(fp8="hybrid", fp8_recipe="delayed", fp8_amax_history_len=1024,
                    fp8_amax_compute_algo="max"),
    "blockwise": dict(fp8="hybrid", fp8_recipe="blockwise"),  # core 0.13 and later
    "bf16": {},
}  # fmt: skip
SCHEDULED = {
    "tensorwise": dict(fp8="hybrid", fp8_recipe="tensorwise"),
    "delayed": RECIPES["delayed"],
}


def build(kind: str, **overrides):  # noqa: ANN003, ANN201 - the block
    import torch
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.transformer.transformer_block import TransformerBlock

    config = probe_cli.small_block_config(
        LAYERS, HIDDEN, HEADS, **{**RECIPES.get(kind, {}), **overrides}
    )
    torch.manual_seed(1234)
    block = TransformerBlock(config, get_gpt_layer_with_transformer_engine_spec())
    return block


def run(args: argparse.Namespace) -> dict:
    probe_cli.one_rank_world(args)  # the schedule allocates on "cuda": cpu_shim
    import torch

    from megatron_rocm.runtime.backend import fp8 as backend_fp8

    calls = {"n": 0}
    reused: list[bool] = []  # per FP8 forward: did it take the step's first FP8 weight
    forward = backend_fp8.Fp8LinearFunction.forward

    def counted(ctx, *a):  # noqa: ANN001, ANN002, ANN202
        calls["n"] += 1
        reused.append(len(a) > 5 and a[5] is True)
        return forward(ctx, *a)

    backend_fp8.Fp8LinearFunction.forward = staticmethod(counted)
    from megatron.core import package_info

    has_blockwise = probe_cli.count_blockwise_forwards(calls)
    hidden = torch.randn(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(7))
    mask = torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool).triu(1)
    # a fixed random direction: |out|^2 is constant under the final RMSNorm (a zero gradient)
    direction = torch.randn(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(8))
    result: dict = {"version": [int(package_info.MAJOR), int(package_info.MINOR)]}
    for name in RECIPES:
        if name == "blockwise" and not has_blockwise:  # upstream's choices lack it before 0.13
            result[name] = None
            continue
        blockwise_before = calls.get("blockwise", 0)
        block = build(name)
        linears = {
            mod_name: mod
            for mod_name, mod in block.named_modules()
            if mod_name.count(".") == 3 and "linear" in mod_name.rsplit(".", 1)[-1]
        }
        before = calls["n"]
        for scale in (1.0, 0.5):  # two steps, no optimizer: the weights stay
            block.set_is_first_microbatch()  # each a step's first micro-batch, as the schedules
            block.zero_grad(set_to_none=True)
            x = (hidden * scale).to(torch.bfloat16).requires_grad_()
            out = block(x, mask)
            out = out[0] if isinstance(out, tuple) else out
            (out.float() * direction).sum().backward()
        result[name] = {
            "recipes": {n: getattr(m, "fp8_recipe", "absent") is not None
                        for n, m in linears.items()},
            "history_positions": {
                n: [int(h.pos.item()) for h in vars(m.fp8_recipe.delayed).values()]
                for n, m in linears.items()
                if getattr(m, "fp8_recipe", None) is not None and m.fp8_recipe.delayed
            },
            "fp8_gemms": calls["n"] - before,
            "blockwise_gemms": calls.get("blockwise", 0) - blockwise_before,
            "blockwise_recipes": sum(bool(getattr(getattr(m, "fp8_recipe", None), "blockwise",
                                                  False)) for m in linears.values()),
            "out": out.detach().float().tolist(),
            "dx": x.grad.float().tolist(),
            "fc1_grad": block.layers[1].mlp.linear_fc1.weight.grad.float().tolist(),
        }  # fmt: skip
    for name in ("fp8", "delayed"):
        result[f"{name}-param-gather"] = param_gather(name, hidden, mask, direction)
    for recipe, flags in SCHEDULED.items():
        for cache in (True, False):
            result[f"scheduled-{recipe}-{'reuse' if cache else 'no-reuse'}"] = scheduled(
                build("", **flags, disable_parameter_transpose_cache=not cache),
                hidden, mask, direction, reused,
            )  # fmt: skip
    torch.distributed.destroy_process_group()
    return result


def param_gather(name: str, hidden, mask, direction) -> dict:  # noqa: ANN001
    """The block built with ``fp8_param`` (``--fp8-param-gather``) against the one without, a
    step each from the same seed: which weights upstream's ``fp8_utils.is_float8tensor``
    (bound to the native FP8 weight by the patch) reports, and whether output, input gradient
    and every weight gradient are the same bits (the stored bytes are the weight's quantize)."""
    import torch
    from megatron.core import fp8_utils

    steps = []
    for fp8_param in (False, True):
        block = build(name, fp8_param=fp8_param)
        block.set_is_first_microbatch()
        x = hidden.to(torch.bfloat16).requires_grad_()
        out = block(x, mask)
        out = out[0] if isinstance(out, tuple) else out
        (out.float() * direction).sum().backward()
        grads = {n: p.grad for n, p in block.named_parameters()}
        steps.append((block, out.detach(), x.grad, grads))
    (_, out, dx, grads), (pg_block, pg_out, pg_dx, pg_grads) = steps
    return {
        "float8": {n: fp8_utils.is_float8tensor(p) for n, p in pg_block.named_parameters()},
        "same_out": torch.equal(out, pg_out),
        "same_dx": torch.equal(dx, pg_dx),
        "same_grads": all(torch.equal(grads[n], pg_grads[n]) for n in grads),
    }


def scheduled(block, hidden, mask, direction, reused: list) -> dict:  # noqa: ANN001
    """Two iterations of upstream's schedule, two micro-batches each, an SGD step between."""
    import torch
    from megatron.core.enums import ModelType
    from megatron.core.pipeline_parallel import get_forward_backward_func

    block.model_type = ModelType.encoder_or_decoder  # what the schedule asks of a model

    def forward_step(data_iterator, model):  # noqa: ANN001, ANN202
        out = model(next(data_iterator).to(torch.bfloat16).requires_grad_(), mask)
        out = out[0] if isinstance(out, tuple) else out

        def loss_func(output):  # noqa: ANN001, ANN202
            loss = (output.float() * direction).sum()
            return loss, {"loss": loss.detach()}

        return out, loss_func

    before, losses = len(reused), []
    for iteration in range(2):
        batches = iter([hidden * (1 + iteration), hidden * (0.5 + iteration)])
        for got in get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=batches, model=block,
            num_microbatches=2, seq_length=SEQ, micro_batch_size=BATCH, forward_only=False,
        ):  # fmt: skip
            losses.append(float(got["loss"]))
        with torch.no_grad():  # the optimizer's step: the weights change in place
            for param in block.parameters():
                param -= 0.005 * param.grad
                param.grad = None
    weights = [m.fp8_recipe.delayed.weight.pos.item() for m in block.modules()
               if getattr(m, "fp8_recipe", None) is not None and m.fp8_recipe.delayed]  # fmt: skip
    return {"losses": losses, "reused": sum(reused[before:]), "weight_positions": weights}


if __name__ == "__main__":
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    sys.exit(probe_cli.main(run))
