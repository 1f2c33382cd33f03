"""One short training run of a ``models`` GPT, the way ``pretrain_gpt.py`` wires it.

A :class:`Job` names the model, the layer spec, the parallel layout and the wrapper (Megatron
DDP with or without the distributed optimizer and overlap, torch FSDP2, Megatron-FSDP).
:func:`run_job` sets Megatron's parallel state for it, builds the model (from given weights
when the job compares with a 1-GPU run), wraps it, builds ``get_megatron_optimizer`` and
trains through ``get_forward_backward_func`` (the pipeline schedules: micro-batches, PP,
loss scaling, ``finalize_model_grads``), like ``megatron.training.train_step``. It can save a
``torch_dist`` checkpoint mid-run and start from one (the resume check).

Runs in any initialised torch.distributed world; the world size must equal the layout's
model-parallel sizes times the data-parallel size. Used in-process by the 1-GPU training
checks and by ``_train_worker`` for multi-GPU and fresh-process runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch

from megatron_rocm.envtools.smoke import models
from megatron_rocm.envtools.smoke.models import Layout


@dataclasses.dataclass(frozen=True)
class Job:
    name: str
    model: str = "llama"
    spec: str = "local"
    layout: Layout = Layout()
    dist_opt: bool = False
    overlap: bool = False  # overlap_grad_reduce + overlap_param_gather (distributed optimizer)
    fsdp: str = ""  # "" | "torch_fsdp2" | "megatron_fsdp"
    grouped_gemm: bool = False
    packed: bool = False  # packed sequences (THD, documents with padding): models.PACKED_DOCUMENTS
    steps: int = 10
    start_step: int = 0  # data index of the first step (a resumed run continues the sequence)
    weights: str | None = None  # torch.save'd full_weights() to start from
    save: str | None = None  # checkpoint folder, written after ``save_after`` steps
    save_after: int = 0
    load: str | None = None  # checkpoint folder to start from
    dump_weights: str | None = None  # torch.save the initial full_weights() here (references)
    deterministic: bool = False
    fault: str | None = None  # "resume" | "fp8_state": corrupt the loaded state (tests)
    overrides: dict[str, Any] = dataclasses.field(default_factory=dict)  # TransformerConfig

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> Job:
        return cls(**{**raw, "layout": Layout(**raw.get("layout", {}))})


def _fields(cls: type, **kwargs: Any) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in kwargs.items() if k in names}


def set_parallel_state(layout: Layout) -> None:
    """(Re)initialise Megatron's process groups for ``layout`` and reseed every RNG."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    _forget_embedding_ranks(parallel_state)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.virtual_size,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
    )
    torch.manual_seed(models.SEED)
    model_parallel_cuda_manual_seed(models.SEED)  # the CUDA RNG tracker (our CPU tests stub it)


@contextlib.contextmanager
def virtual_stage(stage: int, chunks: int) -> Iterator[None]:
    """Megatron's virtual pipeline rank set to ``stage`` while one model chunk is built or
    its ``sharded_state_dict`` taken, as ``megatron.training`` does around each chunk: trees
    before 0.13 compute a chunk's layer offset (its layers' global numbers and checkpoint
    keys) from this rank, not from the chunk. No-op without virtual stages."""
    from megatron.core import parallel_state

    if chunks == 1:
        yield
        return
    before = parallel_state.get_virtual_pipeline_model_parallel_rank()
    parallel_state.set_virtual_pipeline_model_parallel_rank(stage)
    try:
        yield
    finally:
        parallel_state.set_virtual_pipeline_model_parallel_rank(before)


# Rank lists destroy_model_parallel leaves behind (the position-embedding one at 0.12 only).
_STALE_AFTER_DESTROY = ("_EMBEDDING_GLOBAL_RANKS", "_POSITION_EMBEDDING_GLOBAL_RANKS")


def _forget_embedding_ranks(parallel_state: Any) -> None:
    """Training initialises one layout per process; the smoke worlds run several. A rank list
    kept from the last layout makes a rank outside the new layout's group believe it is in,
    and 0.12's PP2 then asserts "position embedding group is not initialized" on the last
    stage after a TP2 job (2 x H200). ``initialize_model_parallel`` sets them again."""
    for name in _STALE_AFTER_DESTROY:
        if hasattr(parallel_state, name):
            setattr(parallel_state, name, None)


