#!/usr/bin/env python3
"""Train a small GPT or Llama-style model with a patched Megatron tree and summarise the run.

Runs ``pretrain_gpt.py`` of TREE (a checkout with the megatron-rocm series applied) under
torchrun with mock data (or ``--data-path``) and bf16. The transformer implementation is upstream's default
(``transformer_engine``: on a machine without TE, the native backend) unless
``--transformer-impl local`` asks for the local spec. Every fusion keeps upstream's default
(on), which is what the series makes work without Apex; ``--unfused`` adds every
``--no-*-fusion`` flag, ``MEGATRON_ROCM_LOCAL_SDPA=0`` and the local spec: the configuration upstream
itself can run without Apex and TE (the baseline to compare against).

The log is streamed to the terminal and to a file, then parsed: the last line printed is a
one-line JSON summary (losses, mean iteration time without the first 3 iterations, tokens/s,
model TFLOP/s per GPU and MFU). Exit status 1 when training failed, a loss is not finite or
the loss did not go down. See docs/training.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]

# Every upstream switch that turns a fusion off (all exist from core_v0.12.0 to main), plus
# --no-persist-layer-norm, which the torch norm of an unpatched tree requires.
UNFUSED_FLAGS = (
    "--no-gradient-accumulation-fusion",
    "--no-masked-softmax-fusion",
    "--no-bias-gelu-fusion",
    "--no-bias-swiglu-fusion",
    "--no-bias-dropout-fusion",
    "--no-rope-fusion",
    "--no-gradient-reduce-div-fusion",
    "--no-persist-layer-norm",
)


@dataclass(frozen=True)
class Shape:
    """Model and batch dimensions of one preset at one size."""

    num_layers: int
    hidden: int
    ffn: int
    heads: int
    query_groups: int  # == heads: no GQA
    seq_length: int
    micro_batch: int
    global_batch: int  # at data-parallel size 1; scaled by the data-parallel size
    vocab: int  # 128*k - 1: NullTokenizer adds EOD in <=0.19, so both eras pad to 128*k
    lr: float


PEAK_TFLOPS = 989.0  # dense bf16 per GPU, H100 SXM and H200: MFU's denominator
WARM_UP = 3  # iterations left out of the timing: allocator, autotuning, compilation

SHAPES = {
    ("gpt", "small"): Shape(12, 768, 3072, 12, 12, 1024, 8, 8, 50303, 6e-4),
    ("llama", "small"): Shape(12, 768, 2048, 12, 4, 1024, 8, 8, 31999, 6e-4),
    # ~0.85B parameters, head dim 128, seq 2048; micro-batch 2 leaves room for the unfused
    # baseline's [b, heads, s, s] score tensors on one 80 GB GPU.
    ("gpt", "0.85b"): Shape(27, 1536, 6144, 12, 12, 2048, 2, 16, 50303, 3e-4),
    ("llama", "0.85b"): Shape(24, 1536, 5504, 12, 4, 2048, 2, 16, 31999, 3e-4),
    # Two layers of Llama-2-70B's shape (hidden 8192, ffn 28672, 64 heads, 8 kv groups): a
    # model wide enough that attention is a small share of the FLOPs at 8k-16k, so context
    # parallelism can come near linear in tokens/s (on the 0.85B model even a perfect CP=2 at
    # 16k gives only 1.57x the tokens/s of CP=1 at 8k). ~2.2B parameters: fits one 80 GB GPU.
    ("llama", "70b-slice"): Shape(2, 8192, 28672, 64, 8, 8192, 1, 8, 31999, 1.5e-4),
    # Eight of Llama-3 8B's 32 layers (hidden 4096, ffn 14336, 32 heads, 8 kv groups, seq 8192)
    # on one GPU, which cannot hold all 32 with their Adam state: the 8B's layers at its
    # sequence length. The 32k vocabulary keeps the output layer's share of the FLOPs at the
    # 8B's (7%; its own 128k vocabulary over 8 layers would make it 23%).
    ("llama", "8b-slice"): Shape(8, 4096, 14336, 32, 8, 8192, 1, 8, 31999, 3e-4),
}


def padded_vocab(vocab: int, tp: int) -> int:
    """Megatron pads the tokenizer's vocabulary (vocab + EOD) to a multiple of 128 * tp."""
    multiple = 128 * tp
    return -(-(vocab + 1) // multiple) * multiple


def param_count(shape: Shape, preset: str, vocab: int) -> int:
    """Parameters of the model (embeddings once if tied), for the summary only."""
    h, head_dim = shape.hidden, shape.hidden // shape.heads
    q, kv = shape.heads * head_dim, shape.query_groups * head_dim
    llama = preset == "llama"
    mlp = (3 if llama else 2) * h * shape.ffn
    layer = h * (q + 2 * kv) + q * h + mlp
    if llama:
        layer += 2 * h  # two RMSNorm weights
    else:
        layer += (q + 2 * kv) + h + shape.ffn + h + 4 * h  # biases and two LayerNorms
    total = shape.num_layers * layer + vocab * h * (2 if llama else 1) + (h if llama else 2 * h)
    if not llama:
        total += shape.seq_length * h  # learned absolute position embeddings
    return total


def flops_per_iteration(shape: Shape, preset: str, global_batch: int, vocab: int) -> float:
    """Model FLOPs of one iteration, Megatron's formula (causal attention counted half)."""
    h, head_dim = shape.hidden, shape.hidden // shape.heads
    q, kv = shape.heads * head_dim, shape.query_groups * head_dim
    ffn_factor = 3 if preset == "llama" else 2
    dense = shape.num_layers * (h * (q + 2 * kv) + q * h + ffn_factor * h * shape.ffn) + h * vocab
    tokens = global_batch * shape.seq_length
    attention = global_batch * shape.seq_length**2 * q * shape.num_layers
    return 6.0 * (tokens * dense + attention)


def batch_sizes(shape: Shape, opts: argparse.Namespace) -> tuple[int, int]:
    """(micro, global) batch: the preset's unless overridden; global scales with data parallel."""
    micro = opts.micro_batch_size or shape.micro_batch
    dp = opts.nproc // (opts.tp * opts.cp * opts.pp)
    return micro, opts.global_batch_size or max(shape.global_batch, micro) * dp


def megatron_args(shape: Shape, preset: str, opts: argparse.Namespace) -> list[str]:
    """pretrain_gpt.py arguments; flags that exist unchanged from core_v0.12.0 to main."""
    warmup = max(1, min(opts.iters // 10, 100))
    micro, global_batch = batch_sizes(shape, opts)
    args = [
        f"--num-layers={shape.num_layers}",
        f"--hidden-size={shape.hidden}",
        f"--ffn-hidden-size={shape.ffn}",
        f"--num-attention-heads={shape.heads}",
        f"--seq-length={shape.seq_length}",
        f"--max-position-embeddings={shape.seq_length}",
        f"--micro-batch-size={micro}",
        f"--global-batch-size={global_batch}",
        f"--train-iters={opts.iters}",
        f"--lr={shape.lr}",
        f"--min-lr={shape.lr / 10:g}",
        "--lr-decay-style=cosine",
        f"--lr-warmup-iters={warmup}",
        "--weight-decay=0.1",
        "--adam-beta1=0.9",
        "--adam-beta2=0.95",
        "--clip-grad=1.0",
        "--init-method-std=0.02",
        "--bf16",
        *(["--mock-data"] if opts.data_path is None else [f"--data-path={opts.data_path}"]),
        "--tokenizer-type=NullTokenizer",
        f"--vocab-size={shape.vocab}",
        "--split=949,50,1",
        "--eval-iters=1",
        "--eval-interval=1000000",
        "--log-interval=1",
        "--log-throughput",
        f"--tensor-model-parallel-size={opts.tp}",
        f"--context-parallel-size={opts.cp}",
        "--distributed-backend=nccl",
    ]
    if opts.sp:
        args.append("--sequence-parallel")
    if opts.pp > 1:
        args.append(f"--pipeline-model-parallel-size={opts.pp}")
    if opts.vpp > 1:
        # the one spelling every tag from core_v0.12.0 to main accepts (there is no
        # --virtual-pipeline-model-parallel-size flag); parse_cli checks the division
        layers = shape.num_layers // (opts.pp * opts.vpp)
        args.append(f"--num-layers-per-virtual-pipeline-stage={layers}")
    if preset == "llama":
        args += [
            "--normalization=RMSNorm",
            "--swiglu",
            "--position-embedding-type=rope",
            "--untie-embeddings-and-output-weights",
            "--disable-bias-linear",
            "--group-query-attention",
            f"--num-query-groups={shape.query_groups}",
            "--attention-dropout=0.0",
            "--hidden-dropout=0.0",
        ]
    impl = "local" if opts.unfused else opts.transformer_impl
    if impl != "default":
        args.append(f"--transformer-impl={impl}")
    if opts.unfused:
        args += list(UNFUSED_FLAGS)
    return args


# ---------------------------------------------------------------------------- log parsing

_ITER = re.compile(r"\biteration\s+(\d+)/\s*\d+\s*\|")
_FIELDS = {
    "elapsed_ms": re.compile(r"elapsed time per iteration \(ms\):\s*([0-9.]+)"),
    # Megatron formats the loss with {:.6E}: a non-finite one reads NAN or INF
    "loss": re.compile(r"\blm loss:\s*([-+0-9.eEnNaAiIfF]+)"),
    "megatron_tflops": re.compile(r"throughput per GPU \(TFLOP/s/GPU\):\s*([0-9.]+)"),
    "nan_iterations": re.compile(r"number of nan iterations:\s*(\d+)"),
}
_PADDED_VOCAB = re.compile(r"padded vocab \(size: \d+\) with \d+ dummy tokens \(new size: (\d+)\)")


@dataclass
class IterationRecord:
    iteration: int
    loss: float | None
    elapsed_ms: float | None
    megatron_tflops: float | None
    nan_iterations: int


def _field(name: str, line: str) -> float | None:
    m = _FIELDS[name].search(line)
    return float(m.group(1)) if m else None


def parse_log(lines: list[str]) -> tuple[list[IterationRecord], int | None]:
    """Training-iteration records (one per logged iteration) and Megatron's padded vocab."""
    records, vocab = [], None
    for line in lines:
        if m := _PADDED_VOCAB.search(line):
            vocab = int(m.group(1))
        if m := _ITER.search(line):
            records.append(
                IterationRecord(
                    iteration=int(m.group(1)),
                    loss=_field("loss", line),
                    elapsed_ms=_field("elapsed_ms", line),
                    megatron_tflops=_field("megatron_tflops", line),
                    nan_iterations=int(_field("nan_iterations", line) or 0),
                )
            )
    return records, vocab


_EXCEPTION = re.compile(
    r"\b((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception)): ((?:(?!\\n|', ').){0,160})"
)


def last_exception(lines: list[str]) -> str | None:
    """The last ``SomeError: message`` in the log, so a failed run says why (an out-of-memory
    at a large micro-batch, a missing module) without opening the log. Megatron also prints
    tracebacks as a Python list of strings, hence the stop at a literal ``\\n`` or ``', '``."""
    found = None
    for line in lines:
        for m in _EXCEPTION.finditer(line):
            if not m.group(1).endswith("ChildFailedError"):  # torchrun's wrapper, not the cause
                found = f"{m.group(1)}: {m.group(2).strip()}"
    return found


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def summarize(
    records: list[IterationRecord],
    *,
    flops_per_iter: float,
    tokens_per_iter: int,
    ngpus: int,
    peak_tflops: float,
) -> tuple[dict, list[str]]:
    """Loss and speed summary, and the problems that make the run a failure."""
    problems: list[str] = []
    losses = [r.loss for r in records if r.loss is not None]
    if len(losses) < 2:
        problems.append(f"only {len(losses)} training iterations with a loss in the log")
    # Megatron prints no loss at all for an iteration whose loss is NaN (it logs avg >= 0 only).
    silent = [r.iteration for r in records if r.loss is None]
    if any(not math.isfinite(x) for x in losses) or any(r.nan_iterations for r in records):
        problems.append("loss is not finite")
    elif silent:
        problems.append(f"no loss logged at iterations {silent[:5]} (NaN?)")
    k = max(1, min(5, len(losses) // 4))
    head, tail = _mean(losses[:k]), _mean(losses[-k:])
    if len(losses) >= 2 and not problems and not tail < head:
        problems.append(f"loss did not decrease (first {k}: {head:.4f}, last {k}: {tail:.4f})")
    timed = [r for r in records[WARM_UP:] if r.elapsed_ms is not None] or records[-1:]
    mean_ms = _mean([r.elapsed_ms for r in timed if r.elapsed_ms is not None])
    summary: dict = {
        "iterations": len(records),
        "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None,
        "mean_iter_ms": round(mean_ms, 2) if mean_ms else None,
    }
    if mean_ms:
        seconds = mean_ms / 1000.0
        tflops = flops_per_iter / seconds / ngpus / 1e12
        summary["tokens_per_s"] = round(tokens_per_iter / seconds, 1)
        summary["tflops_per_gpu"] = round(tflops, 2)
        summary["mfu"] = round(tflops / peak_tflops, 4)
        # Reported next to the mean, never instead of it: one slow iteration (a Python GC
        # pass, which upstream's --manual-gc exists to avoid) moves a 10-iteration mean by
        # several ms; the median says what a steady iteration costs.
        median_ms = statistics.median(r.elapsed_ms for r in timed if r.elapsed_ms is not None)
        summary["median_iter_ms"] = round(median_ms, 2)
        summary["tokens_per_s_at_median"] = round(tokens_per_iter / (median_ms / 1000.0), 1)
        median_tflops = flops_per_iter / (median_ms / 1000.0) / ngpus / 1e12
        summary["mfu_at_median"] = round(median_tflops / peak_tflops, 4)
    reported = [r.megatron_tflops for r in timed if r.megatron_tflops is not None]
    summary["megatron_tflops_per_gpu"] = round(_mean(reported), 2) if reported else None
    return summary, problems


# ---------------------------------------------------------------------------- running


def megatron_version(tree: Path) -> str | None:
    info = tree / "megatron" / "core" / "package_info.py"
    if not info.is_file():
        return None
    text = info.read_text()
    parts = [re.search(rf"^{k}\s*=\s*(\d+)", text, re.M) for k in ("MAJOR", "MINOR", "PATCH")]
    return ".".join(m.group(1) for m in parts) if all(parts) else None


def run_training(
    cmd: list[str], env: dict[str, str], cwd: Path, log_path: Path
) -> tuple[int, list[str]]:
    """Run ``cmd``, echoing its output and writing it to ``log_path``; return (rc, lines)."""
    lines = []
    with (
        log_path.open("w") as log,
        subprocess.Popen(
            cmd,
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
        ) as proc,
    ):
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            log.write(line)
            lines.append(line)
    return proc.returncode, lines


def add_peak_tflops(parser: argparse.ArgumentParser) -> None:
    """``--peak-tflops``: MFU's denominator (train_small's runs and example_summary's logs)."""
    parser.add_argument(
        "--peak-tflops",
        type=float,
        default=PEAK_TFLOPS,
        help=f"peak dense bf16 TFLOP/s per GPU for MFU (default {PEAK_TFLOPS:g}: H100 SXM, H200)",
    )


def parse_cli(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("tree", type=Path, help="patched Megatron-LM checkout (has pretrain_gpt.py)")
    p.add_argument("--preset", choices=("gpt", "llama"), default="llama")
    p.add_argument("--preset-size", choices=sorted({size for _, size in SHAPES}), default="small")
    p.add_argument("--iters", type=int, default=50, help="training iterations (default 50)")
    p.add_argument("--nproc", type=int, default=1, help="GPUs / torchrun processes (default 1)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    p.add_argument("--sp", action="store_true", help="sequence parallelism (needs --tp > 1)")
    p.add_argument("--cp", type=int, default=1, help="context-parallel size (default 1)")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (default 1)")
    p.add_argument(
        "--vpp",
        type=int,
        default=1,
        help="virtual pipeline stages per pipeline rank, the interleaved schedule (default 1: "
        "none); needs --pp 2 or more and the preset's layers divisible by pp x vpp",
    )
    p.add_argument("--seq-length", type=int, help="override the preset's sequence length")
    p.add_argument(
        "--transformer-impl",
        choices=("default", "transformer_engine", "local"),
        default="default",
        help="default: pass no flag (upstream's default, transformer_engine)",
    )
    p.add_argument(
        "--unfused", action="store_true", help="every --no-*-fusion flag, no SDPA, local spec"
    )
    p.add_argument(
        "--data-path",
        type=Path,
        help="an indexed dataset prefix of NullTokenizer ids below the preset's vocab "
        "(scripts/training/markov_corpus.py writes one) instead of --mock-data",
    )
    p.add_argument("--micro-batch-size", type=int, help="override the preset's micro-batch")
    p.add_argument("--global-batch-size", type=int, help="override the preset's global batch")
    add_peak_tflops(p)
    p.add_argument("--log", type=Path, help="log file (default train_small-<preset>-<size>.log)")
    p.add_argument("--parse-log", type=Path, help="summarise an existing log; do not train")
    p.add_argument("--dry-run", action="store_true", help="print the command and exit")
    p.epilog = "Arguments after a lone -- are passed on to pretrain_gpt.py."
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    opts = p.parse_args(argv[: len(argv) - len(extra) - (1 if "--" in argv else 0)])
    opts.extra = extra
    for name in ("nproc", "tp", "cp", "pp", "vpp"):
        if getattr(opts, name) < 1:
            p.error(f"--{name} must be 1 or more")
    if opts.nproc % (opts.tp * opts.cp * opts.pp):
        p.error(
            f"--nproc {opts.nproc} is not a multiple of "
            f"--tp {opts.tp} x --cp {opts.cp} x --pp {opts.pp}"
        )
    if opts.sp and opts.tp < 2:
        p.error("--sp needs --tp 2 or more")
    if opts.data_path is not None:
        opts.data_path = opts.data_path.resolve()  # pretrain_gpt.py runs in the tree
        for suffix in (".idx", ".bin"):
            if not opts.data_path.with_name(opts.data_path.name + suffix).is_file():
                p.error(f"--data-path: no {opts.data_path}{suffix}")
    if opts.vpp > 1:
        layers = SHAPES[(opts.preset, opts.preset_size)].num_layers
        if opts.pp < 2:
            p.error("--vpp needs --pp 2 or more")
        if layers % (opts.pp * opts.vpp):
            p.error(
                f"--pp {opts.pp} x --vpp {opts.vpp} does not divide the "
                f"{layers} layers of {opts.preset} {opts.preset_size}"
            )
    return opts


def main(argv: list[str] | None = None) -> int:
    opts = parse_cli(argv)
    shape = SHAPES[(opts.preset, opts.preset_size)]
    if opts.seq_length:
        shape = dataclasses.replace(shape, seq_length=opts.seq_length)
    tree = opts.tree.resolve()
    args = megatron_args(shape, opts.preset, opts) + opts.extra
    # --standalone: torchrun's rendezvous store listens on a port the OS picks (localhost:0)
    # and the ranks' MASTER_PORT is that store's or another free one, so runs started side by
    # side (one per GPU with CUDA_VISIBLE_DEVICES) do not meet on a fixed 29500.
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={opts.nproc}",
        "pretrain_gpt.py",
        *args,
    ]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(tree), str(REPO_ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    )
    env.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    if opts.unfused:
        env["MEGATRON_ROCM_LOCAL_SDPA"] = "0"
    if opts.dry_run:
        sdpa = "MEGATRON_ROCM_LOCAL_SDPA=0 " if opts.unfused else ""
        print(f"cd {tree} && {sdpa}" + " ".join(cmd))
        return 0

    suffix = "-unfused" if opts.unfused else f"-{opts.transformer_impl}"
    log_path = opts.log or Path(f"train_small-{opts.preset}-{opts.preset_size}{suffix}.log")
    if opts.parse_log:
        rc, lines = 0, opts.parse_log.read_text(errors="replace").splitlines()
    else:
        if not (tree / "pretrain_gpt.py").is_file():
            print(f"error: {tree} has no pretrain_gpt.py", file=sys.stderr)
            return 2
        rc, lines = run_training(cmd, env, tree, log_path)

    records, logged_vocab = parse_log(lines)
    vocab = logged_vocab or padded_vocab(shape.vocab, opts.tp)
    micro, global_batch = batch_sizes(shape, opts)
    summary, problems = summarize(
        records,
        flops_per_iter=flops_per_iteration(shape, opts.preset, global_batch, vocab),
        tokens_per_iter=global_batch * shape.seq_length,
        ngpus=opts.nproc,
        peak_tflops=opts.peak_tflops,
    )
    if rc != 0:
        problems.insert(0, f"training exited with status {rc}")
    if problems and (error := last_exception(lines)):
        problems.insert(1 if rc else 0, error)
    result = {
        "tree": str(tree),
        "megatron_version": megatron_version(tree),
        "preset": opts.preset,
        "size": opts.preset_size,
        "unfused": opts.unfused,
        "transformer_impl": "local" if opts.unfused else opts.transformer_impl,
        "nproc": opts.nproc,
        "tp": opts.tp,
        "cp": opts.cp,
        "pp": opts.pp,
        "vpp": opts.vpp,
        "sp": opts.sp,
        "seq_length": shape.seq_length,
        "micro_batch_size": micro,
        "global_batch_size": global_batch,
        "params": param_count(shape, opts.preset, vocab),
        **summary,
        "peak_tflops": opts.peak_tflops,
        "log": str(opts.parse_log or log_path),
        "ok": not problems,
        "problems": problems,
    }
    print(json.dumps(result))
    return 0 if not problems else 1


if __name__ == "__main__":
    raise SystemExit(main())
