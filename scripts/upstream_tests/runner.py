"""Running the selected upstream test files of one or more trees: a collection pass per tree,
files packed into chunks, chunks run by ``jobs`` workers at once (each chunk one
``torchrun -m pytest`` process group, restarted without the finished tests and the fatal one
whenever it dies), results merged and written after every chunk so nothing is lost to a kill.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path

from .launch import (
    Ended,
    Settings,
    child_env,
    death_note,
    pytest_args,
    run_watched,
    torchrun,
    trim_log,
)
from .report import run_document, run_markdown
from .results import Result, classify, file_of, merge_ranks, read_rank_log

MIN_START_S = 45.0  # a chunk needs this much budget left to be worth its imports
MAX_ATTEMPTS = 30
# torchrun could not bind the port free_port() found free a moment earlier (taken meanwhile)
PORT_TAKEN = "server socket has failed to listen"
MAX_PORT_RETRIES = 3


@dataclass
class Tree:
    name: str
    path: Path
    out: Path
    meta: dict = field(default_factory=dict)
    collected: list[str] = field(default_factory=list)
    collect_errors: dict[str, str] = field(default_factory=dict)
    deselected: dict[str, str] = field(default_factory=dict)
    results: dict[str, Result] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass
class Chunk:
    tree: Tree
    index: int
    files: list[str]
    ids: list[str]
    skip: set[str] = field(default_factory=set)  # already recorded (--resume)


def collect(tree: Tree, paths: list[str], s: Settings) -> None:
    """One plain pytest process lists the selection (no GPU work): the ids, the modules that
    do not import, and what the FP8 pattern and the marker filter leave out."""
    base = tree.out / "progress" / "collect"
    for old in base.parent.glob("collect.rank*.jsonl"):
        old.unlink()
    env = child_env(
        tree.path, s, MROCM_UT_PROGRESS=str(base), WORLD_SIZE=str(s.nproc), RANK="0", LOCAL_RANK="0"
    )
    cmd = [s.python, "-m", "pytest", "--collect-only", "-q", *pytest_args(s, None), *paths]
    run_watched(cmd, tree.path, env, tree.out / "logs" / "collect.log", s, base)
    log = read_rank_log(Path(f"{base}.rank0.jsonl"))
    if log.collected is None:
        why = death_note(tree.out / "logs" / "collect.log", Ended(None, None, 0.0))
        raise RuntimeError(f"{tree.name}: listing the tests failed: {why}")
    tree.collected, tree.collect_errors = log.collected, log.collect_errors
    tree.deselected = {k: v for k, v in log.deselected.items() if v != "recorded"}


def _pending_by_file(tree: Tree) -> tuple[dict[str, list[str]], dict[str, set[str]]]:
    """(file -> tests still to run, file -> tests already recorded) of a tree."""
    by_file: dict[str, list[str]] = {}
    recorded: dict[str, set[str]] = {}
    for nodeid in tree.collected:
        if nodeid in tree.results:
            recorded.setdefault(file_of(nodeid), set()).add(nodeid)
        else:
            by_file.setdefault(file_of(nodeid), []).append(nodeid)
    return by_file, recorded


def pack(sizes: dict[str, int], max_tests: int) -> list[list[str]]:
    """Files packed first-fit-decreasing into bins of at most ``max_tests`` tests (a bigger
    file is a bin of its own): few processes (each pays upstream's imports), small losses."""
    bins: list[list[str]] = []
    for f in sorted(sizes, key=lambda f: (-sizes[f], f)):
        home = next((b for b in bins if sum(sizes[x] for x in b) + sizes[f] <= max_tests), None)
        if home is None:
            bins.append([f])
        else:
            home.append(f)
    return bins


def chunks(tree: Tree, max_tests: int, bins: list[list[str]] | None = None) -> list[Chunk]:
    """The tree's pending tests as chunks: ``bins`` (files per chunk, shared by every tree of
    a run) or the tree's own packing."""
    by_file, recorded = _pending_by_file(tree)
    if bins is None:
        bins = pack({f: len(ids) for f, ids in by_file.items()}, max_tests)
    out = []
    for i, b in enumerate(bins):
        files = [f for f in b if f in by_file]
        if files:
            ids = [n for f in files for n in by_file[f]]
            out.append(
                Chunk(tree, i, files, ids, set().union(*(recorded.get(f, set()) for f in files)))
            )
    return out


def schedule(trees: list[Tree], chunk_tests: int) -> list[Chunk]:
    """Every tree's chunks, biggest first, the trees taking turns: when the budget runs out,
    the unpatched and the patched tree have reached the same files, so the before/after
    comparison still has both sides. One packing serves every tree (each file counted at its
    largest): the same files share a process, in the same order, before and after, because
    some of upstream's tests depend on what an earlier test in the process left behind (an
    initialised torch.distributed, for one)."""
    sizes: dict[str, int] = {}
    for t in trees:
        for f, ids in _pending_by_file(t)[0].items():
            sizes[f] = max(sizes.get(f, 0), len(ids))
    bins = pack(sizes, chunk_tests)
    per_tree = [sorted(chunks(t, chunk_tests, bins), key=lambda c: -len(c.ids)) for t in trees]
    return [c for turn in itertools.zip_longest(*per_tree) for c in turn if c is not None]


def run_chunk(chunk: Chunk, s: Settings) -> tuple[dict[str, Result], int]:
    """Run a chunk to the end, restarting after each death; (results, attempts)."""
    tree, found = chunk.tree, {}
    expected = set(chunk.ids)
    port_retries = 0
    for attempt in range(1, MAX_ATTEMPTS + 1):
        todo = expected - found.keys()
        if not todo or time.monotonic() > s.deadline - MIN_START_S:
            return found, attempt - 1
        tag = f"chunk{chunk.index:02d}-a{attempt}"
        base = tree.out / "progress" / tag
        deselect = tree.out / "progress" / f"{tag}.deselect"
        deselect.write_text("".join(f"{n}\n" for n in sorted((expected - todo) | chunk.skip)))
        junit = tree.out / "junit" / f"{tag}.xml"
        log = tree.out / "logs" / f"{tag}.log"
        _forget_earlier_run(base, junit, log, s.nproc)
        # A temp dir of its own per process group: upstream's tmp_path_dist_ckpt lives beside
        # pytest's basetemp ($TMPDIR/pytest-of-<user>/tmp_dist_ckpt), so chunks running at
        # once would otherwise write their checkpoints into one folder (seen with --jobs 4).
        with tempfile.TemporaryDirectory(
            prefix=f"mrocm-ut-{tree.name}-{tag}-", ignore_cleanup_errors=True
        ) as tmp:
            env = child_env(
                tree.path,
                s,
                MROCM_UT_PROGRESS=str(base),
                MROCM_UT_DESELECT=str(deselect),
                TMPDIR=tmp,
            )
            ended = run_watched(
                torchrun(s) + pytest_args(s, junit) + chunk.files, tree.path, env, log, s, base
            )
        logs = [read_rank_log(Path(f"{base}.rank{r}.jsonl")) for r in range(s.nproc)]
        new = {k: v for k, v in merge_ranks(logs).items() if k not in found}
        found.update(new)
        with tree.lock:
            for lg in logs:
                tree.collect_errors.update(lg.collect_errors)
        trim_log(log)
        if ended.killed == "budget":
            return found, attempt
        dying = next((lg for lg in logs if lg.running and lg.running not in found), None)
        if dying is not None:
            held = time.time() - (dying.running_since or time.time())
            found[dying.running] = Result("error", death_note(log, ended), round(held, 1))
        elif logs[0].ended:  # finished, yet some listed tests never came up: say so
            for nodeid in expected - found.keys():
                found[nodeid] = Result(
                    "not_run", "listed by the collection pass, not collected by the run"
                )
            return found, attempt
        elif not new:  # died with nothing to show (e.g. conftest): starting again would too
            note = death_note(log, ended)
            if PORT_TAKEN in note and port_retries < MAX_PORT_RETRIES:
                # torchrun's store lost the race for its port to another process: a new
                # attempt draws another port; no test ran, so none is blamed
                port_retries += 1
                continue
            for nodeid in expected - found.keys():
                found[nodeid] = Result("error", f"never ran: {note}")
            return found, attempt
    return found, MAX_ATTEMPTS


def _forget_earlier_run(base: Path, junit: Path, log: Path, nproc: int) -> None:
    """A ``--resume`` numbers its chunks afresh, so a tag may be one an earlier run used: its
    progress logs would be read as this process's (their silence taken for a hang, their
    "end" for a run that never collected the tests), and its log's last lines as this
    process's way of dying. The progress logs go; the log is kept as ``<tag>.earlier.log``."""
    for r in range(nproc):
        Path(f"{base}.rank{r}.jsonl").unlink(missing_ok=True)
    junit.unlink(missing_ok=True)
    if log.is_file():
        log.replace(log.with_suffix(".earlier.log"))


def stub_test_data(trees: list[Tree], say) -> None:
    """Upstream's conftest (0.16+) downloads its test data into an empty /opt/data, with no
    timeout; without network that can stall each test process. A marker file makes /opt/data
    non-empty; no selected test reads it."""
    if not any(
        "ensure_test_data" in (t.path / "tests/unit_tests/conftest.py").read_text() for t in trees
    ):
        return
    data = Path("/opt/data")
    if data.is_dir() and any(data.iterdir()):
        return
    try:
        data.mkdir(parents=True, exist_ok=True)
        (data / "README.megatron-rocm").write_text(
            "Placed by megatron-rocm's scripts/upstream_unit_tests.py so that upstream's conftest "
            "does not try to download its test data on a machine without network.\n"
        )
        say("created /opt/data/README.megatron-rocm: upstream's conftest skips its data download")
    except OSError as e:
        say(f"could not stub /opt/data ({e}): upstream's conftest will try to download test data")


def collect_only(trees: list[Tree], paths: list[str], s: Settings, say) -> None:
    """The selection of each tree, listed and counted (selection.json/.md), nothing run."""
    for t in trees:
        for sub in ("progress", "logs"):
            (t.out / sub).mkdir(parents=True, exist_ok=True)
        collect(t, paths, s)
        results = {n: Result("not_run", "collect-only") for n in t.collected}
        doc = run_document(
            dict(t.meta, complete=False, collect_only=True), results, t.collect_errors, t.deselected
        )
        (t.out / "selection.json").write_text(json.dumps(doc, indent=1), encoding="utf-8")
        (t.out / "selection.md").write_text(run_markdown(doc), encoding="utf-8")
        say(
            f"{t.name}: {len(t.collected)} tests in {len(doc['files'])} files, "
            f"{len(t.collect_errors)} modules do not import -> {t.out}/selection.md"
        )


def probe(python: str) -> dict:
    code = (
        "import json, torch; ok = torch.cuda.is_available(); print(json.dumps({'torch': "
        "torch.__version__, 'gpus': torch.cuda.device_count() if ok else 0, 'device': "
        "torch.cuda.get_device_name(0) if ok else 'cpu'}))"
    )
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{python} cannot import torch: {out.stderr.strip().splitlines()[-1:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def tree_meta(path: Path) -> dict:
    def git(*args: str) -> str:
        res = subprocess.run(
            ["git", "-C", str(path), *args], capture_output=True, text=True, check=False
        )
        return res.stdout.strip() if res.returncode == 0 else ""

    patches = sum(
        1
        for ln in git("log", "--format=%B", "-n", "200").splitlines()
        if ln.startswith("Megatron-ROCm-Patch:")
    )
    return {
        "head": git("rev-parse", "HEAD"),
        "tree": git("rev-parse", "HEAD^{tree}"),  # same files, same id; apply's commits differ
        "describe": git("describe", "--tags", "--always"),
        "patches": patches,
    }


def write(tree: Tree, nproc: int, started: float, final: bool = False) -> dict:
    """results.json + summary.md of a tree, from what is known now (atomic replace)."""
    with tree.lock:
        results = {k: classify(v, nproc) for k, v in tree.results.items()}
        for nodeid in tree.collected:
            results.setdefault(
                nodeid, Result("not_run", "wall-clock budget ran out" if final else "pending")
            )
        meta = dict(tree.meta, wall_s=round(time.time() - started, 1))
        meta["complete"] = not any(r.outcome == "not_run" for r in results.values())
        doc = run_document(meta, results, dict(tree.collect_errors), dict(tree.deselected))
    for name, text in (
        ("results.json", json.dumps(doc, indent=1)),
        ("summary.md", run_markdown(doc)),
    ):
        tmp = tree.out / f".{name}.tmp"
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(tree.out / name)
    return doc


def run_all(
    trees: list[Tree], paths: list[str], s: Settings, jobs: int, chunk_tests: int, say
) -> list[dict]:
    started = time.time()
    for t in trees:
        for sub in ("progress", "logs", "junit"):
            (t.out / sub).mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(max_workers=max(jobs, 1)) as pool:
        for t, fut in [(t, pool.submit(collect, t, paths, s)) for t in trees]:
            fut.result()
            say(
                f"{t.name}: {len(t.collected)} tests selected, {len(t.collect_errors)} modules do not import, {len(t.deselected)} deselected"
            )
        work = schedule(trees, chunk_tests)
        futures = {pool.submit(run_chunk, c, s): c for c in work}
        for done, fut in enumerate(as_completed(futures), start=1):
            c = futures[fut]
            found, attempts = fut.result()
            with c.tree.lock:
                c.tree.results.update(found)
            write(c.tree, s.nproc, started)
            counts: dict[str, int] = {}
            for r in found.values():
                counts[r.outcome] = counts.get(r.outcome, 0) + 1
            say(
                f"{c.tree.name} chunk {done}/{len(work)} ({len(c.files)} files, {attempts} process(es)): {counts}"
            )
    return [write(t, s.nproc, started, final=True) for t in trees]
