"""scripts/upstream_unit_tests.py: reading JUnit XML and the per-rank progress logs, the
per-file JSON/markdown, the before/after comparison, the CLI's bad-input handling, and one real
run (torchrun + pytest on the CPU) over a toy tree whose tests pass, fail, skip, crash their
process; the watchdog on a silent process. Every XML, log and test here is written for this file; none is upstream's."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import sys
import textwrap
import time
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


@pytest.fixture(scope="module")
def ut():
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))
    return importlib.import_module("upstream_unit_tests")


@pytest.fixture(scope="module")
def results(ut):
    return importlib.import_module("upstream_tests.results")


@pytest.fixture(scope="module")
def report(ut):
    return importlib.import_module("upstream_tests.report")


JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="2" failures="1" skipped="1" tests="5">
 <testcase classname="tests.unit_tests.transformer.test_attn.TestAttn" name="test_fwd[tp2]"
   file="tests/unit_tests/transformer/test_attn.py" line="10" time="0.50"/>
 <testcase classname="tests.unit_tests.transformer.test_attn.TestAttn" name="test_bwd"
   file="tests/unit_tests/transformer/test_attn.py" line="20" time="0.25">
  <failure message="TypeError: 'NoneType' object is not callable&#10;more text">trace</failure>
 </testcase>
 <testcase classname="tests.unit_tests.transformer.test_attn" name="test_plain"
   file="tests/unit_tests/transformer/test_attn.py" line="30" time="0.1">
  <skipped type="pytest.skip" message="Skipped: needs TE">reason</skipped>
 </testcase>
 <testcase classname="tests.unit_tests.tensor_parallel.test_layers" name="test_tp"
   file="tests/unit_tests/tensor_parallel/test_layers.py" time="0.2">
  <error message="failed on setup with &quot;RuntimeError: world_size (2) is not divisible by 4&quot;">x</error>
 </testcase>
 <testcase classname="" name="tests.unit_tests.fusions.test_rms" time="0">
  <error message="collection failure">ModuleNotFoundError: No module named 'transformer_engine'</error>
 </testcase>
</testsuite></testsuites>
"""


def test_junit_gives_node_ids_outcomes_and_one_line_causes(results, tmp_path: Path) -> None:
    path = tmp_path / "j.xml"
    path.write_text(JUNIT)
    got, errors = results.read_junit(path)
    attn = "tests/unit_tests/transformer/test_attn.py"
    assert got[f"{attn}::TestAttn::test_fwd[tp2]"].outcome == "passed"
    assert got[f"{attn}::TestAttn::test_bwd"].outcome == "failed"
    assert (
        got[f"{attn}::TestAttn::test_bwd"].message == "TypeError: 'NoneType' object is not callable"
    )
    assert got[f"{attn}::test_plain"].outcome == "skipped"
    assert got[f"{attn}::test_plain"].message == "needs TE"
    assert got["tests/unit_tests/tensor_parallel/test_layers.py::test_tp"].outcome == "error"
    assert errors == {"tests/unit_tests/fusions/test_rms.py": "collection failure"}
    assert len(got) == 4


def test_junit_without_file_attribute_finds_the_module(results, tmp_path: Path) -> None:
    path = tmp_path / "j.xml"
    path.write_text(JUNIT.replace(' file="tests/unit_tests/transformer/test_attn.py"', ""))
    got, _ = results.read_junit(path)
    assert "tests/unit_tests/transformer/test_attn.py::TestAttn::test_bwd" in got


@pytest.mark.parametrize(
    "message, nproc, needed",
    [
        ("RuntimeError: world_size (2) is not divisible by 4", 2, 4),
        ("RuntimeError: world_size (1) is not divisible by 2", 1, 2),
        ("world_size (2) is not divisible by expert_tensor_model_pipeline_parallel size (8)", 2, 8),
        ("Test requires world_size=8, but got 2", 2, 8),
        ("TP2+CP2 parity requires at least 4 distributed ranks", 2, 4),
        ("requires at least 2 ranks", 2, None),  # the run had them: a real skip/failure
        ("AssertionError: assert 4 == 2", 2, None),
    ],
)
def test_gpus_needed(results, message: str, nproc: int, needed) -> None:
    assert results.gpus_needed(message, nproc) == needed


