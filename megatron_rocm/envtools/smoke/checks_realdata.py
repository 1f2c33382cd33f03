"""The real-data check: text -> tokenizer -> ``preprocess_data.py`` -> ``pretrain_gpt.py``.

Every other training check uses mock data and the project's own model builder. This one runs
upstream's own tools as a user does, from a JSONL file: ``tools/preprocess_data.py`` writes
the ``.bin/.idx``, ``pretrain_gpt.py --data-path`` builds the dataset index (Megatron's C++
helpers) and trains the TE spec (the native backend without TE), saves, stops half way, and a
second run resumes. The loss must fall well below the corpus's unigram entropy (what the
best context-free model reaches), so the model learned from the text, not only its token
frequencies; the resumed run must continue from the saved loss, not start over.

Each step is a subprocess with its own time limit (``TIMEOUTS``; ``TIMEOUT_ENV`` sets one for
all), logged as it starts and ends; one that runs past it is killed with its children and the
check fails with the step's name and the last lines of its log. The steps run with Hugging Face
offline (``OFFLINE``): a hub lookup on a box without network fails at once instead of waiting
on sockets.

``real_data_results`` is the machinery; the GPU check launches it with torchrun and NCCL, the
CPU tests (``tests/envtools/test_realdata_cpu.py``, on trees from a Megatron-LM mirror) with
gloo. ``tests/envtools/test_realdata_sdist.py`` (what CI runs: an sdist has neither script)
shares the corpus, the tokenizer, ``HPARAMS`` and ``judge``.
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from megatron_rocm.envtools.smoke import realdata
from megatron_rocm.envtools.smoke.runner import CheckFailed, Context, Skip, register
from megatron_rocm.runtime import settings

# Seconds each step may run: on one GPU preprocessing takes seconds and a training run well
# under a minute, so a step past its limit is stuck, not slow. TIMEOUT_ENV overrides both.
TIMEOUTS = {"preprocess": 120, "train": 240}
TIMEOUT_ENV = "MEGATRON_ROCM_SMOKE_REALDATA_TIMEOUT"
# No step downloads anything; without a network a hub lookup could otherwise wait on sockets.
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
TAIL_LINES = 12  # of a failed step's log, in the check's message

DOCUMENTS = 600  # ~39k tokens: preprocessing takes seconds, 40 iterations see ~8 % of it
MERGES = 200  # vocabulary 457, padded by Megatron to 512
ITERS = 40  # the first run stops at ITERS // 2 (saving), the second resumes to ITERS
BELOW_ENTROPY = 0.85  # the final loss must be under this fraction of the unigram entropy
# The model and schedule, shared by pretrain_gpt.py's flags here and the CPU test that trains
# megatron.core directly on a PyPI sdist (tests/envtools/realdata/sdist_pretrain.py)
HPARAMS: dict[str, int | float | str] = {
    "num-layers": 2,
    "hidden-size": 64,
    "ffn-hidden-size": 256,
    "num-attention-heads": 4,
    "seq-length": 64,
    "max-position-embeddings": 64,
    "micro-batch-size": 8,
    "global-batch-size": 8,
    "lr": 3e-3,
    "min-lr": 3e-4,
    "lr-decay-style": "cosine",
    "lr-warmup-iters": 4,
    "weight-decay": 0.01,
    "clip-grad": 1.0,
    "seed": 1234,
}
MODEL = [f"--{k}={v}" for k, v in HPARAMS.items()] + [
    "--split=98,2,0",
    "--log-interval=1",
    "--eval-iters=1",
    "--eval-interval=1000",
    "--transformer-impl=transformer_engine",
]
_LOSS = re.compile(r"\biteration\s+(\d+)/\s*\d+\s*\|.*?\blm loss:\s*([-+0-9.eEnNaAiIfF]+)")


@dataclass
class Run:
    """One ``pretrain_gpt.py`` process: its losses by iteration and the tail of its log."""

    losses: dict[int, float] = field(default_factory=dict)
    returncode: int = 0
    tail: str = ""


@dataclass
class Results:
    tokens: int
    expected_tokens: int
    entropy: float  # nats, of the preprocessed tokens
    first: Run
    resumed: Run


def losses(log: str) -> dict[int, float]:
    """``lm loss`` of every logged training iteration (validation lines do not match)."""
    return {int(m[1]): float(m[2]) for m in _LOSS.finditer(log)}


def _tokenizer_args(tree: Path, tok: Path) -> list[str]:
    """The same GPT-2 BPE from local files at every tag, never a download.

    0.12-0.15: GPT2BPETokenizer, Megatron's own. 0.16: the same through ``--legacy-tokenizer``.
    0.17+ dropped that flag, and GPT2BPETokenizer became ``AutoTokenizer.from_pretrained("gpt2",
    vocab_file=..., merges_file=...)``: a hub lookup of "gpt2" that fails offline, and then
    ``preprocess_data.py`` hangs (its parent waits on a queue for the child that died). There
    the folder is read as the Hugging Face tokenizer it also is (``save_tokenizer``)."""
    text = (tree / "megatron/training/arguments.py").read_text(encoding="utf-8", errors="replace")
    new_system = (tree / "megatron/core/tokenizers").is_dir()
    if new_system and "'--legacy-tokenizer'" not in text:
        return ["--tokenizer-type=HuggingFaceTokenizer", f"--tokenizer-model={tok}"]
    args = [
        "--tokenizer-type=GPT2BPETokenizer",
        f"--vocab-file={tok / 'vocab.json'}",
        f"--merge-file={tok / 'merges.txt'}",
    ]
    return args + (["--legacy-tokenizer"] if "'--legacy-tokenizer'" in text else [])


def _env(tree: Path, extra: dict[str, str] | None) -> dict[str, str]:
    env = dict(os.environ)
    here = Path(__file__).resolve().parents[3]  # this checkout, for megatron_rocm
    paths = [str(tree), str(here)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    for key, value in OFFLINE.items():
        env.setdefault(key, value)
    env.update(extra or {})
    if extra and "PYTHONPATH" in extra:  # the caller's entries first, then the tree's
        env["PYTHONPATH"] = os.pathsep.join([extra["PYTHONPATH"], *paths])
    return env


def timeouts(timeout: int | None = None) -> dict[str, int]:
    """Each step's limit: ``timeout`` for all, else ``TIMEOUT_ENV``, else ``TIMEOUTS``."""
    raw = os.environ.get(TIMEOUT_ENV, "").strip()
    if timeout is None and raw:
        try:  # the registry's grammar and its one line: name, value, what it takes
            timeout = int(settings.parse(TIMEOUT_ENV, raw))  # type: ignore[call-overload]
        except ValueError as e:
            raise CheckFailed(f"{e} of seconds") from e
    return {step: timeout or limit for step, limit in TIMEOUTS.items()}


