"""scripts/training/validate_par4.py without GPUs: the train_small.py command of each layout (and the
pretrain_gpt.py flags train_small.py makes of it), the one-GPU baselines, the resume verdict,
the scaling table, the command line, and a whole run against a stand-in for train_small.py
that prints Megatron-style iteration lines (written here, not copied from upstream)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from megatron_log import iteration_line

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
MASK = "--no-create-attention-mask-in-dataloader"


@pytest.fixture(scope="module")
def vp():
    return importlib.import_module("scripts.training.validate_par4")


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A stand-in Megatron tree: pretrain_gpt.py and an argument parser that has the flag."""
    root = tmp_path / "Megatron-LM"
    (root / "megatron/training").mkdir(parents=True)
    (root / "pretrain_gpt.py").write_text("")
    (root / "megatron/training/arguments.py").write_text(f"group.add_argument('{MASK}')\n")
    return root


def split(cmd: list[str]) -> tuple[list[str], list[str]]:
    """(train_small.py options, pretrain_gpt.py flags after the lone --)."""
    i = cmd.index("--")
    return cmd[:i], cmd[i + 1 :]


LAYOUT_OPTIONS = {
    "tp2pp2vpp": "--nproc 4 --tp 2 --sp --pp 2 --vpp 2 --cp 1 --seq-length 1024 "
    "--micro-batch-size 1 --global-batch-size 8",
    "tp2cp2": "--nproc 4 --tp 2 --sp --pp 1 --vpp 1 --cp 2 --seq-length 16384 "
    "--micro-batch-size 1 --global-batch-size 8",
    "ep4moe": "--nproc 4 --tp 1 --pp 1 --vpp 1 --cp 1 --seq-length 1024 "
    "--micro-batch-size 8 --global-batch-size 32",
    "dp4distopt": "--nproc 4 --tp 1 --pp 1 --vpp 1 --cp 1 --seq-length 1024 "
    "--micro-batch-size 8 --global-batch-size 32",
}
MOE = [
    "--num-experts=8",
    "--expert-model-parallel-size=4",
    "--moe-grouped-gemm",
    "--moe-token-dispatcher-type=alltoall",
    "--moe-router-topk=2",
    "--moe-aux-loss-coeff=1e-2",
]
LAYOUT_FLAGS = {
    "tp2pp2vpp": [],
    "tp2cp2": [],
    "ep4moe": MOE,
    "dp4distopt": [
        "--use-distributed-optimizer",
        "--overlap-grad-reduce",
        "--overlap-param-gather",
    ],
}


@pytest.mark.parametrize("name", LAYOUT_OPTIONS)
def test_each_layout_is_a_train_small_command(vp, tree: Path, name: str) -> None:
    step = vp.step(tree, tree / "out", name, vp.layouts()[name], 30, [])
    options, flags = split(step.cmd)
    assert all(isinstance(arg, str) for arg in step.cmd)  # an argument list, never a shell line
    assert options[:3] == [sys.executable, "-m", "scripts.training.train_small"]
    assert options[3:12] == [
        str(tree),
        "--preset",
        "llama",
        "--preset-size",
        "small",
        "--iters",
        "30",
        "--log",
        str(tree / "out" / f"{name}.log"),
    ]
    assert options[12:] == LAYOUT_OPTIONS[name].split()
    assert "--transformer-impl" not in " ".join(step.cmd)  # upstream's default: the TE spec
    assert flags == [*LAYOUT_FLAGS[name], MASK]
    assert step.env == {} and step.out == tree / "out" / f"{name}.out"


def test_the_mask_flag_only_where_the_tree_has_it(vp, tree: Path) -> None:
    (tree / "megatron/training/arguments.py").write_text("")
    step = vp.step(tree, tree, "dp4distopt", vp.layouts()["dp4distopt"], 30, [])
    assert MASK not in step.cmd


EXPECTED_PRETRAIN = {
    "tp2pp2vpp": [
        "--tensor-model-parallel-size=2",
        "--sequence-parallel",
        "--pipeline-model-parallel-size=2",
        "--num-layers-per-virtual-pipeline-stage=3",
        "--micro-batch-size=1",
        "--global-batch-size=8",
    ],
    "tp2cp2": [
        "--tensor-model-parallel-size=2",
        "--context-parallel-size=2",
        "--seq-length=16384",
        "--max-position-embeddings=16384",
        "--global-batch-size=8",
    ],
    "ep4moe": ["--expert-model-parallel-size=4", "--global-batch-size=32"],
    "dp4distopt": ["--use-distributed-optimizer", "--global-batch-size=32"],
}