def _log(path: Path, *events: dict) -> Path:
    path.write_text("".join(json.dumps(e) + "\n" for e in events) + '{"ev": "resu')  # cut by a kill
    return path


def test_a_rank_log_names_the_test_the_process_died_in(results, tmp_path: Path) -> None:
    log = results.read_rank_log(
        _log(
            tmp_path / "r0.jsonl",
            {"ev": "collected", "ids": ["f.py::a", "f.py::b", "f.py::c"], "t": 1},
            {"ev": "start", "id": "f.py::a", "t": 2},
            {"ev": "result", "id": "f.py::a", "outcome": "passed", "t": 3},
            {"ev": "start", "id": "f.py::b", "t": 4},
        )
    )
    assert log.running == "f.py::b" and log.running_since == 4
    assert set(log.results) == {"f.py::a"} and not log.ended
    assert log.collected == ["f.py::a", "f.py::b", "f.py::c"]


def test_a_failure_on_another_rank_fails_the_test(results) -> None:
    R, RankLog = results.Result, results.RankLog
    rank0 = RankLog(None, {"a": R("passed"), "b": R("failed", "x")}, None, None, {}, {}, True, 0)
    rank1 = RankLog(
        None, {"a": R("failed", "boom"), "b": R("failed", "y")}, None, None, {}, {}, True, 0
    )
    merged = results.merge_ranks([rank0, rank1])
    assert merged["a"] == R("failed", "[rank 1] boom")
    assert merged["b"] == R("failed", "x")  # rank 0's own failure stays the one reported


def _doc(report, results, tests: dict[str, tuple[str, str]], errors=None, **meta) -> dict:
    res = {k: results.Result(o, m) for k, (o, m) in tests.items()}
    return report.run_document(
        {"name": "x", "nproc": 2, "complete": True, **meta}, res, errors or {}, {}
    )


def test_run_document_counts_per_file_and_markdown_groups_causes(report, results) -> None:
    doc = report.run_document(
        {"name": "patched", "nproc": 2, "complete": True, "describe": "core_v0.19.0", "patches": 9},
        {
            "tests/unit_tests/a/test_x.py::t1": results.Result("passed"),
            "tests/unit_tests/a/test_x.py::t2": results.Result(
                "failed", "TypeError: at 0x7f01 in 12"
            ),
            "tests/unit_tests/a/test_x.py::t3": results.Result(
                "failed", "TypeError: at 0x9a9a in 40"
            ),
            "tests/unit_tests/a/test_y.py::t1": results.Result("skipped", "no TE"),
        },
        {"tests/unit_tests/a/test_z.py": "ModuleNotFoundError: No module named 'te'"},
        {"tests/unit_tests/a/test_x.py::fp8": "excluded"},
    )
    assert doc["files"]["tests/unit_tests/a/test_x.py"] == {
        "deselected_excluded": 1,
        "failed": 2,
        "passed": 1,
    }
    assert doc["files"]["tests/unit_tests/a/test_z.py"] == {"error": 1}
    assert doc["totals"]["failed"] == 2 and doc["totals"]["error"] == 1
    md = report.run_markdown(doc)
    assert "| a/test_x.py | 1 | 2 | 0 | 0 | 0 | 0 | 1 |" in md
    assert "2 × `TypeError: at 0x… in N` — test_x.py (2)" in md
    assert "collection error in tests/unit_tests/a/test_z.py" in md


