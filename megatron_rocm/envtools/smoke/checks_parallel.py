"""The parallel tier (two or four GPUs): each parallel mode trains the small Llama (the MoE
variant for expert parallelism) through the local spec and through the TE spec, and must

* learn (finite losses, falling: ``verdicts.learns``), and
* match the 1-GPU run of the same model and spec: every mode starts from the 1-GPU run's
  initial weights (resharded in memory, ``weights.py``) and sees the same global batches, so
  its first-step loss equals the 1-GPU one and its curve stays close
  (``verdicts.matches_reference``). This holds for every mode here, pipeline and expert
  parallelism included, because no mode initialises its own weights.

Worlds (``world.run_jobs``): one 1-GPU world computes the references; one 2-GPU world runs
TP/PP/CP/EP/DP with ``CUDA_DEVICE_MAX_CONNECTIONS=1`` (what ``arguments.py`` requires for TP
and CP before Blackwell); one runs the FSDPs without it (they require it unset or > 1). With
four GPUs visible, one 4-GPU world runs the combinations two GPUs cannot show (TP x PP with
virtual stages, TP x CP, EP4 over DP4, DP4); with fewer they are skipped, saying so. Each
mode is reported pass / fail / skip with the reason.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path

from megatron_rocm.envtools.smoke import models, verdicts
from megatron_rocm.envtools.smoke.engine import Job
from megatron_rocm.envtools.smoke.models import Layout
from megatron_rocm.envtools.smoke.runner import CheckFailed, Context, Skip, register
from megatron_rocm.envtools.smoke.world import JobResult, run_jobs

PARALLEL_STEPS = 8
ENVS = {"mp": {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}, "fsdp": {"CUDA_DEVICE_MAX_CONNECTIONS": None}}


@dataclass(frozen=True)
class Mode:
    name: str
    doc: str
    model: str = "llama"
    layout: Layout = field(default_factory=Layout)
    dist_opt: bool = False
    overlap: bool = False
    fsdp: str = ""
    env: str = "mp"
    packed: bool = False  # packed sequences (THD): compared with the packed 1-GPU run
    world: int = 2  # GPUs (ranks) the mode needs


MODES = [
    Mode("tp2_sp", "tensor parallel 2 + sequence parallel", layout=Layout(tp=2, sp=True)),
    Mode("pp2", "pipeline parallel 2 (1F1B schedule, 2 micro-batches)", layout=Layout(pp=2)),
    Mode(
        "dp2_distopt_overlap",
        "DP2, distributed optimizer, overlapped grad reduce-scatter and param all-gather",
        dist_opt=True,
        overlap=True,
    ),
    Mode("ep2_moe", "MoE (4 experts, top-2, alltoall) with expert parallel 2", "moe", Layout(ep=2)),
    Mode("cp2", "context parallel 2 (load-balanced chunks, causal)", layout=Layout(cp=2)),
    Mode(
        "cp2_packed",
        "context parallel 2 on packed sequences (THD with padding, per-document chunks)",
        layout=Layout(cp=2),
        packed=True,
    ),
    Mode("fsdp2", "torch FSDP2 (--use-torch-fsdp2)", fsdp="torch_fsdp2", env="fsdp"),
    Mode(
        "megatron_fsdp",
        "Megatron-FSDP, optim_grads_params, distributed optimizer",
        fsdp="megatron_fsdp",
        env="fsdp",
    ),
    # four GPUs
    Mode(
        "tp2_pp2_vpp",
        "TP2 + SP x PP2 with 2 virtual stages per rank (interleaved 1F1B, 4 layers)",
        "llama_deep",
        Layout(tp=2, pp=2, vpp=2, sp=True),
        world=4,
    ),
    Mode(
        "tp2_cp2",
        "TP2 + SP x CP2 (load-balanced chunks, causal)",
        layout=Layout(tp=2, cp=2, sp=True),
        world=4,
    ),
    Mode(
        "ep4_moe",
        "MoE (8 experts, top-2, alltoall) with expert parallel 4 over data parallel 4",
        "moe8",
        Layout(ep=4),
        world=4,
    ),
    Mode(
        "dp4_distopt_overlap",
        "DP4, distributed optimizer, overlapped grad reduce-scatter and param all-gather",
        dist_opt=True,
        overlap=True,
        world=4,
    ),
]
BY_NAME = {m.name: m for m in MODES}


def skip_reason(mode: Mode, spec: str, tree: Path) -> str | None:
    """Why (mode, spec) cannot run on this tree at all; None when it can."""
    if mode.layout.cp > 1 and spec == "local":
        return (
            "upstream runs context parallelism only through TEDotProductAttention (the TE "
            "spec); the local DotProductAttention asserts context_parallel_size == 1"
        )
    if (
        mode.packed
        and importlib.util.find_spec("megatron_rocm.runtime.backend.packed.context_parallel")
        is None
    ):
        return (
            "the native TE backend has no packed context parallelism yet "
            "(megatron_rocm.runtime.backend.packed.context_parallel)"
        )
    if (
        mode.layout.cp > 1
        and importlib.util.find_spec("megatron_rocm.runtime.backend.cp.dispatch") is None
    ):
        return (
            "the native TE backend has no context parallelism yet "
            "(megatron_rocm.runtime.backend.cp.dispatch)"
        )
    if (
        mode.name == "megatron_fsdp"
        and not (tree / "megatron/core/distributed/fsdp/mcore_fsdp_adapter.py").is_file()
    ):
        return "Megatron-FSDP is in megatron-core from 0.14; this tree predates it"
    if mode.name == "fsdp2" and _fsdp2_misses_force_all_reduce(tree):
        return (
            "upstream's torch FSDP2 wrapper cannot finish a step at this tag: "
            "finalize_model_grads passes finish_grad_sync(force_all_reduce=...), which "
            "TorchFullyShardedDataParallel does not take before 0.19 (TypeError, TE or not)"
        )
    if mode.name == "fsdp2" and _fsdp2_drops_ddp_config(tree):
        return (
            "upstream's torch FSDP2 wrapper cannot build an optimizer at this tag: "
            "get_megatron_optimizer reads model.ddp_config, which TorchFullyShardedDataParallel "
            "does not keep before 0.13 (AttributeError, TE or not)"
        )
    return None


def _core_texts(tree: Path, *paths: str) -> list[str] | None:
    """The text of each ``megatron/core`` file, or None when the tree lacks one of them."""
    files = [tree / "megatron/core" / path for path in paths]
    return [f.read_text() for f in files] if all(f.is_file() for f in files) else None


_FSDP2_WRAPPER = "distributed/torch_fully_sharded_data_parallel.py"


def _fsdp2_drops_ddp_config(tree: Path) -> bool:
    """0.12: the wrapper takes ``ddp_config`` but never stores it; the optimizer reads it."""
    texts = _core_texts(tree, "optimizer/__init__.py", _FSDP2_WRAPPER)
    return texts is not None and ".ddp_config" in texts[0] and "self.ddp_config" not in texts[1]


def _fsdp2_misses_force_all_reduce(tree: Path) -> bool:
    """0.16-0.18: finalize_model_grads calls ``finish_grad_sync(force_all_reduce=...)`` and
    the FSDP2 wrapper inherits ``_BaseDataParallel.finish_grad_sync(self)``; 0.19 overrides it."""
    texts = _core_texts(tree, "distributed/finalize_model_grads.py", _FSDP2_WRAPPER)
    return (
        texts is not None
        and "force_all_reduce" in texts[0]
        and "def finish_grad_sync" not in texts[1]
    )


def job_for(mode: Mode, spec: str, weights: str, overrides: dict | None = None) -> Job:
    moe = "num_moe_experts" in models.SHAPES[mode.model]
    grouped = moe and spec == "te" and models.grouped_gemm_available()
    return Job(
        f"parallel.{mode.name}.{spec}",
        model=mode.model,
        spec=spec,
        layout=mode.layout,
        dist_opt=mode.dist_opt,
        overlap=mode.overlap,
        fsdp=mode.fsdp,
        grouped_gemm=grouped,
        packed=mode.packed,
        steps=PARALLEL_STEPS,
        weights=weights,
        overrides=dict(overrides or {}),
    )


def _ref_key(mode: Mode, spec: str) -> tuple[str, str, bool]:
    """Which 1-GPU run a mode is compared with: same model, spec and data."""
    return (mode.model, spec, mode.packed)


def _wanted(ctx: Context) -> list[tuple[Mode, str]]:
    """The selected (mode, spec) pairs this machine has the GPUs for (the others skip)."""
    names = [n for n in ctx.selected if n.startswith("parallel.")]
    pairs = [(BY_NAME[n.split(".")[1]], n.split(".")[2]) for n in names if n.count(".") == 2]
    pairs = pairs or [(m, s) for m in MODES for s in models.SPECS]
    return [(mode, spec) for mode, spec in pairs if mode.world <= ctx.gpu_count]


def parallel_results(
    ctx: Context,
    pairs: list[tuple[Mode, str]],
    *,
    backend: str = "nccl",
    env: dict[str, str | None] | None = None,
    overrides: dict | None = None,
) -> dict[str, JobResult | str]:
    """Check name -> result, or the skip reason. References first, then one world per env.
    ``backend``, ``env`` and config ``overrides`` exist for our CPU tests (gloo)."""
    out: dict[str, JobResult | str] = {}
    runnable = []
    for mode, spec in pairs:
        reason = skip_reason(mode, spec, ctx.needs_tree())
        if reason:
            out[f"parallel.{mode.name}.{spec}"] = reason
        else:
            runnable.append((mode, spec))
    refs: dict[tuple[str, str, bool], Job] = {}
    for mode, spec in runnable:
        data = "-packed" if mode.packed else ""
        weights = str(ctx.workdir / f"parallel-initial-{mode.model}-{spec}{data}.pt")
        grouped = job_for(mode, spec, weights).grouped_gemm
        refs[_ref_key(mode, spec)] = Job(
            f"reference.{mode.model}.{spec}{data}",
            model=mode.model,
            spec=spec,
            grouped_gemm=grouped,
            packed=mode.packed,
            steps=PARALLEL_STEPS,
            dump_weights=weights,
            overrides=dict(overrides or {}),
        )
    done = run_jobs(1, list(refs.values()), ctx.tree, backend=backend, env=env)
    for key, ref in refs.items():
        ctx.cache[("parallel-reference", *key)] = done[ref.name]
    for group, world in sorted({(m.env, m.world) for m, _ in runnable}, key=_world_order):
        jobs = []
        for mode, spec in runnable:
            if (mode.env, mode.world) != (group, world):
                continue
            ref = refs[_ref_key(mode, spec)]
            if not done[ref.name].ok:
                data = ", packed sequences" if mode.packed else ""
                why = f"the 1-GPU {mode.model} run ({spec} spec{data}) failed: "
                why += str(done[ref.name].error)
                out[f"parallel.{mode.name}.{spec}"] = JobResult(ref.name, False, error=why)
                continue
            jobs.append(job_for(mode, spec, ref.dump_weights or "", overrides))
        if jobs:
            world_env = {**ENVS[group], **(env or {})}
            out.update(run_jobs(world, jobs, ctx.tree, backend=backend, env=world_env))
    return out


def _world_order(key: tuple[str, int]) -> tuple[int, int]:
    """Two-GPU worlds first, in ENVS order: the tier's older results come first."""
    group, world = key
    return world, list(ENVS).index(group)


