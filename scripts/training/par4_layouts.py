"""validate_par4.py's four layouts and their one-GPU baselines, as train_small.py options plus
the pretrain_gpt.py flags after its ``--`` (the script's docstring says what each one runs),
for each Llama preset size the table can be made on (``layouts``)."""

from __future__ import annotations

from dataclasses import dataclass

from scripts.training.train_small import SHAPES

NPROC = 4
SIZES = ("small", "0.85b")  # train_small.py's --preset-size values the layouts are sized for
# The 0.85B experts' FFN: a quarter of the dense FFN (5504), so the one-GPU baseline's 8
# experts (~1.4B parameters with the rest, ~25 GB of weights, gradients and Adam state) fit one
# 80 GB GPU; at the dense width they would need ~90 GB.
MOE_FFN_0_85B = 1376


def moe_flags(ep: int, ffn: int | None = None) -> tuple[str, ...]:
    """8 experts; the flag names are the same from core_v0.12.0 to main."""
    return (
        "--num-experts=8",
        f"--expert-model-parallel-size={ep}",
        "--moe-grouped-gemm",
        "--moe-token-dispatcher-type=alltoall",
        "--moe-router-topk=2",
        # upstream's default 0.0 leaves the router unbalanced; 1e-2 as examples/mixtral
        "--moe-aux-loss-coeff=1e-2",
        *((f"--moe-ffn-hidden-size={ffn}",) if ffn else ()),
    )


DETERMINISTIC = ("--deterministic-mode",)  # upstream's; DETERMINISTIC_ENV goes with it
DISTOPT_FLAGS = ("--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather")
_SMALL = SHAPES[("llama", "small")]  # micro 8 and global 8 per data-parallel replica, seq 1024


@dataclass(frozen=True)
class Layout:
    """One run's parallel layout, as train_small.py options plus pretrain_gpt.py flags."""

    name: str
    nproc: int = NPROC
    tp: int = 1
    sp: bool = False
    pp: int = 1
    vpp: int = 1
    cp: int = 1
    ep: int = 1
    seq_length: int = _SMALL.seq_length
    micro: int = _SMALL.micro_batch
    global_batch: int | None = None  # None: per_replica per data-parallel replica
    flags: tuple[str, ...] = ()  # to pretrain_gpt.py
    resume: bool = False
    size: str = "small"  # train_small.py's --preset-size (the Llama preset)
    per_replica: int = _SMALL.global_batch

    @property
    def dp(self) -> int:
        return self.nproc // (self.tp * self.cp * self.pp)

    @property
    def batch(self) -> int:
        return self.global_batch or self.per_replica * self.dp

    def options(self) -> list[str]:
        """train_small.py options (the flags after its ``--`` come separately)."""
        opts = ["--nproc", str(self.nproc), "--tp", str(self.tp)]
        opts += ["--sp"] if self.sp else []
        opts += ["--pp", str(self.pp), "--vpp", str(self.vpp), "--cp", str(self.cp)]
        opts += ["--seq-length", str(self.seq_length), "--micro-batch-size", str(self.micro)]
        return opts + ["--global-batch-size", str(self.batch)]


def _small() -> tuple[Layout, ...]:
    """The small Llama: every micro-batch is ~50 ms of launches on the host, so the layouts
    that run micro-batches of 1 are host-bound."""
    return (
        Layout("tp2pp2vpp", tp=2, sp=True, pp=2, vpp=2, micro=1, global_batch=8, resume=True),
        Layout("tp2cp2", tp=2, sp=True, cp=2, seq_length=16384, micro=1, global_batch=8),
        Layout("ep4moe", ep=4, flags=moe_flags(4)),
        Layout("dp4distopt", flags=DISTOPT_FLAGS, resume=True),
    )


def _large() -> tuple[Layout, ...]:
    """The 0.85B Llama, with micro-batches of 16k tokens each (8 x 2048, or 1 x 16384 under
    CP): at micro-batch 2 its step is bound by the host on the lent machines, at 16 by the
    GPU, so each rank gets GPU work to hide its host's."""
    common = {"size": "0.85b", "seq_length": 2048, "micro": 8, "per_replica": 8}
    return (
        Layout(
            "tp2pp2vpp", tp=2, sp=True, pp=2, vpp=2, **{**common, "per_replica": 64}, resume=True
        ),
        Layout("tp2cp2", tp=2, sp=True, cp=2, **{**common, "seq_length": 16384, "micro": 1}),
        Layout("ep4moe", ep=4, flags=moe_flags(4, MOE_FFN_0_85B), **common),
        Layout("dp4distopt", flags=DISTOPT_FLAGS, resume=True, **common),
    )


def layouts(size: str = "small") -> dict[str, Layout]:
    """The four layouts sized for the Llama preset ``size`` (one of ``SIZES``), by name."""
    if size not in SIZES:
        raise ValueError(f"no par4 layouts for preset size {size!r}; choose from {SIZES}")
    return {layout.name: layout for layout in (_small() if size == "small" else _large())}


def baseline(layout: Layout) -> Layout:
    """The same model, sequence, micro-batch and batch per data-parallel replica, one GPU (the
    MoE layout's experts at EP1)."""
    expert_parallel = f"--expert-model-parallel-size={layout.ep}"
    flags = (
        tuple("--expert-model-parallel-size=1" if f == expert_parallel else f for f in layout.flags)
        if layout.ep > 1
        else ()
    )
    return Layout(
        f"{layout.name}-1gpu",
        nproc=1,
        seq_length=layout.seq_length,
        micro=layout.micro,
        global_batch=layout.batch // layout.dp,
        flags=flags,
        size=layout.size,
    )