def test_compare_counts_a_module_that_did_not_import_as_the_tests_it_hides(report, results) -> None:
    before = _doc(
        report,
        results,
        {"f/test_a.py::t1": ("failed", "TypeError: 'NoneType' object is not callable")},
        {"f/test_b.py": "ImportError: no TE"},
    )
    after = _doc(
        report,
        results,
        {
            "f/test_a.py::t1": ("passed", ""),
            "f/test_b.py::t1": ("passed", ""),
            "f/test_b.py::t2": ("failed", "AssertionError: tolerance"),
            "f/test_b.py::t3": ("needs_gpus", "world_size (2) is not divisible by 4"),
            "f/test_b.py::t4": ("skipped", "needs flash_attn"),
        },
    )
    cmp = report.compare(before, after)
    assert cmp["selection"] == 4 and cmp["needs_more_gpus"] == 1
    assert cmp["files"]["f/test_b.py"]["before"] == {"error": 3}
    assert cmp["files"]["f/test_b.py"]["after"] == {"passed": 1, "failed": 1, "skipped": 1}
    assert cmp["pass_rate_before"] == 0.0 and cmp["pass_rate_after"] == 0.5
    assert cmp["remaining"] == [
        {"cause": "AssertionError: tolerance", "count": 1, "files": {"f/test_b.py": 1}}
    ]
    md = report.compare_markdown(cmp, 2)
    assert "| test_b.py | 3 | 0 / 0 / 3 / 0 | 1 / 1 / 0 / 1 | +1 |" in md.replace("f/", "")
    assert "after **50.0%**" in md and "1 tests that need > 2 GPUs" in md


def test_compare_excludes_a_test_that_needs_more_gpus_in_either_run(report, results) -> None:
    before = _doc(report, results, {"f/t.py::a": ("needs_gpus", "x"), "f/t.py::b": ("passed", "")})
    after = _doc(
        report,
        results,
        {
            "f/t.py::a": ("failed", "TypeError"),
            "f/t.py::b": ("not_run", "wall-clock budget ran out"),
        },
        complete=False,
    )
    cmp = report.compare(before, after)
    assert cmp["selection"] == 1 and cmp["needs_more_gpus"] == 1 and cmp["pass_rate_after"] == 0.0
    assert cmp["remaining"] == [
        {"cause": "wall-clock budget ran out", "count": 1, "files": {"f/t.py": 1}}
    ]
    assert "incomplete" in report.compare_markdown(cmp).lower()


@pytest.mark.parametrize(
    "argv, code, says",
    [
        (["run", "--out", "o"], 2, "--tree"),
        (["run", "--tree", "x", "--out", "o", "--nproc", "0"], 2, "must be > 0"),
        (["run", "--tree", "bad name=/tmp", "--out", "o"], 2, "NAME must be"),
        (
            ["run", "--tree", "x=/nonexistent/tree", "--out", "o"],
            3,
            "no tests/unit_tests/conftest.py",
        ),
        (["compare", "/nonexistent/a.json", "/nonexistent/b.json"], 2, "cannot read"),
        (["frobnicate"], 2, "invalid choice"),
    ],
)
def test_bad_input_is_one_line_and_a_documented_exit_code(ut, capsys, argv, code, says) -> None:
    assert ut.main(argv) == code
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_summarize_writes_json_and_markdown_from_junit(ut, tmp_path: Path) -> None:
    (tmp_path / "j.xml").write_text(JUNIT)
    assert (
        ut.main(
            [
                "summarize",
                "--junit",
                str(tmp_path / "j.xml"),
                "--nproc",
                "2",
                "--out",
                str(tmp_path / "o"),
            ]
        )
        == 0
    )
    doc = json.loads((tmp_path / "o" / "results.json").read_text())
    assert doc["totals"] == {"error": 1, "failed": 1, "needs_gpus": 1, "passed": 1, "skipped": 1}
    assert (tmp_path / "o" / "summary.md").read_text().startswith("## junit")


def _settings(launch, tmp_path: Path, **kw):
    base = dict(
        python=sys.executable,
        nproc=1,
        timeout=1.0,
        deadline=1e12,
        repo=tmp_path,
        plugin_dir=tmp_path,
    )
    base.update(markexpr=None, exclude=None, has_timeout_plugin=False, grace=1.0)
    return launch.Settings(**{**base, **kw})