@pytest.mark.parametrize("name", EXPECTED_PRETRAIN)
def test_train_small_turns_each_command_into_the_layouts_flags(
    vp, tree: Path, capsys, name: str
) -> None:
    """The real train_small.py, --dry-run: the pretrain_gpt.py flags the layout means."""
    options, flags = split(vp.step(tree, tree, name, vp.layouts()[name], 30, []).cmd)
    train_small = sys.modules["scripts.training.train_small"]  # the module validate_par4 imported
    assert train_small.main([*options[3:], "--dry-run", "--", *flags]) == 0
    shown = capsys.readouterr().out.split()
    pretrain = shown[shown.index("pretrain_gpt.py") + 1 :]
    assert set(EXPECTED_PRETRAIN[name]) <= set(pretrain)
    assert "--nproc-per-node=4" in shown and "--standalone" in shown
    assert not [a for a in pretrain if a.startswith("--transformer-impl")]


@pytest.mark.parametrize(
    ("name", "seq", "micro", "batch", "flags"),
    [
        ("tp2pp2vpp", 1024, 1, 8, []),
        ("tp2cp2", 16384, 1, 8, []),
        ("ep4moe", 1024, 8, 8, [f.replace("=4", "=1") for f in MOE]),
        ("dp4distopt", 1024, 8, 8, []),
    ],
)
def test_the_baseline_is_the_same_model_on_one_gpu(vp, name, seq, micro, batch, flags) -> None:
    """Same sequence, micro-batch and batch per data-parallel replica; no parallelism; the
    MoE baseline keeps its 8 experts and grouped GEMM at EP1."""
    one = vp.baseline(vp.layouts()[name])
    assert one.name == f"{name}-1gpu"
    assert (one.nproc, one.tp, one.pp, one.vpp, one.cp, one.ep, one.sp) == (1, 1, 1, 1, 1, 1, False)
    assert (one.seq_length, one.micro, one.batch, list(one.flags)) == (seq, micro, batch, flags)
    assert not one.resume


LARGE_PRETRAIN = {
    "tp2pp2vpp": [
        "--num-layers=24",
        "--num-layers-per-virtual-pipeline-stage=6",
        "--seq-length=2048",
        "--micro-batch-size=8",
        "--global-batch-size=64",
    ],
    "tp2cp2": ["--context-parallel-size=2", "--seq-length=16384", "--micro-batch-size=1"],
    "ep4moe": [
        "--expert-model-parallel-size=4",
        "--moe-ffn-hidden-size=1376",
        "--micro-batch-size=8",
        "--global-batch-size=32",
    ],
    "dp4distopt": ["--use-distributed-optimizer", "--micro-batch-size=8", "--global-batch-size=32"],
}


@pytest.mark.parametrize("name", LARGE_PRETRAIN)
def test_the_large_layouts_train_the_0_85b_llama_in_micro_batches_of_16k_tokens(
    vp, tree: Path, capsys, name: str
) -> None:
    """--preset-size 0.85b: the real train_small.py, --dry-run, makes the 0.85B model's flags
    with micro-batches of 16k tokens per rank (its step at micro-batch 2 is host-bound)."""
    layout = vp.layouts("0.85b")[name]
    options, flags = split(vp.step(tree, tree, name, layout, 30, []).cmd)
    assert options[4:8] == ["--preset", "llama", "--preset-size", "0.85b"]
    train_small = sys.modules["scripts.training.train_small"]
    assert train_small.main([*options[3:], "--dry-run", "--", *flags]) == 0
    shown = capsys.readouterr().out.split()
    pretrain = set(shown[shown.index("pretrain_gpt.py") + 1 :])
    assert set(LARGE_PRETRAIN[name]) <= pretrain
    assert "--hidden-size=1536" in pretrain
    assert layout.seq_length * layout.micro == 16384


