"""scripts/gpu.sh, the one GPU driver: the stages its header documents are the stages it defines, and
``cpscale`` launches the runs its header promises. The GPU work itself runs on lent machines
(docs/performance.md); here a stand-in Python records what each stage would have launched."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts/gpu.sh"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def header() -> str:
    return SCRIPT.read_text().split("\nset -u\n", 1)[0]


def test_the_script_parses() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_documented_stages_are_the_defined_stages() -> None:
    documented = set(re.findall(r"^#   ([a-z][a-z0-9]*) +\S", header(), re.M))
    by_gpus = set()
    for line in re.findall(r"^#   \d GPUs?: +(.+)$", header(), re.M):
        by_gpus.update(line.split())
    defined = set(re.findall(r"^stage_([a-z0-9]+)\(\)", SCRIPT.read_text(), re.M))
    assert documented == defined
    assert by_gpus == defined


def run_stage(tmp_path: Path, stage: str, **env: str) -> list[str]:
    """Run one stage with a Python stand-in; return the command lines it was given."""
    calls = tmp_path / "calls.txt"
    fake = tmp_path / "fake-python"
    fake.write_text(
        "#!/usr/bin/env bash\n"
        f'echo "kernel=${{MEGATRON_ROCM_CP_KERNEL:-auto}} $*" >> {calls}\n'
        f'echo "${{CUDA_VISIBLE_DEVICES-unset}}" >> {calls}.gpus\n'
        # with FAKE_REAL=PYTHON the log summaries run for real (the stage's wiring is tested)
        'if [ -n "${FAKE_REAL:-}" ] && [ "$2" = scripts.training.example_summary ]; then\n'
        '  exec "$FAKE_REAL" "$@"; fi\n'
        # with FAKE_GPUS=N a `python -c` (a stage asking torch for the GPU count) answers N
        'if [ "$1" = -c ] && [ -n "${FAKE_GPUS:-}" ]; then echo "$FAKE_GPUS"; exit 0; fi\n'
        # with FAKE_MEET=N a run on a named GPU waits (up to 20 s) until N such runs have
        # started, and records whether they met: runs launched one after another never do
        'if [ -n "${FAKE_MEET:-}" ] && [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then\n'
        f"  touch {calls}.meet.$$; met=alone\n"
        f'  for _ in $(seq 200); do [ $(ls {calls}.meet.* | wc -l) -ge "$FAKE_MEET" ] && '
        "{ met=met; break; }; sleep 0.1; done\n"
        f"  echo $met >> {calls}.met; fi\n"
        # with FAKE_LOGS=1 a training run writes the log it was given, as train_small.py does
        'if [ "${FAKE_LOGS:-0}" = 1 ]; then prev=; for a in "$@"; do\n'
        '  [ "$prev" = --log ] && : > "$a"; prev=$a; done; fi\n'
        # with FAKE_DEST=1 an apply makes the --dest folder, as megatron-rocm apply does
        'if [ "${FAKE_DEST:-0}" = 1 ]; then prev=; for a in "$@"; do\n'
        '  [ "$prev" = --dest ] && mkdir -p "$a"; prev=$a; done; fi\n'
        "echo '{\"ok\": true}'\n"
    )
    fake.chmod(0o755)
    inherited = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("CP_") and k != "CUDA_VISIBLE_DEVICES"
    }
    full_env = {
        **inherited,
        "PYTHON": str(fake),
        "WORK": str(tmp_path / "work"),
        "REFS": "main",
        **env,
    }
    full_env.pop("MEGATRON_ROCM_CP_KERNEL", None)
    subprocess.run(
        ["bash", str(SCRIPT), str(tmp_path / "out"), stage],
        check=True,
        env=full_env,
        capture_output=True,
        text=True,
    )
    return calls.read_text().splitlines()


def option(call: str, name: str) -> str | None:
    match = re.search(rf"{name} (\S+)", call)
    return match.group(1) if match else None


def test_cpscale_runs_the_five_comparisons(tmp_path: Path) -> None:
    calls = run_stage(
        tmp_path,
        "cpscale",
        CP_SIZE="0.85b",
        CP_LENGTH="32768",
        CP_FLAGS="--no-create-attention-mask-in-dataloader",
    )
    assert len(calls) == 5
    shape = [
        (option(c, "--nproc"), option(c, "--cp"), option(c, "--seq-length"), c.split()[0])
        for c in calls
    ]
    assert shape == [
        ("1", None, "16384", "kernel=auto"),
        ("1", None, "32768", "kernel=auto"),
        ("2", "2", "32768", "kernel=auto"),
        ("2", "2", "32768", "kernel=flash"),
        ("2", "2", "32768", "kernel=auto"),
    ]
    for call in calls:
        assert option(call, "--preset-size") == "0.85b"
        assert call.endswith("--no-create-attention-mask-in-dataloader")
    # after the lone --, where train_small.py hands it on to pretrain_gpt.py
    assert [c for c in calls if " -- --cp-comm-type a2a " in c] == [calls[4]]
    summary = (tmp_path / "out/summary.txt").read_text()
    assert summary.count("cpscale-0.85b-32k-") == 5


def test_cpscale_defaults_to_the_small_model_at_16k_with_upstreams_flags(tmp_path: Path) -> None:
    calls = run_stage(tmp_path, "cpscale")
    assert [option(c, "--seq-length") for c in calls] == ["8192"] + ["16384"] * 4
    assert all(option(c, "--preset-size") == "small" for c in calls)
    assert all(c.endswith("--") for c in calls[:4])  # nothing added for pretrain_gpt.py
    assert calls[4].endswith(" -- --cp-comm-type a2a")


def test_cpscale_runs_a_one_gpu_run_on_the_gpu_named_after_the_at(tmp_path: Path) -> None:
    """``cp1-half@1`` times CP=1 on GPU 1 alone: a pair runs at its slower GPU's pace, so the
    one-GPU reference is timed on each GPU of the pair. A CP=2 run or a non-number is refused."""
    calls = run_stage(tmp_path, "cpscale", CP_RUNS="cp1-half cp1-half@1 cp2@1 cp1@x cp2-a2a")
    assert [(option(c, "--nproc"), option(c, "--log")) for c in calls] == [
        ("1", str(tmp_path / "out/cpscale-small-16k-cp1-half-main.log")),
        ("1", str(tmp_path / "out/cpscale-small-16k-cp1-half-gpu1-main.log")),
        ("2", str(tmp_path / "out/cpscale-small-16k-cp2-a2a-main.log")),
    ]
    # the other runs see the GPUs the stage was given (here: no CUDA_VISIBLE_DEVICES at all)
    assert (tmp_path / "calls.txt.gpus").read_text().split() == ["unset", "1", "unset"]
    summary = (tmp_path / "out/summary.txt").read_text()
    assert "cpscale-small-16k-cp1-half-gpu1: " in summary
    assert "cpscale: cp2@1: only a one-GPU run takes @GPU" in summary
    assert "cpscale: cp1@x: only a one-GPU run takes @GPU" in summary


def test_cpscale_runs_a_one_gpu_run_on_several_gpus_at_once(tmp_path: Path) -> None:
    """``cp1-half@0+1``: one process per GPU, both running before either is waited for (as
    the pair's GPUs run beside each other under CP=2), each with a log and a summary line."""
    calls = run_stage(
        tmp_path, "cpscale", CP_RUNS="cp1-half@0+1 cp2@0+1 cp1@0+x cp2-a2a", FAKE_MEET="2"
    )
    assert (tmp_path / "calls.txt.met").read_text().split() == ["met", "met"]
    logs = sorted(option(c, "--log") for c in calls[:2])
    assert logs == [
        str(tmp_path / "out/cpscale-small-16k-cp1-half-gpu0-beside-0-1-main.log"),
        str(tmp_path / "out/cpscale-small-16k-cp1-half-gpu1-beside-0-1-main.log"),
    ]
    assert all(option(c, "--nproc") == "1" for c in calls[:2])
    assert option(calls[2], "--nproc") == "2" and len(calls) == 3
    gpus = (tmp_path / "calls.txt.gpus").read_text().split()
    assert sorted(gpus[:2]) == ["0", "1"] and gpus[2] == "unset"
    summary = (tmp_path / "out/summary.txt").read_text()
    assert "cpscale-small-16k-cp1-half-gpu0-beside-0-1: " in summary
    assert "cpscale-small-16k-cp1-half-gpu1-beside-0-1: " in summary
    assert "cpscale: cp2@0+1: only a one-GPU run takes @GPU" in summary
    assert "cpscale: cp1@0+x: only a one-GPU run takes @GPU" in summary


def test_mimo2_compares_upstreams_mimo_tests_on_both_trees(tmp_path: Path) -> None:
    calls = run_stage(tmp_path, "mimo2")
    run, compare = calls
    assert " scripts/upstream_unit_tests.py run " in f" {run} "
    assert option(run, "--paths") == "tests/unit_tests/models/mimo"
    assert (option(run, "--nproc"), option(run, "--jobs")) == ("2", "4")
    trees = re.findall(r"--tree (\S+)=", run)
    assert trees == ["u-main", "p-main"]  # unpatched first, then patched, in one run
    assert compare.split()[1:2] == ["scripts/upstream_unit_tests.py"] and " compare " in compare
    assert option(compare, "--md").endswith("/mimo-compare.md")


@pytest.mark.parametrize(("stage", "nproc"), [("upx1", "1"), ("upx2", "2"), ("upx4", "4")])
def test_upx_runs_upstreams_checkpointing_and_model_suites_on_both_trees(
    tmp_path: Path, stage: str, nproc: str
) -> None:
    run, compare = run_stage(tmp_path, stage)
    assert re.findall(r"--suite (\S+)", run) == ["dist_checkpointing", "models"]
    assert option(run, "--nproc") == nproc and option(run, "--budget") == "470"
    assert re.findall(r"--tree (\S+)=", run) == ["u-main", "p-main"]
    assert option(compare, "--md").endswith(f"/{stage}-compare.md")
    (tmp_path / "b").mkdir()
    again, _ = run_stage(tmp_path / "b", stage, UPX_BUDGET="60")
    assert option(again, "--budget") == "60"


def test_moebench_times_upstreams_modules_and_the_bare_gemms_on_the_same_experts(
    tmp_path: Path,
) -> None:
    modules, gemms = run_stage(tmp_path, "moebench", MOE_EXPERTS="8 32")
    assert modules.split()[1:4] == [
        "-m",
        "scripts.bench.moe_experts",
        str(tmp_path / "work/p-main"),
    ]
    assert " --experts 8 32 " in f"{modules} " and option(modules, "--json").endswith(".jsonl")
    assert gemms.split()[1:3] == ["-m", "scripts.bench.grouped_gemm"]
    assert " --experts 8 32" in gemms


def test_par4_runs_each_layout_against_the_same_one_without_cp_on_every_ref(
    tmp_path: Path,
) -> None:
    calls = run_stage(tmp_path, "par4", REFS="core_v0.19.0 main")
    trains = [c for c in calls if " -m scripts.training.train_small " in c]
    layouts = [
        (option(c, "--nproc"), option(c, "--tp"), option(c, "--cp"), " --sp " in c) for c in trains
    ]
    per_ref = [
        ("1", None, None, False),
        ("2", "2", None, True),
        ("4", "2", "2", True),
        ("4", None, "4", False),
    ]
    assert layouts == per_ref * 2 + [("4", None, None, False)]  # MoE on the newest ref only
    trees = [c.split()[3].rsplit("/", 1)[-1] for c in trains]
    assert trees == ["p-core_v0.19.0"] * 4 + ["p-main"] * 5
    assert all(option(c, "--seq-length") == "16384" for c in trains[:8])
    moe = trains[-1]
    assert "--moe-grouped-gemm" in moe and "--use-distributed-optimizer" in moe
    assert option(moe, "--expert-model-parallel-size") == "2"
    summary = (tmp_path / "out/summary.txt").read_text()
    # the stand-in writes no logs here, so no pair can be compared, and none is claimed
    assert "losses vs" not in summary and "unknown run" not in summary


def test_par4_compares_each_cp_layout_with_its_reference_log(tmp_path: Path) -> None:
    out = tmp_path / "out"
    calls = run_stage(tmp_path, "par4", PAR4_RUNS="cp1 tp2 tp2cp2 cp4", FAKE_LOGS="1")
    compares = [c.split()[3:] for c in calls if " -m scripts.training.compare_losses " in c]
    assert compares == [
        [str(out / "par4-tp2-main.log"), str(out / "par4-tp2cp2-main.log")],
        [str(out / "par4-cp1-main.log"), str(out / "par4-cp4-main.log")],
    ]


def test_a_run_that_writes_no_log_is_not_compared_with_an_older_one(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    for name in ("cp1", "tp2", "tp2cp2", "cp4"):  # an earlier session's logs in the same OUT
        (out / f"par4-{name}-main.log").write_text("old")
    calls = run_stage(tmp_path, "par4", PAR4_RUNS="tp2cp2")  # this run fails before logging
    compares = [c.split()[3:] for c in calls if " -m scripts.training.compare_losses " in c]
    assert [str(out / "par4-tp2cp2-main.log")] not in [c[1:] for c in compares]
    assert not (out / "par4-tp2cp2-main.log").exists()


def test_scale4_size_picks_the_preset_the_layouts_train(tmp_path: Path) -> None:
    calls = run_stage(tmp_path, "scale4", REFS="main", SCALE4_SIZE="0.85b", SCALE4_SMOKE="0")
    par4 = [c for c in calls if " -m scripts.training.validate_par4 " in c]
    assert len(par4) == 1 and option(par4[0], "--preset-size") == "0.85b"


def test_scale4_runs_issue_14_and_smokes_four_gpu_checks_on_every_ref(tmp_path: Path) -> None:
    calls = run_stage(tmp_path, "scale4", REFS="core_v0.19.0 main", SCALE4_RUNS="ep4moe")
    par4 = [c for c in calls if " -m scripts.training.validate_par4 " in c]
    smoke = [c for c in calls if "-m megatron_rocm smoke" in c]
    assert [c.split()[3].rsplit("/", 1)[-1] for c in par4] == ["p-core_v0.19.0", "p-main"]
    for call, ref in zip(par4, ("core_v0.19.0", "main")):
        assert option(call, "--runs") == "ep4moe" and option(call, "--iters") == "30"
        assert option(call, "--table").endswith(f"out/scale4-{ref}.md")
        assert option(call, "--preset-size") == "small"
    assert len(smoke) == 2
    only = smoke[0].split("--only ", 1)[1].split(" --json")[0].split()
    assert only == [
        "parallel.tp2_pp2_vpp",
        "parallel.tp2_cp2",
        "parallel.ep4_moe",
        "parallel.dp4_distopt_overlap",
        "training.resume.dp4_distopt",
        "training.resume.tp2_pp2_vpp",
    ]
    pytest.importorskip("torch")  # the smoke checks' registry imports it
    from megatron_rocm.envtools.smoke import checks_parallel, checks_resume

    four = {f"parallel.{m.name}" for m in checks_parallel.MODES if m.world == 4}
    four |= {f"training.resume.{n}" for n, (w, _, _) in checks_resume.SCENARIOS.items() if w == 4}
    assert set(only) == four  # every four-GPU check the smoke suite has, and only those


def test_tiers_applies_installs_and_smokes_every_ref_and_proves_the_fault(tmp_path: Path) -> None:
    work = tmp_path / "tiers"
    calls = run_stage(
        tmp_path,
        "tiers",
        SOURCE="SRC",
        TIERS_REFS="core_v0.19.0 main",
        TIERS_WORK=str(work),
        FAKE_DEST="1",
    )
    verbs = [c.split()[1:4] for c in calls if " -m megatron_rocm " in c]
    per_ref = [["-m", "megatron_rocm", "apply"], ["-m", "megatron_rocm", "install"]]
    smokes = [["-m", "megatron_rocm", "smoke"]] * 4  # the suite and the fault run, per ref
    assert verbs == per_ref * 2 + smokes
    applies = [c for c in calls if " apply " in c]
    assert [option(c, "--source") for c in applies] == ["SRC", "SRC"]
    assert [option(c, "--dest") for c in applies] == [
        str(work / "p-core_v0.19.0"),
        str(work / "p-main"),
    ]
    faults = [c for c in calls if "--only training.resume.1gpu.local" in c]
    assert len(faults) == 2
    distopt = [c for c in calls if " -m scripts.training.validate_distopt_resume " in c]
    assert [c.split()[3] for c in distopt] == [str(work / "p-main")]  # the last ref only


def test_series_applies_then_smokes_the_newest_ref(tmp_path: Path) -> None:
    work = tmp_path / "series"
    (work / "p-main").mkdir(parents=True)
    calls = run_stage(
        tmp_path,
        "series",
        SOURCE="SRC",
        SERIES_REFS="core_v0.19.0 main",
        SERIES_WORK=str(work),
        SKIP_BASIC="1",
        SKIP_THROUGHPUT="1",
    )
    applies = [c for c in calls if " -m megatron_rocm apply " in c]
    assert [option(c, "--ref") for c in applies] == ["core_v0.19.0", "main"]
    smokes = [c for c in calls if " -m megatron_rocm smoke " in c]
    assert [c.split()[4] for c in smokes] == [str(work / "p-main")]


def test_mfu_runs_the_named_runs_samples_clocks_and_times_both_ceilings(tmp_path: Path) -> None:
    smi = tmp_path / "bin/nvidia-smi"
    smi.parent.mkdir()
    smi.write_text(
        f'#!/usr/bin/env bash\necho "$*" > {tmp_path}/smi-args\necho $$ >> {tmp_path}/smi-pids\n'
        "exec sleep 60\n"
    )
    smi.chmod(0o755)
    path = f"{smi.parent}{os.pathsep}{os.environ['PATH']}"
    calls = run_stage(
        tmp_path, "mfu", PATH=path, MFU_RUNS="example distopt-graph", MFU_TRACE="none",
        CUDA_VISIBLE_DEVICES="3,1",
    )  # fmt: skip
    trains = [c for c in calls if "scripts.training.train_small" in c]
    example = "--cross-entropy-loss-fusion --manual-gc --no-create-attention-mask-in-dataloader"
    assert [c.split(" -- ", 1)[1] for c in trains] == [
        example,
        example + " --use-distributed-optimizer --optimizer-cuda-graph",
    ]
    ceilings = [c for c in calls if "scripts.bench.step_ceiling" in c]
    assert [option(c, "--model") for c in ceilings] == ["0.85b", "8b"]
    assert all(option(c, "--sustained") == "10" for c in ceilings)
    summaries = [c for c in calls if "scripts.training.power_summary" in c]
    assert [c.split()[3].rsplit("/", 1)[1] for c in summaries] == [
        "mfu-smi.csv", "ceiling-0.85b-smi.csv", "ceiling-8b-smi.csv",
    ]  # fmt: skip
    assert (tmp_path / "smi-args").read_text().startswith("-i 3 ")  # the runs' GPU
    pids = [int(pid) for pid in (tmp_path / "smi-pids").read_text().split()]
    # each sampler stopped (one killed before it wrote its pid never ran)
    assert pids and not any(_alive(pid) for pid in pids)


def _alive(pid: int, wait: float = 2.0) -> bool:
    """Whether ``pid`` still runs after up to ``wait`` seconds (a killed one is gone by then,
    or a zombie its parent has not reaped yet)."""
    import time

    stat = Path(f"/proc/{pid}/stat")
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        try:
            if ") Z" in stat.read_text():
                return False
        except OSError:
            return False
        time.sleep(0.05)
    return True


# A stand-in for upstream's 8B example with the lines the stage edits (the real one is upstream's
# and is not copied here): it records the command line it would have launched and logs three
# iterations in Megatron's format.
EXAMPLE_8B = "\n".join(
    [
        "GPUS_PER_NODE=8",
        "GLOBAL_BATCH_SIZE=128",
        'DTYPE="fp8"',
        "ARGS=(",
        "    --train-samples 1953125000",
        "    --lr-decay-samples 1949218748",
        "    --lr-warmup-samples 3906252",
        "    --eval-iters 32",
        "    --profile",
        "    --profile-step-start 4",
        "    --profile-step-end 6",
        '    --save "$CHECKPOINT_PATH"',
        '    --load "$CHECKPOINT_PATH" ',  # upstream's line ends in a space
        ")",
        "DTYPE_ARGS=()",
        'if [[ "$DTYPE" == "fp8" ]]; then',
        "    DTYPE_ARGS+=(",
        '        "--fp8-format hybrid"',
        '        "--fp8-param-gather"',
        "    )",
        "fi",
        'echo "$GPUS_PER_NODE $GLOBAL_BATCH_SIZE ${ARGS[@]} ${DTYPE_ARGS[@]}" >> ran.txt',
        "for i in 1 2 3 4 5; do",
        '  echo " iteration $i/ 5 | elapsed time per iteration (ms): $((7000 - i * 100)).0 |'
        ' throughput per GPU (TFLOP/s/GPU): 500.0 | lm loss: 9.0E+00 |"',
        "done",
        "",
    ]
)


def _example_tree(tmp_path: Path, text: str) -> Path:
    """A patched tree holding only the stand-in example."""
    tree = tmp_path / "work/p-main"
    (tree / "examples/llama").mkdir(parents=True)
    (tree / "examples/llama/train_llama3_8b_h100_fp8.sh").write_text(text)
    return tree


@pytest.mark.parametrize("gpus", [2, 8])
def test_example8b_changes_only_the_gpus_and_the_run_length(tmp_path: Path, gpus: int) -> None:
    """Eight GPUs (upstream's own count) change GPUS_PER_NODE to what it already is: the run
    is still made."""
    tree = _example_tree(tmp_path, EXAMPLE_8B)
    run_stage(tmp_path, "example8b", FAKE_GPUS=str(gpus), EX8B_ITERS="10",
              EX8B_RUNS="bf16 fp8 fp8-no-param-gather fp8-tensorwise",
              FAKE_REAL=sys.executable)  # fmt: skip
    batch = 8 * gpus
    box = (
        f"{gpus} {batch} --train-samples {10 * batch} --lr-decay-samples {10 * batch} "
        f"--lr-warmup-samples {2 * batch} --eval-iters 0"
    )
    assert (tree / "ran.txt").read_text().splitlines() == [
        box + " ",  # bf16: no FP8 flag
        box + " --fp8-format hybrid --fp8-param-gather",  # the example's own FP8 flags
        box + " --fp8-format hybrid",  # --fp8-param-gather dropped
        box + " --fp8-format hybrid --fp8-recipe tensorwise --fp8-param-gather",
    ]
    summary = (tmp_path / "out/summary.txt").read_text()
    assert summary.count(f"({gpus} GPUs, global batch {batch}): exit 0") == 4
    # the summary of the log the run wrote: iterations 4 and 5 after the warm-up
    assert summary.count('"median_iter_ms": 6550.0') == 4


def test_example8b_does_not_run_an_example_upstream_has_rewritten(tmp_path: Path) -> None:
    tree = _example_tree(tmp_path, EXAMPLE_8B.replace("--eval-iters 32", "--eval-interval 5"))
    run_stage(tmp_path, "example8b", FAKE_GPUS="4", EX8B_RUNS="bf16 nonsense")
    assert not (tree / "ran.txt").exists()
    assert not (tmp_path / "out/example8b-bf16.sh").exists()  # no half-edited script left
    summary = (tmp_path / "out/summary.txt").read_text()
    assert "example8b-bf16: upstream's example has no line matching '^ *--eval-iters" in summary
    assert "example8b: unknown run nonsense" in summary


@pytest.mark.parametrize("answer", ["1", "", "no GPU"])
def test_example8b_needs_two_gpus(tmp_path: Path, answer: str) -> None:
    tree = _example_tree(tmp_path, EXAMPLE_8B)
    run_stage(tmp_path, "example8b", FAKE_GPUS=answer or " ")
    assert not (tree / "ran.txt").exists()
    assert "example8b: needs 2 GPUs or more" in (tmp_path / "out/summary.txt").read_text()