def _wrap(job: Job, config: Any, module: Any) -> Any:
    from megatron.core import distributed as dist_mod

    overlap = job.overlap
    ddp_kwargs = dict(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=overlap,
        overlap_param_gather=overlap and job.dist_opt,
        use_distributed_optimizer=job.dist_opt or job.fsdp == "megatron_fsdp",
        bucket_size=20_000 if overlap else None,  # several buckets: the overlap really happens
    )
    if job.fsdp == "torch_fsdp2":
        cfg_cls = getattr(dist_mod, "TorchFullyShardedDataParallelConfig", None)
        ddp_config = cfg_cls() if cfg_cls else dist_mod.DistributedDataParallelConfig()
        return dist_mod.TorchFullyShardedDataParallel(
            config=config, ddp_config=ddp_config, module=module
        )
    if job.fsdp == "megatron_fsdp":
        ddp_kwargs.update(
            use_megatron_fsdp=True,
            use_custom_fsdp=True,  # what arguments.py sets beside it (0.14 - main)
            data_parallel_sharding_strategy="optim_grads_params",  # --use-megatron-fsdp default
        )
        cfg = dist_mod.DistributedDataParallelConfig(
            **_fields(dist_mod.DistributedDataParallelConfig, **ddp_kwargs)
        )
        return dist_mod.FullyShardedDataParallel(config=config, ddp_config=cfg, module=module)
    cfg = dist_mod.DistributedDataParallelConfig(
        **_fields(dist_mod.DistributedDataParallelConfig, **ddp_kwargs)
    )
    return dist_mod.DistributedDataParallel(config=config, ddp_config=cfg, module=module)


def _optimizer(job: Job, wrapped: list[Any]) -> Any:
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    kwargs = _fields(
        OptimizerConfig,
        optimizer="adam",
        lr=models.LR,
        weight_decay=0.01,
        adam_beta1=0.9,
        adam_beta2=0.95,
        bf16=True,
        params_dtype=torch.bfloat16,
        clip_grad=1.0,
        use_distributed_optimizer=job.dist_opt or job.fsdp == "megatron_fsdp",
    )
    return get_megatron_optimizer(OptimizerConfig(**kwargs), wrapped)


