"""Training checks on one GPU: a small GPT and a small Llama-style GPTModel from the patched
tree, each through the local layer spec and through upstream's default TE spec, trained a few
steps the way ``pretrain_gpt.py`` does (``engine``: Megatron DDP, ``get_megatron_optimizer``,
the pipeline schedule), with the fusion flags it turns on by default (``models``).

Each run happens once per smoke run (:func:`reference` keeps it in the context).
"""

from __future__ import annotations

import contextlib
import io
import logging
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from megatron_rocm.envtools.smoke import models, verdicts
from megatron_rocm.envtools.smoke.runner import CheckFailed, Context, Skip, register
from megatron_rocm.envtools.smoke.world import free_port


@contextlib.contextmanager
def one_rank_world(backend: str) -> Iterator[None]:
    """A one-process torch.distributed world; Megatron's parallel state is torn down after."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    owns = not dist.is_initialized()
    if owns:
        dist.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
        )
    try:
        yield
    finally:
        if parallel_state.model_parallel_is_initialized():
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


@dataclass
class Reference:
    """A finished 1-GPU run: its losses and speed."""

    losses: list[float]
    params: int
    tokens_per_s: float
    optimizer: str


def run_single(
    ctx: Context,
    model: str,
    spec: str,
    steps: int,
    *,
    backend: str = "nccl",
    device: torch.device | None = None,
    overrides: dict | None = None,
) -> Reference:
    """Train ``model`` through ``spec`` on this process's GPU. ``backend``, ``device`` and
    config ``overrides`` exist for our CPU tests."""
    from megatron_rocm.envtools.smoke.engine import Job, Trainer, set_parallel_state

    device = device or torch.device("cuda", torch.cuda.current_device())
    job = Job(
        f"training.{model}.{spec}", model=model, spec=spec, steps=steps, overrides=overrides or {}
    )
    with warnings.catch_warnings(), quiet_megatron(), one_rank_world(backend):
        warnings.simplefilter("ignore")
        set_parallel_state(job.layout)
        trainer = Trainer(job, device)
        losses, t0 = [], 0.0
        for i in range(steps):
            if i == 2:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
            losses.append(trainer.train_step(i))
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
    opt = getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer])[0]
    return Reference(
        losses=losses,
        params=trainer.params,
        tokens_per_s=models.GLOBAL_BATCH * models.SEQ * (steps - 2) / seconds,
        optimizer=f"{type(opt).__name__}({type(getattr(opt, 'optimizer', opt)).__name__})",
    )


def reference(ctx: Context, model: str, spec: str) -> Reference:
    """The 1-GPU run of (model, spec), once per smoke run (its failure too)."""
    key = ("reference", model, spec)
    if key not in ctx.cache:
        try:
            ctx.cache[key] = run_single(ctx, model, spec, max(ctx.steps, 10))
        except Exception as e:  # noqa: BLE001 - kept and re-raised by each user
            ctx.cache[key] = e
    found = ctx.cache[key]
    if isinstance(found, BaseException):
        raise found
    return found


def train(ctx: Context, model: str, spec: str) -> str:
    ctx.needs_tree()
    if not ctx.on_gpu:
        raise Skip("Megatron's model code calls torch.cuda (RNG tracker, RoPE); needs a GPU")
    try:
        ref = reference(ctx, model, spec)
    except models.TESpecUnavailable as e:
        raise CheckFailed(str(e)) from None
    try:
        learned = verdicts.learns(ref.losses)
    except verdicts.Verdict as e:
        raise CheckFailed(f"{e} ({ref.optimizer})") from None
    return (
        f"{ref.params / 1e6:.1f}M params, {learned}, {ref.tokens_per_s:,.0f} tokens/s, "
        f"{ref.optimizer}"
    )


def _register(model: str, spec: str, doc: str) -> None:
    def check(ctx: Context) -> str:
        return train(ctx, model, spec)

    check.__doc__ = doc
    register(f"training.{model}.{spec}")(check)


_SPEC_TEXT = {"local": "the local spec", "te": "upstream's TE spec (native backend)"}
for _spec in models.SPECS:
    _register("gpt", _spec, f"GPT (LayerNorm, GeLU, learned positions), {_SPEC_TEXT[_spec]}.")
for _spec in models.SPECS:
    _register("llama", _spec, f"Llama (RMSNorm, SwiGLU, fused RoPE, GQA), {_SPEC_TEXT[_spec]}.")