def _tail(log: Path, lines: int = TAIL_LINES) -> str:
    try:
        text = log.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """The step and every process it started (torchrun's workers, preprocessing's pool)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _step(
    ctx: Context,
    name: str,
    cmd: Sequence[str],
    tree: Path,
    env: dict[str, str],
    log: Path,
    timeout: int,
) -> int:
    """Run one step in its own process group, output to ``log``; its exit status. Past
    ``timeout`` seconds the group is killed and the check fails, naming the step."""
    ctx.log(f"      real-data: {name} started (limit {timeout} s)")
    start = time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            list(cmd),
            cwd=tree,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            _kill_group(proc)  # also what a finished step left behind (pool workers)
            proc.wait()
    seconds = time.monotonic() - start
    if rc is None:
        ctx.log(f"      real-data: {name} TIMED OUT after {seconds:.0f} s")
        raise CheckFailed(
            f"{name} did not finish in {timeout} s ({TIMEOUT_ENV} sets the limit); "
            f"last lines of its log:\n{_tail(log)}"
        )
    ctx.log(f"      real-data: {name} exited {rc} after {seconds:.1f} s")
    return rc


def _run(
    ctx: Context,
    name: str,
    cmd: Sequence[str],
    tree: Path,
    env: dict[str, str],
    log: Path,
    timeout: int,
) -> Run:
    rc = _step(ctx, name, cmd, tree, env, log, timeout)
    text = log.read_text(encoding="utf-8", errors="replace")
    return Run(losses(text), rc, "\n".join(text.splitlines()[-15:]))


def corpus_and_tokenizer(work: Path) -> tuple[list[str], dict[str, int], list[tuple[str, str]]]:
    """The corpus and the BPE trained on its first documents, saved in ``work/tokenizer``."""
    texts = realdata.corpus(DOCUMENTS)
    vocab, ranks = realdata.train_bpe(texts[:200], MERGES)
    realdata.save_tokenizer(vocab, ranks, work / "tokenizer")
    return texts, vocab, ranks


def expected_tokens(texts: list[str], vocab: dict[str, int], ranks: list[tuple[str, str]]) -> int:
    """What preprocessing must write: every document's BPE tokens and one EOD after each."""
    return sum(len(realdata.encode(t, ranks, vocab)) + 1 for t in texts)