class Trainer:
    """Model chunks, wrappers and optimizer of one job on this rank, and its training step.

    One chunk per virtual pipeline stage (``Layout.vpp``; one without virtual stages), each
    wrapped on its own, as ``megatron.training.get_model`` builds them."""

    def __init__(
        self, job: Job, device: torch.device, capture: Callable[[Any], None] | None = None
    ) -> None:
        """``capture`` sees the bare GPTModel before it is wrapped (the reference weights;
        only a one-chunk model holds them all)."""
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.transformer.module import Float16Module

        self.job, self.device = job, device
        overrides: dict[str, Any] = dict(job.overrides)
        if job.fsdp == "torch_fsdp2":  # arguments.py refuses it with FSDP2
            overrides["gradient_accumulation_fusion"] = False
        if job.grouped_gemm:
            overrides["moe_grouped_gemm"] = True
        self.config = models.build_config(
            job.model,
            job.layout,
            spec=job.spec,
            gpu=device.type == "cuda",
            deterministic=job.deterministic,
            overrides=overrides,
        )
        torch.manual_seed(models.SEED)
        full = torch.load(job.weights, weights_only=True) if job.weights else None
        self.nets: list[Any] = []  # what megatron.training's checkpointing sees (unwrap_model)
        for stage in range(job.layout.vpp):
            with self.chunk(stage):
                net = models.build_model(
                    job.model,
                    job.spec,
                    self.config,
                    grouped_gemm=job.grouped_gemm,
                    device=device,
                    vp_stage=stage,
                )
                if full is not None:
                    from megatron_rocm.envtools.smoke.weights import load_full_weights

                    load_full_weights(net, full)
            self.nets.append(net)
        if capture is not None:
            if len(self.nets) > 1:
                raise ValueError("reference weights come from a model without virtual stages")
            capture(self.nets[0])
        self.params = sum(p.numel() for net in self.nets for p in net.parameters())
        self.models = [_wrap(job, self.config, Float16Module(self.config, n)) for n in self.nets]
        for stage, wrapped in enumerate(self.models):
            wrapped.vp_stage = stage  # what main's schedules check each chunk against
        self.optimizer = _optimizer(job, self.models)
        # megatron.training.training.setup_model_and_optimizer / train wire these
        self.config.grad_scale_func = self.optimizer.scale_loss
        self.config.finalize_model_grads_func = finalize_model_grads
        if job.overlap:
            if len(self.models) > 1:
                raise ValueError("overlapped grad reduce with virtual stages is not wired here")
            self.config.no_sync_func = self.models[0].no_sync
            self.config.grad_sync_func = self.models[0].start_grad_sync

    def chunk(self, stage: int) -> contextlib.AbstractContextManager[None]:
        """``virtual_stage`` for this job's chunk ``stage``."""
        return virtual_stage(stage, self.job.layout.vpp)

    # ------------------------------------------------------------------ one step
    def _forward_step(self, data_iterator: Any, model: Any) -> tuple[Any, Any]:
        batch = next(data_iterator)
        cp = self.job.layout.cp
        if self.job.packed:
            params = models.packed_seq_params(batch)
            output = model(
                batch["tokens"], batch["position_ids"], None, labels=batch["labels"],
                packed_seq_params=params,
            )  # fmt: skip
            return output, functools.partial(
                _masked_loss, cp, batch["loss_mask"], batch["loss_tokens"]
            )
        mask = models.causal_mask(models.SEQ, self.device) if cp == 1 else None
        output = model(batch["tokens"], batch["position_ids"], mask, labels=batch["labels"])
        return output, functools.partial(_loss, cp)

    def train_step(self, step: int) -> float | None:
        """One optimizer step on global batch ``step``; the loss on the last PP stage."""
        from megatron.core import parallel_state
        from megatron.core.pipeline_parallel import get_forward_backward_func

        for wrapped in self.models:
            wrapped.zero_grad_buffer()
        self.optimizer.zero_grad()
        dp = parallel_state.get_data_parallel_world_size()
        packed = self.job.packed
        # a packed micro-batch is one row of its MICRO_BATCH samples (THD)
        seq = models.SEQ * models.MICRO_BATCH if packed else models.SEQ
        batches = list(
            (models.packed_microbatches if packed else models.microbatches)(
                step,
                self.device,
                dp=dp,
                dp_rank=parallel_state.get_data_parallel_rank(),
                cp=self.job.layout.cp,
                cp_rank=parallel_state.get_context_parallel_rank(),
            )
        )
        # each chunk reads the micro-batches through its own iterator (interleaved schedule)
        iterators = [iter(batches) for _ in self.models]
        reduced = get_forward_backward_func()(
            forward_step_func=self._forward_step,
            data_iterator=iterators if len(iterators) > 1 else iterators[0],
            model=self.models,
            num_microbatches=len(batches),
            seq_length=seq,
            micro_batch_size=1 if packed else models.micro_batch_size(dp),
            decoder_seq_length=seq,
            forward_only=False,
        )
        result = self.optimizer.step()
        ok = result[0] if isinstance(result, tuple) else result
        if not ok:
            raise RuntimeError(f"step {step}: the optimizer skipped the update (overflow)")
        if not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
            return None
        loss = torch.stack([d["lm loss"] for d in reduced]).mean()
        group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        torch.distributed.all_reduce(loss, group=group)
        return loss.item() / torch.distributed.get_world_size(group)

    # ------------------------------------------------------------------ checkpoints
    def _optim_kwargs(self) -> dict[str, Any]:
        """What megatron.training's checkpointing passes at this tag (default flags)."""
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

        inner = getattr(self.optimizer, "chained_optimizers", [self.optimizer])[0]
        params = inspect.signature(inner.sharded_state_dict).parameters
        if not isinstance(inner, DistributedOptimizer):
            return {}
        source = inspect.getsource(DistributedOptimizer.sharded_state_dict)
        sharding = "dp_reshardable" if "dp_reshardable" in source else "fully_sharded_model_space"
        if "metadata" in params:
            meta = {"distrib_optim_sharding_type": sharding, "singleton_local_shards": False}
            return {"metadata": {**meta, "chained_optim_avoid_prefix": True}}
        return {"sharding_type": sharding}

    def _chunk_names(self) -> list[str]:
        """``model`` (one chunk) or ``model0``, ``model1``, ... (virtual stages), as
        ``megatron.training.checkpointing`` names them."""
        if len(self.nets) == 1:
            return ["model"]
        return [f"model{stage}" for stage in range(len(self.nets))]

    def _model_sharded_state_dict(self) -> dict[str, Any]:
        out = {}
        for stage, (name, net) in enumerate(zip(self._chunk_names(), self.nets)):
            with self.chunk(stage):
                out[name] = net.sharded_state_dict()
        return out

    def save(self, folder: str) -> None:
        from megatron.core import dist_checkpointing

        state = self._model_sharded_state_dict()
        state["optimizer"] = self.optimizer.sharded_state_dict(dict(state), **self._optim_kwargs())
        dist_checkpointing.save(state, folder)

    def load(self, folder: str) -> None:
        from megatron.core import dist_checkpointing

        state = self._model_sharded_state_dict()
        state["optimizer"] = self.optimizer.sharded_state_dict(
            dict(state), is_loading=True, **self._optim_kwargs()
        )
        loaded = dist_checkpointing.load(state, folder)
        for name, net in zip(self._chunk_names(), self.nets):
            net.load_state_dict(loaded[name])
        self.optimizer.load_state_dict(loaded["optimizer"])