def judge(ctx: Context, name: str, result: JobResult | str) -> str:
    if isinstance(result, str):
        raise Skip(result)
    if not result.ok or not result.losses:
        raise CheckFailed(result.error or "no losses reported")
    _, mode_name, spec = name.split(".")
    mode = BY_NAME[mode_name]
    ref = ctx.cache[("parallel-reference", *_ref_key(mode, spec))]
    try:
        learned = verdicts.learns(result.losses)
        matched = verdicts.matches_reference(result.losses, ref.losses)
    except verdicts.Verdict as e:
        raise CheckFailed(str(e)) from None
    extra = ", grouped GEMM experts" if result.detail.get("grouped_gemm") else ""
    opt = f"{result.detail.get('optimizer', '?')}({result.detail.get('inner', '?')})"
    return f"{learned}; {matched}; {opt}{extra}, {result.seconds:.1f}s"


def check_parallel(ctx: Context, mode: Mode, spec: str) -> str:
    name = f"parallel.{mode.name}.{spec}"
    ctx.needs_tree()
    ctx.needs_gpu(mode.world, "the parallel tier" if mode.world == 2 else name)
    key = "parallel"
    if key not in ctx.cache:
        ctx.cache[key] = parallel_results(ctx, _wanted(ctx))
    if name not in ctx.cache[key]:
        ctx.cache[key].update(parallel_results(ctx, [(mode, spec)]))
    return judge(ctx, name, ctx.cache[key][name])


def _register(mode: Mode, spec: str) -> None:
    def check(ctx: Context) -> str:
        return check_parallel(ctx, mode, spec)

    check.__doc__ = f"{mode.doc}; {spec} spec; learns and matches the 1-GPU run."
    register(f"parallel.{mode.name}.{spec}")(check)


for _mode in MODES:
    for _spec in models.SPECS:
        _register(_mode, _spec)
