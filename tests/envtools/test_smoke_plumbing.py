"""How the training, resume and parallel checks are selected, skipped, launched and judged,
without a GPU and without starting a world: ``launches`` replaces ``run_jobs`` where a check
would run, and a test that starts a real world anyway fails (``no_world``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_rocm.envtools.smoke import catalog, runner, world
from megatron_rocm.envtools.smoke.world import JobResult

pytestmark = pytest.mark.torch
torch = pytest.importorskip("torch")

from megatron_rocm.envtools.smoke import checks_parallel, checks_resume, models  # noqa: E402
from megatron_rocm.envtools.smoke.engine import Job  # noqa: E402
from megatron_rocm.envtools.smoke.models import Layout  # noqa: E402

CURVE = [6.97, 6.98, 6.31, 6.35, 5.77, 5.71, 5.19, 5.13]


def ctx(tmp_path: Path, gpus: int = 2, fault: str | None = None, tree: Path | None = None):
    tree = tree or tmp_path / "tree"
    (tree / "megatron/core").mkdir(parents=True, exist_ok=True)
    return runner.Context(
        tree=tree, device="cuda" if gpus else "cpu", gpu_count=gpus, fault=fault, log=lambda _: None
    )


@pytest.fixture(autouse=True)
def no_world(monkeypatch: pytest.MonkeyPatch):
    """Fail a test that starts ranks, even where the runner turned the refusal into a failed
    check the test does not look at."""
    started: list[list[str]] = []

    def refuse(cmd: list[str], *args, **kwargs) -> bool:  # noqa: ANN002, ANN003
        started.append(cmd)
        raise RuntimeError("the plumbing tests start no world")

    monkeypatch.setattr(world, "start_world", refuse)
    yield
    assert not started, f"a real world was started: {started}"


# ----------------------------------------------------------------------------- selection
def test_registry_names_every_mode_and_spec() -> None:
    names = list(catalog.load_checks())
    training = [n for n in names if n.startswith("training.")]
    assert training == [
        "training.gpt.local",
        "training.gpt.te",
        "training.llama.local",
        "training.llama.te",
        "training.resume.1gpu.local",
        "training.resume.1gpu.te",
        "training.resume.1gpu_fp8.te",
        "training.resume.dp2_distopt.local",
        "training.resume.dp2_distopt.te",
        "training.resume.dp4_distopt.local",
        "training.resume.dp4_distopt.te",
        "training.resume.tp2_pp2_vpp.local",
        "training.resume.tp2_pp2_vpp.te",
    ]
    modes = ["tp2_sp", "pp2", "dp2_distopt_overlap", "ep2_moe", "cp2", "cp2_packed", "fsdp2"]
    modes += ["megatron_fsdp", "tp2_pp2_vpp", "tp2_cp2", "ep4_moe", "dp4_distopt_overlap"]
    assert [n for n in names if n.startswith("parallel.")] == [
        f"parallel.{m}.{s}" for m in modes for s in ("local", "te")
    ]
    assert names.index("collectives.nccl") < names.index("parallel.tp2_sp.local")


@pytest.mark.parametrize(
    ("only", "count"),
    [(["parallel"], 24), (["parallel.ep2_moe"], 2), (["training.resume"], 9), (["training"], 13)],
)
def test_select_by_prefix(only, count) -> None:
    assert len(runner.select(catalog.load_checks(), only)) == count


def test_parallel_batch_follows_the_selection(tmp_path: Path) -> None:
    c = ctx(tmp_path)
    c.selected = ["training.gpt.te", "parallel.pp2.te", "parallel.fsdp2.local"]
    assert [(m.name, s) for m, s in checks_parallel._wanted(c)] == [
        ("pp2", "te"),
        ("fsdp2", "local"),
    ]
    c.selected = ["training.resume.dp2_distopt.te"]
    assert checks_resume._selected_specs(c, "dp2_distopt") == ["te"]
    assert checks_resume._selected_specs(c, "1gpu") == ["local", "te"]  # called directly
    assert checks_resume._selected_specs(c, "1gpu_fp8") == ["te"]  # FP8: the TE spec only


# ----------------------------------------------------------------------------- skips
def test_too_few_gpus_skip_with_the_count(tmp_path: Path, launches) -> None:
    checks = runner.select(catalog.load_checks(), ["parallel.tp2_sp.te", "training.resume"])
    results = {r.name: r for r in runner.run_checks(ctx(tmp_path, gpus=1), checks)}
    assert results["parallel.tp2_sp.te"].status == "skip"
    assert (
        results["parallel.tp2_sp.te"].detail == "the parallel tier needs 2 GPUs; only 1 GPU visible"
    )
    assert results["training.resume.dp2_distopt.local"].status == "skip"
    assert {n for n, _, _ in launches} == {1}  # only the 1-GPU resume checks ran (stubbed)
    assert results["training.resume.1gpu.te"].status == "pass"


def test_four_gpu_modes_skip_on_two_and_join_the_batch_on_four(tmp_path: Path) -> None:
    checks = runner.select(
        catalog.load_checks(), ["parallel.tp2_cp2.te", "training.resume.dp4_distopt"]
    )
    results = {r.name: r for r in runner.run_checks(ctx(tmp_path, gpus=2), checks)}
    assert results["parallel.tp2_cp2.te"].status == "skip"
    assert results["parallel.tp2_cp2.te"].detail == (
        "parallel.tp2_cp2.te needs 4 GPUs; only 2 GPUs visible"
    )
    assert results["training.resume.dp4_distopt.te"].detail == (
        "the dp4_distopt resume check needs 4 GPUs; only 2 GPUs visible"
    )
    two, four = ctx(tmp_path, gpus=2), ctx(tmp_path, gpus=4)
    for c in (two, four):
        c.selected = ["parallel.pp2.te", "parallel.tp2_pp2_vpp.te", "parallel.ep4_moe.local"]
    assert [m.name for m, _ in checks_parallel._wanted(two)] == ["pp2"]
    assert [m.name for m, _ in checks_parallel._wanted(four)] == ["pp2", "tp2_pp2_vpp", "ep4_moe"]
    two.selected = four.selected = []  # everything: the 4-GPU modes only where 4 GPUs are
    assert not any(m.world == 4 for m, _ in checks_parallel._wanted(two))
    assert sum(m.world == 4 for m, _ in checks_parallel._wanted(four)) == 8


def test_static_skip_reasons(tmp_path: Path, monkeypatch) -> None:
    tree = tmp_path / "tree"
    modes = checks_parallel.BY_NAME
    assert "only through TEDotProductAttention" in checks_parallel.skip_reason(
        modes["cp2"], "local", tree
    )
    real = checks_parallel.importlib.util.find_spec
    monkeypatch.setattr(
        checks_parallel.importlib.util,
        "find_spec",
        lambda name: None if name.endswith(("context_parallel", "cp.dispatch")) else real(name),
    )
    assert "no context parallelism yet" in checks_parallel.skip_reason(modes["cp2"], "te", tree)
    assert "only through TEDotProductAttention" in checks_parallel.skip_reason(
        modes["cp2_packed"], "local", tree
    )
    monkeypatch.setattr(
        checks_parallel.importlib.util,
        "find_spec",
        lambda name: None if name.endswith("packed.context_parallel") else real(name),
    )
    assert "no packed context parallelism yet" in checks_parallel.skip_reason(
        modes["cp2_packed"], "te", tree
    )
    assert "from 0.14" in checks_parallel.skip_reason(modes["megatron_fsdp"], "te", tree)
    adapter = tree / "megatron/core/distributed/fsdp/mcore_fsdp_adapter.py"
    adapter.parent.mkdir(parents=True)
    adapter.write_text("")
    assert checks_parallel.skip_reason(modes["megatron_fsdp"], "te", tree) is None
    assert checks_parallel.skip_reason(modes["fsdp2"], "local", tree) is None


# ----------------------------------------------------------------------------- launching
@pytest.fixture
def launches(monkeypatch) -> list[tuple[int, list[Job], dict]]:
    """Replace the worlds: every job 'trains' CURVE (or its first/second half)."""
    calls: list[tuple[int, list[Job], dict]] = []

    def fake_run_jobs(n, jobs, tree, *, backend="nccl", env=None, timeout=120.0):
        calls.append((n, list(jobs), dict(env or {})))
        out = {}
        for j in jobs:
            losses = CURVE[j.start_step : j.start_step + j.steps]
            out[j.name] = JobResult(j.name, True, losses, detail={"optimizer": "X"})
        return out

    monkeypatch.setattr(checks_parallel, "run_jobs", fake_run_jobs)
    monkeypatch.setattr(checks_resume, "run_jobs", fake_run_jobs)
    return calls


def test_parallel_worlds_and_environments(tmp_path: Path, launches, monkeypatch) -> None:
    monkeypatch.setattr(checks_parallel.models, "grouped_gemm_available", lambda: True)
    c = ctx(tmp_path)
    pairs = [
        (checks_parallel.BY_NAME[m], s)
        for m in ("tp2_sp", "ep2_moe", "fsdp2")
        for s in ("local", "te")
    ]
    pairs.append((checks_parallel.BY_NAME["cp2"], "local"))
    results = checks_parallel.parallel_results(c, pairs)
    refs, mp, fsdp = launches
    assert refs[0] == 1 and {j.name for j in refs[1]} == {
        "reference.llama.local",
        "reference.llama.te",
        "reference.moe.local",
        "reference.moe.te",
    }
    assert all(j.dump_weights and j.layout == Layout() for j in refs[1])
    assert mp[0] == 2 and mp[2]["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    assert fsdp[2]["CUDA_DEVICE_MAX_CONNECTIONS"] is None  # removed: FSDP requires it unset/>1
    by_name = {j.name: j for j in mp[1] + fsdp[1]}
    assert by_name["parallel.tp2_sp.te"].layout == Layout(tp=2, sp=True)
    assert (
        by_name["parallel.ep2_moe.te"].grouped_gemm
        and not by_name["parallel.ep2_moe.local"].grouped_gemm
    )
    assert by_name["parallel.ep2_moe.te"].weights.endswith("parallel-initial-moe-te.pt")
    assert isinstance(results["parallel.cp2.local"], str)  # a skip reason, not run
    detail = checks_parallel.judge(c, "parallel.tp2_sp.te", results["parallel.tp2_sp.te"])
    assert "first step 6.97000 = 1-GPU 6.97000 (bit-exact)" in detail


def test_four_gpu_modes_run_in_a_four_rank_world(tmp_path: Path, launches, monkeypatch) -> None:
    monkeypatch.setattr(checks_parallel.models, "grouped_gemm_available", lambda: True)
    c = ctx(tmp_path, gpus=4)
    pairs = [(checks_parallel.BY_NAME[m], "te") for m in ("tp2_pp2_vpp", "ep4_moe", "tp2_sp")]
    pairs.append((checks_parallel.BY_NAME["tp2_cp2"], "local"))
    results = checks_parallel.parallel_results(c, pairs)
    refs, two, four = launches
    assert {j.name for j in refs[1]} == {
        "reference.llama_deep.te",
        "reference.moe8.te",
        "reference.llama.te",
    }
    assert two[0] == 2 and [j.name for j in two[1]] == ["parallel.tp2_sp.te"]
    assert four[0] == 4 and four[2]["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    by_name = {j.name: j for j in four[1]}
    assert by_name["parallel.tp2_pp2_vpp.te"].layout == Layout(tp=2, pp=2, vpp=2, sp=True)
    assert by_name["parallel.tp2_pp2_vpp.te"].weights.endswith("initial-llama_deep-te.pt")
    assert by_name["parallel.ep4_moe.te"].grouped_gemm
    assert by_name["parallel.ep4_moe.te"].layout == Layout(ep=4)
    assert "TEDotProductAttention" in results["parallel.tp2_cp2.local"]  # skipped, as cp2


def test_micro_batches_split_the_same_global_batch_at_every_data_parallel_size() -> None:
    whole = models.global_batch(3, "cpu")["tokens"]
    for dp in (1, 2, 4):
        parts = [
            mb["tokens"]
            for rank in range(dp)
            for mb in models.microbatches(3, "cpu", dp=dp, dp_rank=rank, cp=1, cp_rank=0)
        ]
        assert len(parts) == models.GLOBAL_BATCH // models.micro_batch_size(dp)
        assert torch.equal(torch.cat(parts), whole)
    assert models.micro_batch_size(4) == 1 and models.micro_batch_size(2) == 2
    with pytest.raises(ValueError, match="does not split over DP 3"):
        models.micro_batch_size(3)


def test_parallel_judge(tmp_path: Path) -> None:
    c = ctx(tmp_path)
    c.cache[("parallel-reference", "llama", "local", False)] = JobResult("ref", True, CURVE)
    with pytest.raises(runner.Skip, match="not yet"):
        checks_parallel.judge(c, "parallel.cp2.local", "not yet")
    with pytest.raises(runner.CheckFailed, match="rank 1: boom"):
        checks_parallel.judge(c, "parallel.pp2.local", JobResult("x", False, error="rank 1: boom"))
    off = [CURVE[0] * 1.01, *CURVE[1:]]  # e.g. a wrong shard: the first step moves
    with pytest.raises(runner.CheckFailed, match="differs from the 1-GPU run"):
        checks_parallel.judge(c, "parallel.pp2.local", JobResult("x", True, off))
    flat = [7.0] * 8
    with pytest.raises(runner.CheckFailed, match="did not decrease"):
        checks_parallel.judge(c, "parallel.pp2.local", JobResult("x", True, flat))


def test_parallel_needs_its_reference(tmp_path: Path, monkeypatch) -> None:
    def failing_refs(n, jobs, tree, *, backend="nccl", env=None, timeout=120.0):
        assert n == 1, "no 2-GPU world may start without its reference"
        return {j.name: JobResult(j.name, False, error="rank 0: TypeError: TE") for j in jobs}

    monkeypatch.setattr(checks_parallel, "run_jobs", failing_refs)
    c = ctx(tmp_path)
    out = checks_parallel.parallel_results(c, [(checks_parallel.BY_NAME["pp2"], "te")])
    with pytest.raises(runner.CheckFailed, match=r"the 1-GPU llama run \(te spec\) failed: rank 0"):
        checks_parallel.judge(c, "parallel.pp2.te", out["parallel.pp2.te"])


@pytest.mark.parametrize("fault", [None, "resume"])
def test_resume_jobs(tmp_path: Path, launches, fault) -> None:
    c = ctx(tmp_path, fault=fault)
    out = checks_resume.resume_results(c, "dp2_distopt", ["te"])
    (n1, first, env1), (n2, second, env2) = launches
    assert n1 == n2 == 2 and env1 == env2
    assert env1["NCCL_ALGO"] == "Ring" and env1["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    straight, half = first
    (resumed,) = second
    assert straight.steps == 8 and half.steps == half.save_after == 4 and half.save
    assert (resumed.load, resumed.start_step, resumed.steps) == (half.save, 4, 4)
    assert all(j.dist_opt and j.deterministic and j.spec == "te" for j in first + second)
    assert resumed.fault == fault and straight.fault is None
    assert "steps 5-8 after the restart are bit-exact" in checks_resume.judge(out["te"])


def test_four_gpu_resume_scenarios(tmp_path: Path, launches) -> None:
    c = ctx(tmp_path, gpus=4)
    checks_resume.resume_results(c, "tp2_pp2_vpp", ["local"])
    checks_resume.resume_results(c, "dp4_distopt", ["te"])
    assert [n for n, _, _ in launches] == [4, 4, 4, 4]
    vpp = launches[0][1] + launches[1][1]
    assert all(j.model == "llama_deep" and j.layout.vpp == 2 and not j.dist_opt for j in vpp)
    dp4 = launches[2][1] + launches[3][1]
    assert all(j.dist_opt and j.layout == Layout() for j in dp4)


def test_resume_judge_names_the_failing_phase() -> None:
    ok = JobResult("s", True, CURVE)
    results = {"straight": ok, "half": JobResult("h", True, CURVE[:4]), "resumed": None}
    results["resumed"] = JobResult("r", False, error="rank 0: AssertionError:  (at x.py:1)")
    with pytest.raises(runner.CheckFailed, match=r"the resumed run \(fresh process\) failed"):
        checks_resume.judge(results)
    results["resumed"] = JobResult("r", True, [CURVE[4], CURVE[5] * 1.01, *CURVE[6:]])
    with pytest.raises(runner.CheckFailed, match="diverges at step 6"):
        checks_resume.judge(results)


# ----------------------------------------------------------------------------- the world
def _entry(name: str, ok: bool = True, losses=None, error: str = "") -> dict:
    return {"name": name, "ok": ok, "losses": losses, "error": error, "seconds": 1.0}


def test_merge_rank_verdicts() -> None:
    jobs = [Job("a"), Job("b"), Job("c")]
    per_rank = [
        [_entry("a", losses=[1.0]), _entry("b")],
        [_entry("a"), _entry("b", False, error="boom")],
    ]
    got = world._merge(jobs, per_rank, ["", ""], False, 60)
    assert [(r.name, r.ok) for r in got] == [("a", True), ("b", False)]  # c: next world
    assert got[0].losses == [1.0] and got[1].error == "rank 1: boom"
    died = world._merge(jobs, [[_entry("a")], []], ["", "Segmentation fault"], False, 60)
    assert died[0].error == "rank 1 died during this job: Segmentation fault"
    hung = world._merge(jobs, [[_entry("a")], []], ["", "..."], True, 60)
    assert hung[0].error.startswith("rank 1 timed out after 60s during this job")


def test_rank_env_sets_and_removes(monkeypatch) -> None:
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    env = world.rank_env(1, 2, 1234, {"CUDA_DEVICE_MAX_CONNECTIONS": None, "X": "y"})
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in env and env["X"] == "y"
    assert (env["RANK"], env["WORLD_SIZE"], env["MASTER_PORT"]) == ("1", "2", "1234")
    assert env["NCCL_NVLS_ENABLE"] == "0"


def test_job_round_trips_through_json() -> None:
    job = Job("j", model="moe", layout=Layout(tp=2, sp=True), overrides={"hidden_size": 64})
    assert Job.from_dict(job.to_dict()) == job


def test_scratch_folder_is_removed(tmp_path: Path) -> None:
    c = ctx(tmp_path)
    seen = []

    def uses_workdir(context: runner.Context) -> str:
        seen.append(context.workdir)
        (context.workdir / "weights.pt").write_text("x")
        return "ok"

    runner.run_checks(c, [runner.Check("training.x", uses_workdir)])
    assert seen and not seen[0].exists()


def test_te_spec_failure_names_upstreams_error(monkeypatch) -> None:
    """An unpatched tree without TE: the TE-spec checks fail with upstream's TypeError spelled
    out (issue 10), not with a bare traceback."""
    import sys
    import types

    from megatron_rocm.envtools.smoke import models

    def te_spec(num_experts=None, moe_grouped_gemm=False):
        raise TypeError("'NoneType' object is not callable")

    fake = types.ModuleType("megatron.core.models.gpt.gpt_layer_specs")
    fake.get_gpt_layer_with_transformer_engine_spec = te_spec
    names = ["megatron", "megatron.core", "megatron.core.models", "megatron.core.models.gpt"]
    for name in names:
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setattr(
        sys.modules["megatron.core.models.gpt"], "gpt_layer_specs", fake, raising=False
    )
    monkeypatch.setitem(sys.modules, fake.__name__, fake)
    config = types.SimpleNamespace(num_moe_experts=None, normalization="RMSNorm")
    with pytest.raises(models.TESpecUnavailable) as e:
        models.layer_spec("te", config)
    assert "upstream's TE spec does not build without TransformerEngine" in str(e.value)
    assert "TypeError: 'NoneType' object is not callable" in str(e.value)
    assert "te-spec-backend" in str(e.value)  # this megatron_rocm has the native backend


FSDP2_WRAPPER = "distributed/torch_fully_sharded_data_parallel.py"
FINALIZE = "distributed/finalize_model_grads.py"
WRAPPER_WITHOUT_OVERRIDES = "class TorchFullyShardedDataParallel(_BaseDataParallel):\n    pass\n"


def _core_file(tree: Path, path: str, text: str) -> None:
    """Write ``megatron/core/<path>`` of a stand-in tree."""
    target = tree / "megatron/core" / path
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text)


def test_fsdp2_is_skipped_where_upstreams_wrapper_cannot_finish_a_step(tmp_path: Path) -> None:
    """0.16-0.18: finalize_model_grads passes force_all_reduce, the FSDP2 wrapper lacks it."""
    calls_with_force = "model_chunk.finish_grad_sync(force_all_reduce=force_all_reduce)\n"
    _core_file(tmp_path, FINALIZE, calls_with_force)
    _core_file(tmp_path, FSDP2_WRAPPER, WRAPPER_WITHOUT_OVERRIDES)
    fsdp2 = checks_parallel.BY_NAME["fsdp2"]
    assert "force_all_reduce" in checks_parallel.skip_reason(fsdp2, "te", tmp_path)
    overrides = "    def finish_grad_sync(self, force_all_reduce=False):\n"  # 0.19+
    _core_file(tmp_path, FSDP2_WRAPPER, overrides)
    assert checks_parallel.skip_reason(fsdp2, "te", tmp_path) is None
    _core_file(tmp_path, FINALIZE, "model_chunk.finish_grad_sync()\n")  # <= 0.15
    _core_file(tmp_path, FSDP2_WRAPPER, WRAPPER_WITHOUT_OVERRIDES)
    assert checks_parallel.skip_reason(fsdp2, "te", tmp_path) is None


def test_fsdp2_is_skipped_where_upstreams_wrapper_drops_ddp_config(tmp_path: Path) -> None:
    """0.12: get_megatron_optimizer reads model_chunks[0].ddp_config, the wrapper never sets it."""
    _core_file(tmp_path, "optimizer/__init__.py", "ddp_config = model_chunks[0].ddp_config\n")
    _core_file(tmp_path, FSDP2_WRAPPER, WRAPPER_WITHOUT_OVERRIDES)
    fsdp2 = checks_parallel.BY_NAME["fsdp2"]
    assert "ddp_config" in checks_parallel.skip_reason(fsdp2, "local", tmp_path)
    _core_file(tmp_path, FSDP2_WRAPPER, "        self.ddp_config = ddp_config\n")  # 0.13+
    assert checks_parallel.skip_reason(fsdp2, "local", tmp_path) is None


def test_the_fp8_resume_passes_only_bit_for_bit() -> None:
    """Histories that did not come back move the losses by less than the tolerance a
    non-reproducible run is given: the FP8 scenario asks for bit for bit."""
    straight = [6.0, 5.0, 4.0, 3.0, 2.5, 2.0, 1.5, 1.0]
    close = [*straight[4:7], straight[7] * (1 + 1e-5)]
    results = {
        "straight": JobResult("s", True, straight),
        "half": JobResult("h", True, straight[:4]),
        "resumed": JobResult("r", True, close),
    }
    assert "not bit-exact but within" in checks_resume.judge(results)
    with pytest.raises(runner.CheckFailed, match="FP8 delayed scaling must resume bit for bit"):
        checks_resume.judge(results, exact=True)
    assert checks_resume.trains_fp8("1gpu_fp8") and not checks_resume.trains_fp8("1gpu")