@pytest.mark.parametrize(
    ("name", "seq", "micro", "batch", "moe"),
    [
        ("tp2pp2vpp", 2048, 8, 64, False),
        ("tp2cp2", 16384, 1, 8, False),
        ("ep4moe", 2048, 8, 8, True),
        ("dp4distopt", 2048, 8, 8, False),
    ],
)
def test_the_large_baselines_are_the_same_0_85b_model_on_one_gpu(
    vp, name, seq, micro, batch, moe
) -> None:
    one = vp.baseline(vp.layouts("0.85b")[name])
    assert (one.size, one.nproc, one.tp, one.pp, one.cp, one.ep) == ("0.85b", 1, 1, 1, 1, 1)
    assert (one.seq_length, one.micro, one.batch) == (seq, micro, batch)
    expected = [f.replace("=4", "=1") for f in MOE] + ["--moe-ffn-hidden-size=1376"]
    assert list(one.flags) == (expected if moe else [])


def test_a_dry_run_of_the_large_layouts_names_their_preset(vp, tree: Path, capsys) -> None:
    assert vp.main([str(tree), "--preset-size", "0.85b", "--no-resume", "--dry-run"]) == 0
    steps = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(steps) == 8  # four baselines, four layouts
    for step in steps:
        options = split(step["cmd"])[0]
        assert options[options.index("--preset-size") + 1] == "0.85b"


def test_an_unknown_preset_size_is_refused(vp, tree: Path, capsys) -> None:
    with pytest.raises(ValueError, match="no par4 layouts for preset size 'gpt'"):
        vp.layouts("gpt")
    with pytest.raises(SystemExit) as exit_:
        vp.main([str(tree), "--preset-size", "70b-slice", "--dry-run"])
    assert exit_.value.code == 2
    assert "invalid choice: '70b-slice'" in capsys.readouterr().err


def test_the_table_names_the_preset_it_trained(vp) -> None:
    large = [{**r, "preset_size": "0.85b"} for r in RECORDS]
    first = vp.render_table(large, [], "4 x NVIDIA H100 80GB HBM3", 30).splitlines()[0]
    assert "0.85b Llama (24 layers, hidden 1536)" in first
    small = vp.render_table(RECORDS, [], "unknown", 30).splitlines()[0]
    assert "small Llama (12 layers, hidden 768)" in small


def losses_log(first: int, last: int, loss=lambda i: 10 - i / 10) -> list[str]:
    return [iteration_line(i, last, float(loss(i)), batch=8) for i in range(first, last + 1)]


def test_a_resumed_run_is_judged_from_the_save_iteration_on(vp) -> None:
    straight = vp.losses(losses_log(1, 30))
    verdict = vp.compare_resumed(straight, 0, losses_log(16, 30), 15, averaged=False)
    assert verdict["status"] == "pass"
    assert verdict["detail"] == "iterations 16-30 bit-exact as printed"
    assert len(verdict["straight"]) == len(verdict["resumed"]) == 15

    drifted = losses_log(16, 30, loss=lambda i: (10 - i / 10) * (1.001 if i == 20 else 1))
    verdict = vp.compare_resumed(straight, 0, drifted, 15, averaged=False)
    assert verdict["status"] == "fail" and "max rel 1.0e-03" in verdict["detail"]

    # a run B that restarted from scratch (the checkpoint was not loaded)
    verdict = vp.compare_resumed(straight, 0, losses_log(1, 30), 15, averaged=False)
    assert verdict["status"] == "fail" and verdict["detail"].startswith("run B")


def test_a_resumed_run_that_exits_non_zero_fails_even_with_every_loss(vp) -> None:
    straight = vp.losses(losses_log(1, 30))
    crashed = [*losses_log(16, 30), "RuntimeError: NCCL watchdog timeout"]
    verdict = vp.compare_resumed(straight, 1, crashed, 15, averaged=False)
    assert verdict["status"] == "fail"
    assert verdict["detail"] == "run B (fresh process, load): RuntimeError: NCCL watchdog timeout"
    # train_small's verdict that half a run's loss did not fall is no failed resume
    flat = json.dumps(
        {"ok": False, "problems": ["loss did not decrease (first 3: 8.1, last 3: 8.2)"]}
    )
    verdict = vp.compare_resumed(straight, 1, [*losses_log(16, 30), flat], 15, averaged=False)
    assert verdict["status"] == "pass", verdict
    # ... but for run A, the 30-iteration training, it is
    assert vp.run_problem(1, [flat]).startswith("loss did not decrease")
    assert vp.run_problem(0, [flat]) is None


