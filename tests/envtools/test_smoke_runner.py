"""The smoke runner without torch: registry selection, pass/fail/skip, JSON and JUnit output."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from megatron_rocm.commands import smoke as smoke_cmd
from megatron_rocm.envtools.smoke import catalog, report, runner
from megatron_rocm.errors import SourceError, UsageError


def _pass(ctx: runner.Context) -> str:
    return "fine"


def _fail(ctx: runner.Context) -> str:
    raise runner.CheckFailed("kernel differs from reference")


def _crash(ctx: runner.Context) -> str:
    return {}["missing"]


def _gpu(ctx: runner.Context) -> str:
    ctx.needs_gpu(2, "collectives")
    return "ran"


CHECKS = {
    c.name: c
    for c in (
        runner.Check("kernels.a", _pass),
        runner.Check("kernels.b", _fail),
        runner.Check("training.x", _crash),
        runner.Check("collectives.y", _gpu),
    )
}


def ctx(gpus: int = 0) -> runner.Context:
    return runner.Context(
        tree=None, device="cuda" if gpus else "cpu", gpu_count=gpus, log=lambda _: None
    )


def test_statuses_details_and_timing() -> None:
    results = runner.run_checks(ctx(), list(CHECKS.values()))
    assert [(r.name, r.status) for r in results] == [
        ("kernels.a", "pass"),
        ("kernels.b", "fail"),
        ("training.x", "fail"),
        ("collectives.y", "skip"),
    ]
    assert results[1].detail.startswith("kernel differs from reference")
    assert results[2].detail.startswith("KeyError: 'missing'")  # unexpected errors name their type
    assert results[3].detail == "collectives needs 2 GPUs; no GPU visible"
    assert all(r.seconds >= 0 for r in results)


def test_gpu_check_runs_when_gpus_exist() -> None:
    (res,) = runner.run_checks(ctx(gpus=2), [CHECKS["collectives.y"]])
    assert res.status == "pass"
    (res,) = runner.run_checks(ctx(gpus=1), [CHECKS["collectives.y"]])
    assert (res.status, res.detail) == ("skip", "collectives needs 2 GPUs; only 1 GPU visible")


@pytest.mark.parametrize(
    ("only", "names"),
    [
        (None, ["kernels.a", "kernels.b", "training.x", "collectives.y"]),
        (["kernels"], ["kernels.a", "kernels.b"]),
        (["collectives.y", "kernels.a"], ["kernels.a", "collectives.y"]),  # suite order kept
    ],
)
def test_select(only, names) -> None:
    assert [c.name for c in runner.select(CHECKS, only)] == names


def test_select_unknown_is_usage_error() -> None:
    with pytest.raises(UsageError, match="no smoke check matches 'kern'"):
        runner.select(CHECKS, ["kern"])  # a prefix must end at a dot


def test_a_tree_swallowed_by_only_is_named_as_such(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "Megatron-LM").mkdir()
    with pytest.raises(UsageError, match="give the tree first .megatron-rocm smoke Megatron-LM"):
        runner.select(CHECKS, ["kernels", "Megatron-LM"])


def test_registry_has_the_whole_suite() -> None:
    pytest.importorskip("torch")  # the check modules import torch
    names = list(catalog.load_checks())
    assert names[0].startswith("imports.") and names[-1].startswith("throughput.")
    assert names[-2].startswith("parallel.")  # the opt-in throughput probe comes last
    assert {
        "kernels.softmax.causal",
        "kernels.softmax.masked",
        "kernels.softmax.scaled",
        "kernels.local_sdpa",
        "training.llama.local",
        "training.llama.te",
        "training.resume.dp2_distopt.local",
        "collectives.tensor_parallel",
        "parallel.ep2_moe.te",
        "parallel.megatron_fsdp.local",
        "throughput.mlp",
    } <= set(names)


def _report() -> runner.Report:
    rep = runner.Report(device="cpu", torch="2.13.0+cpu")
    rep.checks = runner.run_checks(ctx(), list(CHECKS.values()))
    return rep


def test_json_report_shape() -> None:
    data = json.loads(report.to_json(_report()))
    assert set(data) == {"device", "torch", "checks"}
    assert set(data["checks"][0]) == {"name", "status", "seconds", "detail"}


def test_junit_report_is_valid() -> None:
    suite = ET.fromstring(report.to_junit(_report()))
    assert suite.tag == "testsuite"
    assert (suite.get("tests"), suite.get("failures"), suite.get("skipped")) == ("4", "2", "1")
    cases = {c.get("name"): c for c in suite.iter("testcase")}
    assert cases["kernels.b"].find("failure").get("message").startswith("kernel differs")
    assert cases["collectives.y"].find("skipped") is not None
    assert cases["kernels.a"].find("failure") is None and cases["kernels.a"].find("skipped") is None


def test_write_both_files(tmp_path: Path) -> None:
    report.write(_report(), str(tmp_path / "a/r.json"), str(tmp_path / "b/r.xml"))
    assert json.loads((tmp_path / "a/r.json").read_text())["device"] == "cpu"
    ET.parse(tmp_path / "b/r.xml")


def test_smoke_refuses_too_few_steps() -> None:
    with pytest.raises(UsageError, match="--steps"):
        smoke_cmd.smoke(steps=2)


def test_smoke_without_torch(monkeypatch) -> None:
    monkeypatch.setattr(smoke_cmd, "import_torch", lambda: (None, None))
    with pytest.raises(SourceError, match="rocm"):
        smoke_cmd.smoke()


def test_smoke_says_a_dir_that_is_not_one_before_a_missing_torch(tmp_path, monkeypatch) -> None:
    """Bad input (exit 2) comes before what the machine lacks (exit 3)."""
    monkeypatch.setattr(smoke_cmd, "import_torch", lambda: (None, None))
    (tmp_path / "afile").write_text("x\n")
    for missing in (tmp_path / "afile", tmp_path / "nowhere"):
        with pytest.raises(UsageError, match="not a Megatron-LM tree"):
            smoke_cmd.smoke(str(missing))
    with pytest.raises(UsageError, match="DIR is empty"):
        smoke_cmd.smoke("")


def test_tree_required_only_by_tree_checks(tmp_path: Path) -> None:
    kernels = [runner.Check("kernels.a", _pass)]
    assert smoke_cmd._tree_for(kernels, str(tmp_path)) is None
    with pytest.raises(UsageError, match="not a Megatron-LM tree.*--only kernels"):
        smoke_cmd._tree_for([runner.Check("imports.megatron_core", _pass)], str(tmp_path))


def test_a_tree_the_kernel_checks_cannot_read_is_left_out_with_a_note(
    tmp_path: Path, capsys
) -> None:
    """A Megatron tree with a malformed pyproject.toml is not silently dropped: the kernels
    run without it and the user is told why (the tree checks refuse it, exit 2)."""
    (tmp_path / "megatron/core").mkdir(parents=True)
    (tmp_path / "megatron/core/package_info.py").write_text("MAJOR, MINOR, PATCH = 0, 16, 0\n")
    (tmp_path / "pyproject.toml").write_text("[project\n")
    kernels = [runner.Check("kernels.a", _pass)]
    assert smoke_cmd._tree_for(kernels, str(tmp_path)) is None
    err = capsys.readouterr().err
    assert err.startswith("note: not using the tree: ") and "malformed TOML" in err
    with pytest.raises(UsageError, match="malformed TOML"):
        smoke_cmd._tree_for([runner.Check("imports.megatron_core", _pass)], str(tmp_path))


def _tree(tmp_path: Path, scope: list[str]) -> Path:
    import subprocess

    tree = tmp_path / "tree"
    (tree / "megatron/core").mkdir(parents=True)
    subprocess.run(["git", "init", "-q", str(tree)], check=True)
    for s in scope:
        subprocess.run(["git", "config", "--add", "megatron-rocm.scope", s], cwd=tree, check=True)
    return tree


@pytest.mark.parametrize("check", ["pretrain_gpt", "megatron_training"])
def test_sdist_tree_skips_what_the_sdist_does_not_ship(tmp_path: Path, check: str) -> None:
    from megatron_rocm.envtools.smoke import checks_imports

    tree = _tree(tmp_path, ["megatron/core", "megatron/training"])
    context = runner.Context(tree=tree, device="cpu", gpu_count=0, log=lambda _: None)
    with pytest.raises(runner.Skip, match="came from a megatron-core sdist"):
        getattr(checks_imports, check)(context)


def test_full_clone_without_pretrain_gpt_fails(tmp_path: Path) -> None:
    from megatron_rocm.envtools.smoke import checks_imports

    context = runner.Context(tree=_tree(tmp_path, []), device="cpu", gpu_count=0, log=print)
    with pytest.raises(runner.CheckFailed, match="pretrain_gpt.py does not exist"):
        checks_imports.pretrain_gpt(context)


def test_smoke_says_a_torch_that_does_not_import(monkeypatch) -> None:
    monkeypatch.setattr(smoke_cmd, "import_torch", lambda: (None, "RuntimeError: HIP error"))
    with pytest.raises(SourceError, match=r"installed but does not import \(RuntimeError"):
        smoke_cmd.smoke()


def test_one_path_for_both_reports_is_refused_before_the_run(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError, match="--json and --junit name the same file"):
        smoke_cmd.smoke(json_file="same.out", junit_file="./same.out")
    assert not (tmp_path / "same.out").exists()