def _loss(cp: int, output_tensor: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Mean token loss of this micro-batch. With context parallelism each rank holds 1/cp of
    the tokens; the schedule multiplies by cp and DDP averages over DP x CP, so returning
    local_mean / cp gives the gradient of the global mean (pretrain_gpt's legacy form)."""
    local = output_tensor.float().mean()
    return local / cp, {"lm loss": local.detach()}


def _masked_loss(
    cp: int, loss_mask: torch.Tensor, loss_tokens: float, output_tensor: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``_loss`` for packed batches: padding carries no loss, and CP ranks hold unequal
    numbers of real tokens, so this rank's sum is divided by the micro-batch's token count
    (the same gradient contract as ``_loss``); reported times cp, so that the mean over the
    CP ranks is the micro-batch's mean."""
    local = (output_tensor.float() * loss_mask).sum() / loss_tokens
    return local, {"lm loss": (local * cp).detach()}


def perturb_optimizer_state(optimizer: Any) -> int:
    """MEGATRON_ROCM_SMOKE_FAULT=resume: set every Adam step count back to 1, as a resume that
    lost the step would. Returns how many were changed; raising if none (a fault that cannot
    fire would make the test that relies on it vacuous)."""
    changed = 0
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", opt)
        for state in inner.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"].fill_(1)
                changed += 1
        for group in inner.param_groups:
            if "step" in group and group["step"] is not None:
                group["step"] = 1
                changed += 1
    if not changed:
        raise RuntimeError("fault 'resume': the optimizer holds no step count to perturb")
    return changed


def forget_fp8_histories(nets: list[Any]) -> int:
    """MEGATRON_ROCM_SMOKE_FAULT=fp8_state: every FP8 delayed-scaling history of the loaded
    model started again, as a checkpoint without them would leave it. Returns how many;
    raising if none (the fault must fire)."""
    changed = 0
    for net in nets:
        for module in net.modules():
            delayed = getattr(getattr(module, "fp8_recipe", None), "delayed", None)
            for history in vars(delayed).values() if delayed is not None else ():
                changed += history.started
                history.started = False
    if not changed:
        raise RuntimeError("fault 'fp8_state': the model holds no started FP8 history")
    return changed


def run_job(job: Job, device: torch.device) -> dict[str, Any]:
    """Train ``job`` on this rank; ``losses`` is None on ranks off the last pipeline stage."""
    set_parallel_state(job.layout)
    capture = None
    if job.dump_weights:
        from megatron_rocm.envtools.smoke.weights import full_weights

        dump = job.dump_weights
        capture = lambda net: torch.save(full_weights(net), dump)  # noqa: E731
    trainer = Trainer(job, device, capture)
    detail: dict[str, Any] = {"params_this_rank": trainer.params, "grouped_gemm": job.grouped_gemm}
    if job.load:
        trainer.load(job.load)
        if job.fault == "resume":
            detail["fault"] = f"resume: {perturb_optimizer_state(trainer.optimizer)} step counts"
        if job.fault == "fp8_state":
            detail["fault"] = f"fp8_state: {forget_fp8_histories(trainer.nets)} FP8 histories"
    losses: list[float | None] = []
    for i in range(job.steps):
        losses.append(trainer.train_step(job.start_step + i))
        if job.save and i + 1 == job.save_after:
            trainer.save(job.save)
    optim = getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer])
    detail["optimizer"] = type(optim[0]).__name__
    detail["inner"] = type(getattr(optim[0], "optimizer", optim[0])).__name__
    have = [x for x in losses if x is not None]
    if have and not all(math.isfinite(x) for x in have):
        detail["non_finite"] = True
    return {"losses": losses if have else None, "detail": detail}