RECORDS = [
    {"run": "tp2pp2vpp-1gpu", "role": "baseline", "tokens_per_s": 100000.0},
    {
        "run": "tp2pp2vpp",
        "role": "layout",
        "megatron_version": "0.19.0",
        "nproc": 4,
        "ok": True,
        "problems": [],
        "first_loss": 10.4321,
        "last_loss": 7.0123,
        "tokens_per_s": 300000.0,
        "tokens_per_s_per_gpu": 75000.0,
    },
    {
        "run": "tp2cp2",
        "role": "layout",
        "megatron_version": "0.19.0",
        "nproc": 4,
        "ok": False,
        "problems": ["training exited with status 1", "torch.OutOfMemoryError: CUDA | oom"],
        "first_loss": None,
        "last_loss": None,
        "tokens_per_s": None,
        "tokens_per_s_per_gpu": None,
    },
]


def test_the_table_has_a_row_per_layout_and_names_the_gpu(vp) -> None:
    verdicts = [{"resume": "tp2pp2vpp", "status": "pass", "detail": "iterations 16-30 ..."}]
    table = vp.render_table(RECORDS, verdicts, "4 x NVIDIA H100 80GB HBM3", 30).splitlines()
    assert table[0].startswith("GPU: 4 x NVIDIA H100 80GB HBM3. Megatron-LM core 0.19.0")
    assert table[2] == (
        "| layout | GPUs | tokens/s per GPU | one-GPU tokens/s | per-GPU vs one GPU "
        "| losses first→last | resume verdict |"
    )
    assert table[4] == "| tp2pp2vpp | 4 | 75,000 | 100,000 | 0.75x | 10.432→7.012 | pass |"
    # a failed run says why; a | in the message must not break the row
    assert table[5] == (
        "| tp2cp2 | 4 | - | - | - | FAIL: training exited with status 1; "
        "torch.OutOfMemoryError: CUDA / oom | - |"
    )
    assert len(table) == 6


