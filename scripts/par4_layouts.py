"""validate_par4.py's four layouts and their one-GPU baselines, as train_small.py options plus
the pretrain_gpt.py flags after its ``--`` (the script's docstring says what each one runs)."""

from __future__ import annotations

from dataclasses import dataclass

from par4_report import SHAPE

NPROC = 4


def moe_flags(ep: int) -> tuple[str, ...]:
    """8 experts; the flag names are the same from core_v0.12.0 to main."""
    return (
        "--num-experts=8",
        f"--expert-model-parallel-size={ep}",
        "--moe-grouped-gemm",
        "--moe-token-dispatcher-type=alltoall",
        "--moe-router-topk=2",
        # upstream's default 0.0 leaves the router unbalanced; 1e-2 as examples/mixtral
        "--moe-aux-loss-coeff=1e-2",
    )


DETERMINISTIC = ("--deterministic-mode",)  # upstream's; DETERMINISTIC_ENV goes with it
DISTOPT_FLAGS = ("--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather")


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
    seq_length: int = SHAPE.seq_length
    micro: int = SHAPE.micro_batch
    global_batch: int | None = None  # None: the preset's per data-parallel replica
    flags: tuple[str, ...] = ()  # to pretrain_gpt.py
    resume: bool = False

    @property
    def dp(self) -> int:
        return self.nproc // (self.tp * self.cp * self.pp)

    @property
    def batch(self) -> int:
        return self.global_batch or SHAPE.global_batch * self.dp

    def options(self) -> list[str]:
        """train_small.py options (the flags after its ``--`` come separately)."""
        opts = ["--nproc", str(self.nproc), "--tp", str(self.tp)]
        opts += ["--sp"] if self.sp else []
        opts += ["--pp", str(self.pp), "--vpp", str(self.vpp), "--cp", str(self.cp)]
        opts += ["--seq-length", str(self.seq_length), "--micro-batch-size", str(self.micro)]
        return opts + ["--global-batch-size", str(self.batch)]


LAYOUTS = {
    layout.name: layout
    for layout in (
        Layout("tp2pp2vpp", tp=2, sp=True, pp=2, vpp=2, micro=1, global_batch=8, resume=True),
        Layout("tp2cp2", tp=2, sp=True, cp=2, seq_length=16384, micro=1, global_batch=8),
        Layout("ep4moe", ep=4, flags=moe_flags(4)),
        Layout("dp4distopt", flags=DISTOPT_FLAGS, resume=True),
    )
}


def baseline(layout: Layout) -> Layout:
    """The same model, sequence, micro-batch and batch per data-parallel replica, one GPU."""
    flags = moe_flags(1) if layout.ep > 1 else ()
    return Layout(
        f"{layout.name}-1gpu",
        nproc=1,
        seq_length=layout.seq_length,
        micro=layout.micro,
        global_batch=layout.batch // layout.dp,
        flags=flags,
    )