def prepare(
    ctx: Context, tree: Path, work: Path, env: dict[str, str], timeout: int
) -> tuple[Path, float, int, int]:
    """Corpus, tokenizer, ``preprocess_data.py``: (data prefix, entropy, tokens, expected)."""
    texts, vocab, ranks = corpus_and_tokenizer(work)
    tok = work / "tokenizer"
    jsonl = realdata.write_jsonl(texts, work / "corpus.jsonl")
    prefix = work / "corpus"
    cmd = [
        sys.executable,
        str(tree / "tools" / "preprocess_data.py"),
        f"--input={jsonl}",
        f"--output-prefix={prefix}",
        *_tokenizer_args(tree, tok),
        "--append-eod",
        "--workers=1",
    ]
    log = work / "preprocess.log"
    rc = _step(ctx, "preprocess_data.py", cmd, tree, env, log, timeout)
    data = Path(f"{prefix}_text_document")
    binary = data.with_suffix(".bin")
    if rc != 0 or not binary.is_file() or binary.stat().st_size == 0:
        raise CheckFailed(
            f"preprocess_data.py failed (exit {rc}, {binary.name} "
            f"{'empty' if binary.is_file() else 'missing'}): {_tail(log, 3)}"
        )
    import numpy  # Megatron's IndexedDataset stores a vocabulary under 65500 as uint16

    ids = numpy.fromfile(binary, dtype=numpy.uint16).tolist()
    return data, realdata.unigram_entropy(ids), len(ids), expected_tokens(texts, vocab, ranks)


def real_data_results(
    ctx: Context,
    launcher: Sequence[str],
    backend: str,
    env: dict[str, str] | None = None,
    timeout: int | None = None,
) -> Results:
    """Prepare the data and run ``pretrain_gpt.py`` twice: to ITERS // 2 (saving), then on
    to ITERS from that checkpoint. ``launcher`` runs a script: torchrun, or a CPU harness.
    ``timeout``: seconds each step may take (default ``timeouts()``)."""
    tree = ctx.needs_tree()
    limits = timeouts(timeout)
    work = ctx.workdir / "real-data"
    work.mkdir(parents=True, exist_ok=True)
    full_env = _env(tree, env)
    data, entropy, tokens, expected = prepare(ctx, tree, work, full_env, limits["preprocess"])
    ckpt = work / "checkpoint"
    train = [
        *launcher,
        "pretrain_gpt.py",
        *MODEL,
        f"--data-path={data}",
        *_tokenizer_args(tree, work / "tokenizer"),
        f"--train-iters={ITERS}",
        f"--save={ckpt}",
        f"--load={ckpt}",
        f"--save-interval={ITERS // 2}",
        f"--distributed-backend={backend}",
    ]
    ctx.log(f"      real-data: {tokens} tokens, unigram entropy {entropy:.3f} nats")
    first = _run(
        ctx,
        f"pretrain_gpt.py to iteration {ITERS // 2}",
        [*train, f"--exit-interval={ITERS // 2}"],
        tree,
        full_env,
        work / "1.log",
        limits["train"],
    )
    resumed = Run()
    if first.returncode == 0:
        name = f"pretrain_gpt.py resumed to iteration {ITERS}"
        resumed = _run(ctx, name, train, tree, full_env, work / "2.log", limits["train"])
    return Results(tokens, expected, entropy, first, resumed)