def test_the_watchdog_kills_a_process_whose_progress_log_falls_silent(ut, tmp_path: Path) -> None:
    launch = importlib.import_module("upstream_tests.launch")
    base = tmp_path / "p"
    code = f"import time; open({str(base) + '.rank0.jsonl'!r}, 'w').write('x'); time.sleep(120)"
    ended = launch.run_watched(
        [sys.executable, "-c", code],
        tmp_path,
        {},
        tmp_path / "log",
        _settings(launch, tmp_path),
        base,
    )
    assert ended.killed == "hang" and ended.seconds < 60
    assert launch.death_note(tmp_path / "log", ended).startswith("timeout:")


def test_the_budget_stops_a_process(ut, tmp_path: Path) -> None:
    launch = importlib.import_module("upstream_tests.launch")
    s = _settings(launch, tmp_path, deadline=0.0, timeout=100.0)
    ended = launch.run_watched(
        [sys.executable, "-c", "import time; time.sleep(120)"],
        tmp_path,
        {},
        tmp_path / "log",
        s,
        tmp_path / "p",
    )
    assert ended.killed == "budget"
    assert launch.death_note(tmp_path / "log", ended) == "not finished: wall-clock budget ran out"


def test_death_note_reads_the_first_failed_rank_and_the_last_exception(ut, tmp_path: Path) -> None:
    launch = importlib.import_module("upstream_tests.launch")
    log = tmp_path / "log"
    log.write_text(
        "tests/x.py::test_y Initializing\n"
        "torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1, unhandled cuda error\n"
        "E1123 12:00:00 api.py:1] failed (exitcode: -6) local_rank: 1 (pid: 9)\n"
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n"
        "Failures:\n  rank      : 0\n  exitcode  : -15 (pid: 8)  (SIGTERM)\n"
        "Root Cause (first observed failure):\n[1]:\n  rank      : 1 (local_rank: 1)\n"
        "  exitcode  : -6 (pid: 9)  (SIGABRT)\n  traceback : Signal 6 (SIGABRT) received by PID 9\n"
    )
    note = launch.death_note(log, launch.Ended(1, None, 3.0))
    assert (
        note
        == "process died (signal SIGABRT) during this test: torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1, unhandled cuda error"
    )


# --- one real run on the CPU --------------------------------------------------------------

TOY = {
    "pytest.ini": """
        [pytest]
        addopts = -x -s
        markers =
            experimental: upstream CI runs these apart
    """,
    "tests/unit_tests/conftest.py": "# toy conftest\n",
    "tests/unit_tests/test_a.py": """
        import os
        import time

        import pytest

        def test_pass():
            pass

        def test_fail():
            assert 1 == 2, "boom\\nsecond line"

        def test_skip():
            pytest.skip("no TE here")

        def test_needs():
            raise RuntimeError("world_size (2) is not divisible by 4")

        def test_fp8_thing():
            pass

        def test_rank1_only():
            # rank 1 lags: rank 0 ends its session first, with test_fail failed
            if os.environ.get("RANK") == "1":
                time.sleep(3)
            assert os.environ.get("RANK") != "1", "only rank 1 sees this"

        def test_own_tmpdir(tmp_path_factory):
            # where upstream's tmp_path_dist_ckpt goes: two parents up from a mktemp
            shared = tmp_path_factory.mktemp("ignored", numbered=False).parent.parent
            assert os.path.basename(os.environ["TMPDIR"]).startswith("mrocm-ut-toy-chunk")
            assert str(shared).startswith(os.environ["TMPDIR"])
    """,
    "tests/unit_tests/test_b.py": """
        import os
        import pytest

        @pytest.fixture
        def broken():
            raise ValueError("bad fixture")

        def test_fixture_error(broken):
            pass

        def test_crash():
            os._exit(3)

        def test_after():
            pass
    """,
    "tests/unit_tests/test_d.py": "import not_a_module_xyz\n",
    "tests/unit_tests/test_e.py": """
        import pytest

        @pytest.mark.experimental
        def test_experimental():
            pass
    """,
}