def test_a_failed_resume_shows_its_reason(vp) -> None:
    verdicts = [{"resume": "tp2pp2vpp", "status": "fail", "detail": "resumed losses differ"}]
    row = vp.render_table(RECORDS[:2], verdicts, "unknown", 30).splitlines()[4]
    assert row.endswith("| fail: resumed losses differ |")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--runs", "tp2pp2vpp,pp4"], "unknown runs ['pp4']"),
        (["--runs", ","], "unknown runs"),
        (["--iters", "3"], "--iters must be 4 or more"),
        (["--run-timeout", "0"], "--run-timeout must be positive"),
    ],
)
def test_bad_input_exits_2_with_one_line(vp, tree: Path, capsys, args, message) -> None:
    assert vp.main([str(tree), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_a_tree_without_pretrain_gpt_is_bad_input(vp, tmp_path: Path, capsys) -> None:
    assert vp.main([str(tmp_path), "--dry-run"]) == 2
    assert "has no pretrain_gpt.py" in capsys.readouterr().err


def test_too_few_visible_gpus_is_bad_input(vp, tree: Path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert vp.main([str(tree), "--dry-run"]) == 2
    assert "fewer than the 4 GPUs" in capsys.readouterr().err


def test_a_dry_run_prints_every_command_in_order(vp, tree: Path, capsys, monkeypatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    out = tree / "out"
    assert vp.main([str(tree), "--out", str(out), "--dry-run"]) == 0
    steps = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [s["step"] for s in steps] == [
        "tp2pp2vpp-1gpu",
        "tp2cp2-1gpu",
        "ep4moe-1gpu",
        "dp4distopt-1gpu",
        "tp2pp2vpp",
        "tp2pp2vpp-resume-A",
        "tp2pp2vpp-stage",
        "tp2pp2vpp-resume-B",
        "tp2cp2",
        "ep4moe",
        "dp4distopt",
        "dp4distopt-resume-A",
        "dp4distopt-stage",
        "dp4distopt-resume-B",
    ]
    # the baselines run together, one GPU each
    assert [s["env"] for s in steps[:4]] == [{"CUDA_VISIBLE_DEVICES": str(i)} for i in range(4)]
    assert all(s.get("together") for s in steps[:4])
    run_a, stage, run_b = steps[5:8]
    deterministic = {"NCCL_ALGO": "Ring", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    assert run_a["env"] == run_b["env"] == deterministic
    assert split(run_a["cmd"])[1][-3:] == [
        "--deterministic-mode",
        f"--save={out}/tp2pp2vpp-ckpt-A",
        "--save-interval=15",
    ]
    assert stage == {
        "step": "tp2pp2vpp-stage",
        "copy": f"{out}/tp2pp2vpp-ckpt-A/iter_0000015",
        "to": f"{out}/tp2pp2vpp-ckpt-B",
    }
    assert split(run_b["cmd"])[1][-2:] == ["--deterministic-mode", f"--load={out}/tp2pp2vpp-ckpt-B"]
    assert not out.exists()  # a dry run writes nothing


def test_a_dry_run_honours_runs_and_the_switches(vp, tree: Path, capsys) -> None:
    args = [str(tree), "--runs", "dp4distopt,tp2cp2", "--no-resume", "--no-baselines"]
    assert vp.main([*args, "--dry-run", "--iters", "8"]) == 0
    steps = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [s["step"] for s in steps] == ["dp4distopt", "tp2cp2"]
    assert steps[0]["cmd"][steps[0]["cmd"].index("--iters") + 1] == "8"


def test_it_imports_and_names_no_gpu_without_torch() -> None:
    """CI jobs without torch import the script; torch is only looked for to name the GPU."""
    code = (
        "import sys; sys.modules['torch'] = None; "
        "from scripts.training import validate_par4; "
        "assert 'torch' not in [m for m in sys.modules if sys.modules[m]]; "
        "print(validate_par4.gpu_names())"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=SCRIPTS.parent,
    )
    assert done.stdout.strip() == "[]"


# A stand-in for train_small.py: Megatron-style iteration lines (loss 10 - i/10), a checkpoint
# folder at each save interval, a resume from the staged checkpoint, and the JSON summary.
FAKE_TRAIN_SMALL = r"""
import json, os, sys
from pathlib import Path
argv = sys.argv[1:]
opt = lambda name: argv[argv.index(name) + 1]
extra = argv[argv.index("--") + 1:]
flag = lambda key: next((a.split("=", 1)[1] for a in extra if a.startswith(key + "=")), None)
iters, log, nproc = int(opt("--iters")), Path(opt("--log")), int(opt("--nproc"))
if log.stem in os.environ.get("FAKE_FAIL", "").split(","):
    print("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.")
    sys.exit(1)
begin = 1
if flag("--load"):
    begin = int((Path(flag("--load")) / "latest_checkpointed_iteration.txt").read_text()) + 1
lines = []
for i in range(begin, iters + 1):
    lines.append(f" iteration {i:>8}/{iters:>8} | elapsed time per iteration (ms): 100.0 | "
                 f"lm loss: {10 - i / 10:.6E} |")
    if flag("--save") and i % int(flag("--save-interval")) == 0:
        (Path(flag("--save")) / f"iter_{i:07d}").mkdir(parents=True)
log.write_text("\n".join(lines) + "\n")
print("\n".join(lines))
tokens = int(opt("--global-batch-size")) * int(opt("--seq-length")) / 0.1
print(json.dumps({
    "megatron_version": "0.19.0", "iterations": len(lines), "first_loss": 10 - begin / 10,
    "last_loss": 10 - iters / 10, "median_iter_ms": 100.0, "mean_iter_ms": 100.0,
    "tokens_per_s_at_median": tokens, "log": str(log), "ok": True, "problems": [],
    "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
}))
"""


@pytest.fixture
def fake_runs(vp, tree: Path, tmp_path: Path, monkeypatch) -> Path:
    fake = tmp_path / "fake_train_small.py"
    fake.write_text(FAKE_TRAIN_SMALL)
    monkeypatch.setattr(vp, "TRAIN_SMALL", [str(fake)])
    monkeypatch.setattr(vp, "gpu_names", lambda: ["Fake GPU"] * 4)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("FAKE_FAIL", raising=False)
    return tmp_path / "out"


def test_a_whole_run_reports_each_run_the_verdicts_and_the_table(
    vp, tree: Path, fake_runs: Path, capsys
) -> None:
    assert vp.main([str(tree), "--out", str(fake_runs)]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    runs = {x["run"]: x for x in lines if "run" in x}
    verdicts = {x["resume"]: x for x in lines if "resume" in x}
    assert len(runs) == 8 and all(x["ok"] for x in runs.values())
    assert runs["dp4distopt"]["tokens_per_s_per_gpu"] == 32 * 1024 / 0.1 / 4
    assert runs["ep4moe"]["megatron_version"] == "0.19.0" and runs["ep4moe"]["ep"] == 4
    for name in ("tp2pp2vpp", "dp4distopt"):
        assert verdicts[name]["status"] == "pass", verdicts[name]
        assert verdicts[name]["detail"] == "iterations 16-30 bit-exact as printed"
    # the resume run read the checkpoint of iteration 15 alone, staged beside run A's
    staged = sorted(p.name for p in (fake_runs / "tp2pp2vpp-ckpt-B").iterdir())
    assert staged == ["iter_0000015", "latest_checkpointed_iteration.txt"]
    assert lines[-1] == {
        "result": "pass",
        "gpu": "4 x Fake GPU",
        "table": str(fake_runs / "par4-table.md"),
    }
    table = (fake_runs / "par4-table.md").read_text()
    assert "GPU: 4 x Fake GPU." in table
    assert "| dp4distopt | 4 | 81,920 | 81,920 | 1.00x | 9.900→7.000 | pass |" in table
    assert "| tp2cp2 | 4 | 327,680 | 1,310,720 | 0.25x | 9.900→7.000 | - |" in table
    # each baseline had a GPU of its own
    outs = [(fake_runs / f"{n}-1gpu.out").read_text().splitlines()[-1] for n in vp.layouts()]
    assert sorted(json.loads(o)["visible"] for o in outs) == ["0", "1", "2", "3"]


def test_a_failed_run_does_not_stop_the_others(
    vp, tree: Path, fake_runs: Path, capsys, monkeypatch
) -> None:
    monkeypatch.setenv("FAKE_FAIL", "tp2cp2,dp4distopt-resume-A")
    table = fake_runs / "t.md"
    args = [str(tree), "--out", str(fake_runs), "--no-baselines", "--table", str(table)]
    assert vp.main(args) == 1
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    runs = {x["run"]: x for x in lines if "run" in x}
    assert sorted(runs) == ["dp4distopt", "ep4moe", "tp2cp2", "tp2pp2vpp"]
    assert runs["tp2cp2"]["ok"] is False
    assert runs["tp2cp2"]["problems"] == [
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB."
    ]
    verdict = next(x for x in lines if x.get("resume") == "dp4distopt")
    assert verdict["status"] == "fail" and verdict["detail"].startswith("run A (train + save)")
    assert lines[-1]["result"] == "fail"
    assert "| tp2cp2 | 4 | - | - | - | FAIL: torch.OutOfMemoryError" in table.read_text()


def test_a_hung_run_is_stopped_and_named(vp, tree: Path, tmp_path: Path) -> None:
    sleeper = tmp_path / "sleeper.py"
    sleeper.write_text(
        "import time\nprint('iteration 3 of a stuck run', flush=True)\ntime.sleep(600)\n"
    )
    step = vp.Step("stuck", [sys.executable, str(sleeper)], {}, tmp_path / "stuck.out")
    [(rc, lines)] = vp.run_steps([step], timeout=2)
    record = vp.record(vp.layouts()["tp2cp2"], "layout", rc, lines)
    assert record["ok"] is False
    assert record["problems"] == ["hung: no end after 2 s; last line: iteration 3 of a stuck run"]


def test_a_run_stopped_from_outside_leaves_the_table_of_what_finished(
    vp, tree: Path, fake_runs: Path, monkeypatch
) -> None:
    real = vp.run_steps

    def stopped_at_ep4moe(steps, timeout):
        if any(s.name == "ep4moe" for s in steps):
            raise KeyboardInterrupt  # a machine's time limit, Ctrl-C
        return real(steps, timeout)

    monkeypatch.setattr(vp, "run_steps", stopped_at_ep4moe)
    with pytest.raises(KeyboardInterrupt):
        vp.main([str(tree), "--out", str(fake_runs), "--no-resume"])
    table = (fake_runs / "par4-table.md").read_text()
    assert "| tp2pp2vpp | 4 |" in table and "| tp2cp2 | 4 |" in table
    assert "ep4moe" not in table