def judge(r: Results) -> str:
    """Pass/fail of one pipeline: the data, the learning, the resume."""
    if r.tokens != r.expected_tokens:
        raise CheckFailed(
            f"preprocess_data.py wrote {r.tokens} tokens, the tokenizer gives {r.expected_tokens}"
        )
    half = ITERS // 2
    for name, run, want in (("first", r.first, range(1, half + 1)), ("resumed", r.resumed, None)):
        if run.returncode != 0:
            raise CheckFailed(f"{name} run exited {run.returncode}: {run.tail[-400:]}")
        if want is not None and sorted(run.losses) != list(want):
            raise CheckFailed(f"{name} run logged iterations {sorted(run.losses)[:3]}...")
    got = sorted(r.resumed.losses)
    if got != list(range(half + 1, ITERS + 1)):
        raise CheckFailed(f"resumed run logged iterations {got[:3]}..., not {half + 1}..{ITERS}")
    if not all(math.isfinite(v) for v in [*r.first.losses.values(), *r.resumed.losses.values()]):
        raise CheckFailed("a loss is not finite")
    start, saved, cont = r.first.losses[1], r.first.losses[half], r.resumed.losses[half + 1]
    final = r.resumed.losses[ITERS]
    if abs(cont - saved) > 0.1 * saved + 0.05 or cont > saved + 0.5 * (start - saved):
        raise CheckFailed(
            f"the resumed run starts at loss {cont:.3f}, not near the saved {saved:.3f} "
            f"(first run began at {start:.3f}): it did not continue from the checkpoint"
        )
    if final >= BELOW_ENTROPY * r.entropy:
        raise CheckFailed(
            f"loss {start:.3f} -> {final:.3f} after {ITERS} iterations is not below "
            f"{BELOW_ENTROPY} x the unigram entropy ({r.entropy:.3f} nats): it did not learn"
        )
    return (
        f"loss {start:.2f} -> {saved:.2f} (saved) -> resumed {cont:.2f} -> {final:.2f}; "
        f"unigram entropy {r.entropy:.2f} nats, {r.tokens} tokens"
    )


@register("real-data.pretrain_gpt")
def pretrain_gpt_real_data(ctx: Context) -> str:
    """JSONL -> local BPE -> preprocess_data.py -> pretrain_gpt.py (TE spec), save, resume."""
    tree = ctx.needs_tree()
    missing = [
        p for p in ("pretrain_gpt.py", "tools/preprocess_data.py") if not (tree / p).is_file()
    ]
    if missing:
        raise Skip(
            f"{', '.join(missing)} not in this tree (a megatron-core sdist ships neither); "
            "apply from a Megatron-LM clone"
        )
    ctx.needs_gpu(1, "training pretrain_gpt.py on real data")
    hf = "--tokenizer-type=HuggingFaceTokenizer" in _tokenizer_args(tree, tree)
    if hf and importlib.util.find_spec("transformers") is None:
        raise Skip(
            "this tree (0.17+) reads the local tokenizer through Hugging Face transformers, "
            "which is not installed (pip install transformers)"
        )
    launcher = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=1",
        "--max-restarts=0",
    ]
    return judge(real_data_results(ctx, launcher, "nccl"))
