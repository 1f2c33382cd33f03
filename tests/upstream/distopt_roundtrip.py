"""Save -> fresh load -> continue with Megatron's DistributedOptimizer, on CPU (gloo).

    python distopt_roundtrip.py --tree TREE --format torch_dist:dp_reshardable \
        --precision bf16 --world 2 --out result.json

``--format`` is ``torch`` (``state_dict()`` + ``save_parameter_state()``, what
``--ckpt-format torch`` does) or ``torch_dist:<sharding type>`` (``sharded_state_dict()`` +
``dist_checkpointing.save/load``, what ``--ckpt-format torch_dist`` does with that
``distrib_optim_sharding_type``). A tiny two-layer MegatronModule trains 3 steps, is saved
with its optimizer, and a fresh DDP + optimizer loads it. Then both train 3 more steps. The
run is ok when the loaded optimizer state equals the saved one (main params, exp_avg,
exp_avg_sq, step, grad scaler) and the continued losses and final states are bit-identical.

Without RANK in the environment this is the launcher: it starts ``--world`` ranks of itself
and writes rank 0's verdict (plus the others' errors) to ``--out``. The upstream code runs
unmodified; ``cpu_shim`` only maps its CUDA allocations to the CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import inspect
import json
import os
import sys
import tempfile
import traceback
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
TRAIN, MORE = 3, 3  # steps before the save, steps after it


def launch(args: argparse.Namespace) -> int:
    from gloo_ranks import run_ranks

    out = Path(args.out)
    with tempfile.TemporaryDirectory(prefix="distopt-") as ckpt:
        cmd = [sys.executable, __file__, *sys.argv[1:], "--ckpt", ckpt]
        results = run_ranks(cmd, args.world, out, args.timeout)
    verdict = dict(results[0])
    verdict["ok"] = all(r["ok"] for r in results)
    verdict["errors"] = [r.get("error") for r in results if r.get("error")]
    out.write_text(json.dumps(verdict, indent=1))
    return 0


def _fields(cls: type, **kwargs: object) -> dict:
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in kwargs.items() if k in names}


def _finish_on_a_copy() -> None:
    """torch 2.11's ``FileSystemWriter.finish`` pickles ``dataclasses.replace(metadata, ...)``,
    so only dataclass fields reach the checkpoint; torch 2.13 pickles the object itself. This
    makes any torch behave like 2.11 (what the GPU box runs)."""
    from torch.distributed.checkpoint import filesystem

    owner = next(c for c in filesystem.FileSystemWriter.__mro__ if "finish" in vars(c))
    original = owner.finish

    def finish(self, metadata, results):  # noqa: ANN001, ANN202
        return original(self, dataclasses.replace(metadata), results)

    owner.finish = finish


def run_rank(args: argparse.Namespace) -> dict:
    sys.path.insert(0, args.tree)
    sys.path.insert(0, str(HERE))
    warnings.simplefilter("ignore")
    import cpu_shim
    import torch

    cpu_shim.install()
    if args.finish_on_a_copy:
        _finish_on_a_copy()
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120)
    )
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.initialize_model_parallel()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.precision]
    half = {"fp16": args.precision == "fp16", "bf16": args.precision == "bf16"}
    config = TransformerConfig(
        num_layers=1,
        hidden_size=8,
        num_attention_heads=1,
        use_cpu_initialization=True,
        params_dtype=dtype,
        **half,
    )

    class Tiny(MegatronModule):
        """Odd sizes, so DP ranks split parameters mid-tensor."""

        def __init__(self) -> None:
            super().__init__(config)
            self.a = torch.nn.Linear(8, 13)
            self.b = torch.nn.Linear(13, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(torch.tanh(self.a(x.to(dtype)))).float()

    def build() -> tuple:
        torch.manual_seed(0)
        ddp = DistributedDataParallel(
            config,
            DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True),
            Tiny().to(dtype),
        )
        opt_kwargs = _fields(
            OptimizerConfig,
            optimizer="adam",
            lr=1e-2,
            weight_decay=0.1,
            clip_grad=1.0,
            use_distributed_optimizer=True,
            params_dtype=dtype,
            **half,
        )
        if args.precision == "fp16":  # a scaler whose state changes within TRAIN steps
            opt_kwargs.update(initial_loss_scale=2.0**12, loss_scale_window=2, hysteresis=2)
        return ddp, get_megatron_optimizer(OptimizerConfig(**opt_kwargs), [ddp])

    def step(ddp, opt, i: int) -> float:
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 + i * world + rank))
        ddp.zero_grad_buffer()
        opt.zero_grad()
        loss = ddp(x).pow(2).mean()
        (loss * opt.get_loss_scale()).backward()
        ddp.finish_grad_sync()
        opt.step()
        return loss.item()

    def inner(opt) -> list:
        return list(getattr(opt, "chained_optimizers", [opt]))

    def snapshot(opt) -> dict:
        out = {}
        for j, o in enumerate(inner(opt)):
            for gi, group in enumerate(o.optimizer.param_groups):
                for pi, p in enumerate(group["params"]):
                    out[f"{j}.{gi}.{pi}.param"] = p.detach().clone()
                    for k, v in o.optimizer.state.get(p, {}).items():
                        out[f"{j}.{gi}.{pi}.{k}"] = v.detach().clone() if torch.is_tensor(v) else v
            for k, v in (o.grad_scaler.state_dict() if o.grad_scaler else {}).items():
                out[f"{j}.grad_scaler.{k}"] = v.detach().clone() if torch.is_tensor(v) else v
        return out

    def differences(a: dict, b: dict) -> list[str]:
        diffs = []
        for k in sorted(set(a) | set(b)):
            if k not in a or k not in b:
                diffs.append(f"{k}: only {'before' if k in a else 'after'} the load")
            elif torch.is_tensor(a[k]):
                if a[k].shape != b[k].shape or not torch.equal(a[k].float(), b[k].float()):
                    diffs.append(
                        f"{k}: {a[k].flatten()[:2].tolist()} vs {b[k].flatten()[:2].tolist()}"
                    )
            elif a[k] != b[k]:
                diffs.append(f"{k}: {a[k]} vs {b[k]}")
        return diffs

    def optim_kwargs(opt, sharding: str) -> dict:
        params = inspect.signature(inner(opt)[0].sharded_state_dict).parameters
        if "metadata" in params:  # 0.13+; 0.15+ training also passes the last two
            meta = {
                "distrib_optim_sharding_type": sharding,
                "singleton_local_shards": False,
                "chained_optim_avoid_prefix": True,
            }
            return {"metadata": meta}
        return {"sharding_type": sharding}

    ckpt = Path(args.ckpt)
    fmt, _, sharding = args.format.partition(":")

    def save(ddp, opt) -> None:
        if fmt == "torch":
            state = {"model": ddp.module.state_dict(), "optimizer": opt.state_dict()}
            if rank == 0:
                torch.save(state, ckpt / "model_optim_rng.pt")
            opt.save_parameter_state(str(ckpt / "distrib_optim.pt"))
        else:
            model_sd = ddp.module.sharded_state_dict()
            optim_sd = opt.sharded_state_dict(model_sd, **optim_kwargs(opt, sharding))
            dist_checkpointing.save({"model": model_sd, "optimizer": optim_sd}, str(ckpt))
        dist.barrier()

    def load(ddp, opt) -> None:
        if fmt == "torch":
            state = torch.load(ckpt / "model_optim_rng.pt", weights_only=False)
            ddp.module.load_state_dict(state["model"])
            opt.load_state_dict(state["optimizer"])
            opt.load_parameter_state(str(ckpt / "distrib_optim.pt"))
        else:
            model_sd = ddp.module.sharded_state_dict()
            optim_sd = opt.sharded_state_dict(
                model_sd, is_loading=True, **optim_kwargs(opt, sharding)
            )
            loaded = dist_checkpointing.load({"model": model_sd, "optimizer": optim_sd}, str(ckpt))
            ddp.module.load_state_dict(loaded["model"])
            opt.load_state_dict(loaded["optimizer"])

    result: dict = {"format": args.format, "precision": args.precision, "world": world}
    phase = "train"
    try:
        if "group_step" in vars(args):  # given (its default is no attribute at all)
            phase = "group step"
            result.update(group_step_roundtrip(args.group_step, build, inner, save, load, rank))
        else:
            ddp, opt = build()
            for i in range(TRAIN):
                step(ddp, opt, i)
            saved = snapshot(opt)
            phase = "save"
            save(ddp, opt)
            phase = "load"
            ddp2, opt2 = build()
            load(ddp2, opt2)
            phase = "compare"
            result["load_diffs"] = differences(saved, snapshot(opt2))
            straight = [step(ddp, opt, i) for i in range(TRAIN, TRAIN + MORE)]
            resumed = [step(ddp2, opt2, i) for i in range(TRAIN, TRAIN + MORE)]
            result["losses"] = {"straight": straight, "resumed": resumed}
            result["final_diffs"] = differences(snapshot(opt), snapshot(opt2))
            steps = {float(v) for k, v in snapshot(opt2).items() if k.endswith(".step")}
            result["steps_after"] = sorted(steps)
            result["ok"] = (
                not result["load_diffs"] and not result["final_diffs"] and straight == resumed
            )
    except Exception as e:  # noqa: BLE001 - the verdict carries it
        tb = traceback.extract_tb(e.__traceback__)[-1]
        result["ok"] = False
        result["error"] = (
            f"{phase}: {type(e).__name__}: {e} ({Path(tb.filename).name}:{tb.lineno} {tb.name})"
        )
    dist.barrier()
    dist.destroy_process_group()
    return result


def group_step_roundtrip(step, build, inner, save, load, rank: int) -> dict:  # noqa: ANN001
    """Upstream's ``test_optimizer_common_state_dict``: before any optimizer step, a TE-style
    ``step`` in the param groups (on rank 0 only in the first group, as TE's FusedAdam can
    leave it; with ``test_step``), or none (``step`` None: reported as None, as TE does), must
    come back from a save and a fresh load. The caller reports an exception and ends the world."""

    def group_steps(opt) -> list:  # noqa: ANN001
        states = opt.state_dict()
        states = states if isinstance(states, list) else [states]
        return [g.get("step") for sd in states for g in sd["optimizer"]["param_groups"]]

    ddp, opt = build()
    for o in inner(opt):
        o.init_state_fn(o.optimizer)  # Adam's moments without a step, as upstream's test seeds
        for i, group in enumerate(o.optimizer.param_groups):
            if step is not None and (rank > 0 or i == 0):
                group["step"] = step
    saved = group_steps(opt)
    save(ddp, opt)
    ddp2, opt2 = build()
    load(ddp2, opt2)
    loaded = group_steps(opt2)
    ok = saved == loaded and all(s == step for s in saved)
    return {"group_steps": {"saved": saved, "loaded": loaded}, "ok": ok}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tree", required=True)
    ap.add_argument("--format", required=True)
    ap.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="bf16")
    ap.add_argument("--world", type=int, default=1)
    ap.add_argument("--out", required=True)
    ap.add_argument("--ckpt")
    ap.add_argument("--timeout", type=float, default=240)
    ap.add_argument(
        "--finish-on-a-copy",
        action="store_true",
        help="write the checkpoint metadata the way torch 2.11 does (a dataclasses.replace copy)",
    )
    ap.add_argument(
        "--group-step",
        type=lambda v: None if v == "none" else int(v),
        default=argparse.SUPPRESS,
        help="no training: set this TE-style step in the param groups (none: set none), save, "
        "load, compare the steps the optimizer reports",
    )
    args = ap.parse_args()
    if "RANK" not in os.environ:
        return launch(args)
    result = run_rank(args)
    Path(args.out).with_suffix(f".rank{os.environ['RANK']}.json").write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