@pytest.fixture(scope="module")
def toy_run(ut, tmp_path_factory):
    pytest.importorskip("torch")
    tree = tmp_path_factory.mktemp("toytree")
    for rel, text in TOY.items():
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_text(textwrap.dedent(text).lstrip())
    out = tmp_path_factory.mktemp("out")
    argv = [
        "run",
        "--tree",
        f"toy={tree}",
        "--out",
        str(out),
        "--paths",
        "tests/unit_tests",
        "--nproc",
        "2",
    ]
    argv += ["--allow-cpu", "--timeout", "60", "--jobs", "2", "--chunk-tests", "4"]
    argv += ["--no-test-data-stub"]
    code = ut.main(argv)
    return code, argv, json.loads((out / "toy" / "results.json").read_text())


@pytest.mark.full
@pytest.mark.slow
@pytest.mark.torch
def test_a_real_run_keeps_every_result_across_a_crash(toy_run) -> None:
    code, _, doc = toy_run
    assert code == 0 and doc["complete"]
    t = {k.split("::")[-1]: v for k, v in doc["tests"].items()}
    assert t["test_pass"]["outcome"] == "passed" and t["test_after"]["outcome"] == "passed"
    assert t["test_fail"] == {
        "outcome": "failed",
        "message": "AssertionError: boom",
        **_dur(t["test_fail"]),
    }
    assert t["test_skip"]["outcome"] == "skipped" and t["test_skip"]["message"] == "no TE here"
    assert t["test_needs"]["outcome"] == "needs_gpus"
    assert t["test_rank1_only"]["message"] == "[rank 1] AssertionError: only rank 1 sees this"
    assert t["test_own_tmpdir"]["outcome"] == "passed"  # chunks at once share no temp dir
    assert t["test_fixture_error"]["outcome"] == "error"
    assert t["test_crash"]["outcome"] == "error" and t["test_crash"]["message"].startswith(
        "process died (exit 3)"
    )
    assert doc["collect_errors"] == {
        "tests/unit_tests/test_d.py": "ModuleNotFoundError: No module named 'not_a_module_xyz'"
    }
    assert doc["deselected"] == {
        "tests/unit_tests/test_a.py::test_fp8_thing": "excluded",
        "tests/unit_tests/test_e.py::test_experimental": "filter",
    }
    assert "test_fp8_thing" not in t and "test_experimental" not in t  # deselected, never run


def _dur(res: dict) -> dict:
    return {"duration": res["duration"]} if "duration" in res else {}


@pytest.mark.full
@pytest.mark.slow
@pytest.mark.torch
def test_resume_runs_nothing_already_recorded(ut, toy_run) -> None:
    _, argv, first = toy_run
    out = Path(argv[argv.index("--out") + 1]) / "toy"
    before = {p.name for p in (out / "logs").iterdir()}
    assert ut.main([*argv, "--resume"]) == 0
    again = json.loads((out / "results.json").read_text())
    assert {k: v["outcome"] for k, v in again["tests"].items()} == {
        k: v["outcome"] for k, v in first["tests"].items()
    }
    assert {p.name for p in (out / "logs").iterdir()} == before  # no test process started


def test_chunks_pack_files_and_leave_out_recorded_tests(ut, tmp_path: Path) -> None:
    runner = importlib.import_module("upstream_tests.runner")
    tree = runner.Tree("t", tmp_path, tmp_path)
    tree.collected = [f"a.py::{i}" for i in range(5)] + ["b.py::0", "b.py::1", "c.py::0", "d.py::0"]
    tree.results = {"a.py::0": runner.Result("passed"), "d.py::0": runner.Result("failed")}
    got = runner.chunks(tree, max_tests=3)
    assert [(c.files, len(c.ids)) for c in got] == [(["a.py"], 4), (["b.py", "c.py"], 3)]
    assert got[0].skip == {"a.py::0"} and got[1].skip == set()


def test_trees_take_turns_so_a_budget_cut_leaves_both_sides(ut, tmp_path: Path) -> None:
    runner = importlib.import_module("upstream_tests.runner")
    before, after = runner.Tree("u", tmp_path, tmp_path), runner.Tree("p", tmp_path, tmp_path)
    before.collected = ["a.py::0", "a.py::1", "b.py::0"]
    after.collected = ["a.py::0", "a.py::1", "b.py::0", "c.py::0"]
    got = [(c.tree.name, c.files) for c in runner.schedule([before, after], chunk_tests=2)]
    assert got == [
        ("u", ["a.py"]),
        ("p", ["a.py"]),
        ("u", ["b.py"]),
        ("p", ["b.py", "c.py"]),
    ]


