"""Resume checks: a run that stops, saves and restarts in a fresh process must go on exactly
as if it had never stopped.

For each spec, one world trains RESUME_STEPS steps straight and, from the same seed, a second
run trains half of them and saves a ``torch_dist`` checkpoint (model + optimizer, with the
sharding type ``megatron.training`` uses at this tag). A fresh world loads it and trains the
other half. Both worlds run with upstream's ``--deterministic-mode`` settings
(``NCCL_ALGO=Ring``, ``CUBLAS_WORKSPACE_CONFIG=:4096:8``, deterministic algorithms,
``config.deterministic_mode``), so the losses after the restart are compared bit for bit
(``verdicts.resumes`` states the fallback tolerance). On one GPU the optimizer is Megatron's
mixed-precision one; on two it is the distributed optimizer over DP2, the case issue 12 found
broken without TE/Apex (patch ``dist-optimizer-resume``). Four GPUs add DP4 with the
distributed optimizer and TP2 x PP2 with virtual stages (``model0``/``model1`` chunks in the
checkpoint, as ``megatron.training`` writes them); with fewer GPUs they are skipped. On one GPU
the TE spec also trains in FP8 with delayed scaling, whose amax histories the checkpoint must
give back (skipped on a GPU without FP8 GEMMs).

``MEGATRON_ROCM_SMOKE_FAULT=resume`` resets the loaded Adam step counts (as a resume that lost
them would), and ``fp8_state`` starts the FP8 histories again in the FP8 scenario, to prove
these checks fail when the resumed state is wrong.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from megatron_rocm.envtools.smoke import models, verdicts
from megatron_rocm.envtools.smoke.checks_fp8 import skip_without_fp8_gemms
from megatron_rocm.envtools.smoke.engine import Job
from megatron_rocm.envtools.smoke.models import Layout
from megatron_rocm.envtools.smoke.runner import CheckFailed, Context, register
from megatron_rocm.envtools.smoke.world import DETERMINISM_ENV, JobResult, run_jobs

RESUME_STEPS = 8
SCENARIOS: dict[str, tuple[int, dict[str, Any], str]] = {
    # name: (GPUs, job options, what it checks)
    "1gpu": (1, {}, "1 GPU, mixed-precision optimizer"),
    # FP8 delayed scaling (upstream's default recipe): its amax histories must come back from
    # the checkpoint, or the resumed run's first quantizes scale differently
    "1gpu_fp8": (
        1,
        {
            "overrides": {
                "fp8": "hybrid",
                "fp8_recipe": "delayed",
                "fp8_amax_history_len": 16,
                "fp8_amax_compute_algo": "max",
            }
        },
        "1 GPU, FP8 delayed scaling (hybrid, 16 amaxes, max), mixed-precision optimizer",
    ),  # fmt: skip
    "dp2_distopt": (2, {"dist_opt": True}, "DP2 with the distributed optimizer"),
    # four GPUs: the distributed optimizer sharded four ways, and a checkpoint whose model is
    # split over tensor and pipeline ranks and over two virtual stages per pipeline rank
    "dp4_distopt": (4, {"dist_opt": True}, "DP4 with the distributed optimizer"),
    "tp2_pp2_vpp": (
        4,
        {"model": "llama_deep", "layout": Layout(tp=2, pp=2, vpp=2, sp=True)},
        "TP2 + SP x PP2 with 2 virtual stages, mixed-precision optimizer",
    ),
}
# scenarios for some specs only: FP8 runs in the TE spec's native linears
SCENARIO_SPECS: dict[str, tuple[str, ...]] = {"1gpu_fp8": ("te",)}


def scenario_specs(scenario: str) -> tuple[str, ...]:
    return SCENARIO_SPECS.get(scenario, models.SPECS)


def trains_fp8(scenario: str) -> bool:
    return "fp8" in SCENARIOS[scenario][1].get("overrides", {})


def _selected_specs(ctx: Context, scenario: str) -> list[str]:
    prefix = f"training.resume.{scenario}."
    chosen = [n[len(prefix) :] for n in ctx.selected if n.startswith(prefix)]
    specs = scenario_specs(scenario)
    return [s for s in specs if s in chosen] or list(specs)


def resume_results(
    ctx: Context,
    scenario: str,
    specs: list[str],
    *,
    backend: str = "nccl",
    env: dict[str, str | None] | None = None,
    overrides: dict | None = None,
) -> dict[str, dict[str, JobResult]]:
    """spec -> {"straight", "half", "resumed"} results of ``scenario`` (two worlds in all).
    ``backend``, ``env`` and config ``overrides`` exist for our CPU tests (gloo)."""
    world, options, _ = SCENARIOS[scenario]
    options = dict(options)
    overrides = {**options.pop("overrides", {}), **(overrides or {})}
    half = RESUME_STEPS // 2
    env = {**DETERMINISM_ENV, "CUDA_DEVICE_MAX_CONNECTIONS": "1", **(env or {})}
    first, second = [], []
    for spec in specs:
        folder = ctx.workdir / f"resume-{scenario}-{spec}"
        folder.mkdir(parents=True, exist_ok=True)
        base = Job(
            f"{scenario}.{spec}",
            spec=spec,
            deterministic=True,
            overrides=dict(overrides or {}),
            **options,
        )
        first += [
            replace(base, name=f"{base.name}.straight", steps=RESUME_STEPS),
            replace(base, name=f"{base.name}.half", steps=half, save=str(folder), save_after=half),
        ]
        fault = ctx.fault if ctx.fault == "resume" else None
        if ctx.fault == "fp8_state" and trains_fp8(scenario):
            fault = ctx.fault
        second.append(
            replace(
                base,
                name=f"{base.name}.resumed",
                steps=RESUME_STEPS - half,
                start_step=half,
                load=str(folder),
                fault=fault,
            )
        )
    done = run_jobs(world, first, ctx.tree, backend=backend, env=env)
    runnable = [j for j in second if done[j.name.replace(".resumed", ".half")].ok]
    done.update(run_jobs(world, runnable, ctx.tree, backend=backend, env=env) if runnable else {})
    out: dict[str, dict[str, JobResult]] = {}
    for spec in specs:
        name = f"{scenario}.{spec}"
        out[spec] = {
            phase: done.get(f"{name}.{phase}", JobResult(f"{name}.{phase}", False, error="not run"))
            for phase in ("straight", "half", "resumed")
        }
    return out


def judge(results: dict[str, JobResult], exact: bool = False) -> str:
    """The resume's verdict (``verdicts.resumes``); ``exact``: only bit for bit passes (FP8
    delayed scaling: a history that did not come back moves the losses by less than the
    tolerance a non-reproducible run is given)."""
    for phase, what in (
        ("straight", "the uninterrupted run"),
        ("half", "the run that saves"),
        ("resumed", "the resumed run (fresh process)"),
    ):
        r = results[phase]
        if not r.ok or not r.losses:
            raise CheckFailed(f"{what} failed: {r.error or 'no losses reported'}")
    try:
        verdict = verdicts.resumes(
            results["straight"].losses, results["half"].losses, results["resumed"].losses
        )
    except verdicts.Verdict as e:
        raise CheckFailed(str(e)) from None
    if exact and "not bit-exact" in verdict:
        raise CheckFailed(f"FP8 delayed scaling must resume bit for bit: {verdict}")
    info = results["resumed"].detail
    opt = f"{info.get('optimizer', '?')}({info.get('inner', '?')})"
    fault = f"; FAULT {info['fault']}" if info.get("fault") else ""
    return f"saved after {RESUME_STEPS // 2} of {RESUME_STEPS} steps, {verdict}; {opt}{fault}"


def check_resume(ctx: Context, scenario: str, spec: str) -> str:
    world, options, _ = SCENARIOS[scenario]
    ctx.needs_tree()
    ctx.needs_gpu(world, f"the {scenario} resume check")
    if trains_fp8(scenario):
        skip_without_fp8_gemms(ctx)
    key = ("resume", scenario)
    if key not in ctx.cache:
        ctx.cache[key] = resume_results(ctx, scenario, _selected_specs(ctx, scenario))
    if spec not in ctx.cache[key]:  # selected later than the first check of its scenario
        ctx.cache[key].update(resume_results(ctx, scenario, [spec]))
    return judge(ctx.cache[key][spec], exact=trains_fp8(scenario))


def _register(scenario: str, spec: str) -> None:
    def check(ctx: Context) -> str:
        return check_resume(ctx, scenario, spec)

    _, _, what = SCENARIOS[scenario]
    check.__doc__ = f"Save after N/2 steps, resume in a fresh process: {what}, {spec} spec."
    register(f"training.resume.{scenario}.{spec}")(check)


for _scenario in SCENARIOS:
    for _spec in scenario_specs(_scenario):
        _register(_scenario, _spec)