def test_every_tree_gets_the_same_files_in_each_process(ut, tmp_path: Path) -> None:
    """A file that lost tests on one side (a module that did not import) must not reshuffle
    which files share a process: upstream's tests can depend on what ran before them."""
    runner = importlib.import_module("upstream_tests.runner")
    before, after = runner.Tree("u", tmp_path, tmp_path), runner.Tree("p", tmp_path, tmp_path)
    before.collected = ["a.py::0", "b.py::0", "c.py::0", "c.py::1"]
    after.collected = ["a.py::0", "a.py::1", "a.py::2", "b.py::0", "c.py::0", "c.py::1"]
    alone = [c.files for c in runner.chunks(before, 3)]
    assert alone == [["c.py", "a.py"], ["b.py"]]  # what packing the unpatched side alone gives
    got = {}
    for c in runner.schedule([before, after], chunk_tests=3):
        got.setdefault(c.tree.name, []).append(c.files)
    assert sorted(got["u"]) == sorted(got["p"]) == [["a.py"], ["c.py", "b.py"]]


def test_resume_refuses_results_of_other_files(ut, tmp_path: Path) -> None:
    runner = importlib.import_module("upstream_tests.runner")
    tree = runner.Tree("t", tmp_path, tmp_path, meta={"tree": "abc"})
    (tmp_path / "results.json").write_text(
        json.dumps({"tree": "def", "describe": "main", "tests": {}})
    )
    with pytest.raises(ut.Usage, match="another tree"):
        ut._resume(tree)
    (tmp_path / "results.json").write_text(
        json.dumps(
            {
                "tree": "abc",
                "tests": {"f.py::a": {"outcome": "passed"}, "f.py::b": {"outcome": "not_run"}},
            }
        )
    )
    ut._resume(tree)
    assert set(tree.results) == {"f.py::a"}


def test_a_port_lost_to_another_process_is_retried_not_blamed(ut, tmp_path: Path, monkeypatch):
    """Chunks start at once; torchrun can lose its free port to another process before it
    binds. Nothing ran, so the chunk starts again on a new port and no test is marked."""
    runner = importlib.import_module("upstream_tests.runner")
    results = importlib.import_module("upstream_tests.results")
    tree = runner.Tree("t", tmp_path, tmp_path)
    for sub in ("progress", "logs", "junit"):
        (tmp_path / sub).mkdir()
    chunk = runner.Chunk(tree, 0, ["a.py"], ["a.py::x"])
    settings = runner.Settings(
        python="python", nproc=1, timeout=60, deadline=time.monotonic() + 600, repo=tmp_path,
        plugin_dir=tmp_path, markexpr=None, exclude=None, has_timeout_plugin=False,
    )  # fmt: skip
    calls = []

    def fake_run(cmd, cwd, env, log, s, base):
        calls.append(cmd)
        done = len(calls) > 1
        lines = {"a.py::x": results.Result("passed")} if done else {}
        monkeypatch.setattr(
            runner,
            "read_rank_log",
            lambda path: results.RankLog(["a.py::x"], lines, None, None, {}, {}, done, 0.0),
        )
        if not done:
            log.write_text(
                "torch.distributed.DistNetworkError: The server socket has failed to listen on "
                "any local network address. port: 29511, useIpv6: false, code: -98\n"
            )
        return runner.Ended(1 if not done else 0, None, 1.0)

    monkeypatch.setattr(runner, "run_watched", fake_run)
    found, attempts = runner.run_chunk(chunk, settings)
    assert attempts == 2 and len(calls) == 2
    assert found == {"a.py::x": results.Result("passed")}


@pytest.mark.full
@pytest.mark.slow
@pytest.mark.torch
def test_resume_runs_what_the_budget_left(ut, toy_run, tmp_path: Path) -> None:
    """Tests a run's budget left ``not_run`` are run by ``--resume``; nothing else is. The
    first run's progress logs are long silent by then, and the resume's chunks are numbered
    afresh, so a tag may name one of them: it must not be read as the new process's (the
    watchdog took its silence for a hang and killed the process at once, and its old "end"
    said the tests were never collected)."""
    _, argv, first = toy_run
    out = tmp_path / "out"
    shutil.copytree(Path(argv[argv.index("--out") + 1]), out)
    hour_ago = time.time() - 3600
    for old in (out / "toy" / "progress").glob("*.jsonl"):
        os.utime(old, (hour_ago, hour_ago))
    argv = [*argv[: argv.index("--out") + 1], str(out), *argv[argv.index("--out") + 2 :]]
    doc = json.loads((out / "toy" / "results.json").read_text())
    left = next(k for k in doc["tests"] if k.endswith("::test_after"))
    doc["tests"][left] = {"outcome": "not_run", "message": "wall-clock budget ran out"}
    doc["complete"] = False
    (out / "toy" / "results.json").write_text(json.dumps(doc))
    assert ut.main([*argv, "--resume"]) == 0
    again = json.loads((out / "toy" / "results.json").read_text())
    assert again["complete"] and again["tests"][left]["outcome"] == "passed"
    assert list((out / "toy" / "logs").glob("*.earlier.log"))  # the first run's, kept
    assert {k: v["outcome"] for k, v in again["tests"].items()} == {
        k: v["outcome"] for k, v in first["tests"].items()
    }


def _suite_tree(root: Path) -> Path:
    """A toy tree with one passing test in each folder the suites name, and one outside."""
    (root / "tests/unit_tests").mkdir(parents=True)
    (root / "tests/unit_tests/conftest.py").write_text("# toy conftest\n")
    for folder in ("transformer", "tensor_parallel", "fusions", "dist_checkpointing", "models"):
        (root / "tests/unit_tests" / folder).mkdir()
        (root / "tests/unit_tests" / folder / f"test_{folder}.py").write_text(
            "def test_ok():\n    pass\n"
        )
    (root / "tests/unit_tests/test_outside.py").write_text("def test_ok():\n    pass\n")
    return root


def _selected_folders(ut, tree: Path, out: Path, *extra: str) -> tuple[int, set[str], dict]:
    code = ut.main(["run", "--tree", f"t={tree}", "--out", str(out), "--collect-only", *extra])
    if code != 0:
        return code, set(), {}
    doc = json.loads((out / "t" / "selection.json").read_text())
    return code, {f.split("/")[2] for f in doc["files"]}, doc


@pytest.mark.parametrize(
    ("extra", "folders"),
    [
        ((), {"transformer", "tensor_parallel", "fusions"}),  # the default stays bounded
        (("--suite", "dist_checkpointing"), {"dist_checkpointing"}),
        (("--suite", "models", "--suite", "dist_checkpointing"), {"models", "dist_checkpointing"}),
        (
            ("--suite", "all"),
            {"transformer", "tensor_parallel", "fusions", "dist_checkpointing", "models"},
        ),
        (("--suite", "core", "--suite", "all"), None),  # each folder once
    ],
)
def test_suites_select_upstreams_folders(ut, tmp_path: Path, extra, folders) -> None:
    tree = _suite_tree(tmp_path / "tree")
    code, got, doc = _selected_folders(ut, tree, tmp_path / "out", *extra)
    assert code == 0
    if folders is None:
        assert len(doc["tests"]) == 5 and doc["paths"] == ut.SUITES["all"]
    else:
        assert got == folders
        assert doc["suites"] == (list(extra[1::2]) or ["core"])


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (("--suite", "dist_checkpointing", "--paths", "tests/unit_tests"), "not both"),
        (("--suite", "nope"), "invalid choice"),
        (("--paths", "tests/unit_tests/gone"), "has no tests/unit_tests/gone"),
    ],
)
def test_a_bad_selection_is_usage(ut, tmp_path: Path, capsys, extra, says) -> None:
    tree = _suite_tree(tmp_path / "tree")
    assert ut.main(["run", "--tree", f"t={tree}", "--out", str(tmp_path / "o"), *extra]) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()  # refused before anything was written
