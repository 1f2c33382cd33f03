"""Test-only: the real-data path on a patched megatron-core sdist (no tools/, no pretrain_gpt.py).

    python sdist_pretrain.py first  --tree TREE --work WORK --out first.json
    python sdist_pretrain.py resume --tree TREE --work WORK --out resumed.json

``first`` does what ``preprocess_data.py`` does, through upstream's own writer: the corpus
tokenized by the locally trained BPE, each document with an EOD appended, written by
``IndexedDatasetBuilder`` (the dtype ``DType.optimal_dtype`` picks for the vocabulary) and read
back through ``IndexedDataset``; builds the C++ dataset helpers as ``megatron-rocm install``
does (an sdist has no Makefile for ``compile_helpers``); then the GPT dataset through
``BlendedMegatronDatasetBuilder`` + ``GPTDatasetConfig``, and trains a GPTModel on the TE spec
(the native backend) with Megatron's DDP, ``get_megatron_optimizer``, its LR scheduler and
``get_forward_backward_func`` to ITERS // 2, then saves with ``dist_checkpointing``
(torch_dist). ``resume`` is a fresh process: it loads that checkpoint and trains on to ITERS
from the sample the first run stopped at. One gloo rank; ``cpu_shim`` maps CUDA to the CPU.
Each writes one JSON object (losses by iteration, the data's token count and entropy).
``SDIST_PRETRAIN_LR`` overrides the learning rate (0 shows the verdict failing a run that
cannot learn).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import warnings
from functools import partial
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "upstream"))  # cpu_shim

from megatron_rocm.envtools import installer  # noqa: E402
from megatron_rocm.envtools.smoke import checks_realdata as spec  # noqa: E402
from megatron_rocm.envtools.smoke import realdata  # noqa: E402

H = spec.HPARAMS
SEQ, MBS = int(H["seq-length"]), int(H["micro-batch-size"])
GBS = int(H["global-batch-size"])
HALF = spec.ITERS // 2
PREFIX = "corpus_text_document"  # the name preprocess_data.py gives --output-prefix=corpus


def bpe_tokenizer(work: Path, vocab: dict[str, int], ranks: list[tuple[str, str]]):  # noqa: ANN201
    """The local GPT-2 style BPE as a Megatron tokenizer, what ``--tokenizer-type
    GPT2BPETokenizer`` gives pretrain_gpt.py (a ``MegatronLegacyTokenizer``: ids, EOD, no pad)."""
    from megatron.core.datasets.megatron_tokenizer import MegatronLegacyTokenizer

    class BPE(MegatronLegacyTokenizer):
        def tokenize(self, text: str) -> list[int]:
            return realdata.encode(text, ranks, vocab)

        @property
        def vocab(self) -> dict[str, int]:
            return vocab

        @property
        def inv_vocab(self) -> dict[int, str]:
            return {i: t for t, i in vocab.items()}

        @property
        def vocab_size(self) -> int:
            return len(vocab)

        @property
        def eod(self) -> int:
            return vocab[realdata.EOD]

    tok = work / "tokenizer"
    return BPE(str(tok / "vocab.json"), str(tok / "merges.txt"))


def write_dataset(work: Path, texts: list[str], tok) -> tuple[int, float]:
    """preprocess_data.py's per-document step: ids + [EOD], one sentence, upstream's writer."""
    import numpy
    import torch
    from megatron.core.datasets.indexed_dataset import DType, IndexedDataset, IndexedDatasetBuilder

    prefix = str(work / PREFIX)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=DType.optimal_dtype(tok.vocab_size))
    docs = []
    for text in texts:
        ids = tok.tokenize(text) + [tok.eod]
        docs.append(ids)
        builder.add_document(torch.tensor(ids), [len(ids)])
    builder.finalize(prefix + ".idx")
    read = IndexedDataset(prefix)
    back = [read[i].tolist() for i in range(len(read))]
    if back != docs:
        raise AssertionError(f"IndexedDataset read {len(back)} documents back, wrote {len(docs)}")
    tokens = numpy.concatenate([read[i] for i in range(len(read))]).tolist()
    return len(tokens), realdata.unigram_entropy(tokens)


def build_helpers(tree: Path) -> None:
    """The C++ helpers for this interpreter, as ``install`` builds them for an sdist tree."""
    cpp = tree / "megatron" / "core" / "datasets" / "helpers.cpp"
    cmd = installer.helpers_command(cpp, partial(subprocess.run, capture_output=True, text=True))
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"helpers.cpp did not build: {done.stderr[-800:]}")


def train_dataset(work: Path, tok):  # noqa: ANN201 - a megatron GPTDataset
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    config = GPTDatasetConfig(
        random_seed=int(H["seed"]),
        sequence_length=SEQ,
        blend=([str(work / PREFIX)], None),
        split="98,2,0",
        path_to_cache=str(work / "index-cache"),
        tokenizer=tok,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
    )
    sizes = [spec.ITERS * GBS, GBS, None]
    train, _, _ = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()
    return train


def model_and_optimizer(tok):  # noqa: ANN201 - (DDP model, optimizer, scheduler)
    import torch
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(int(H["seed"]))
    model_parallel_cuda_manual_seed(int(H["seed"]))
    config = TransformerConfig(
        num_layers=int(H["num-layers"]),
        hidden_size=int(H["hidden-size"]),
        ffn_hidden_size=int(H["ffn-hidden-size"]),
        num_attention_heads=int(H["num-attention-heads"]),
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_dropout_fusion=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
    )
    padded = -(-tok.vocab_size // 128) * 128  # Megatron pads the vocabulary to 128 (TP 1)
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_with_transformer_engine_spec(),
        vocab_size=padded,
        max_sequence_length=int(H["max-position-embeddings"]),
    )
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(), model)
    lr = float(os.environ.get("SDIST_PRETRAIN_LR", H["lr"]))
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=lr,
        min_lr=min(lr, float(H["min-lr"])),  # the scheduler reads both from the param groups
        weight_decay=float(H["weight-decay"]),
        clip_grad=float(H["clip-grad"]),
    )
    opt = get_megatron_optimizer(opt_config, [ddp])
    sched = OptimizerParamScheduler(
        opt,
        init_lr=0.0,
        max_lr=opt_config.lr,
        min_lr=opt_config.min_lr,
        lr_warmup_steps=int(H["lr-warmup-iters"]) * GBS,
        lr_decay_steps=spec.ITERS * GBS,
        lr_decay_style=str(H["lr-decay-style"]),
        start_wd=opt_config.weight_decay,
        end_wd=opt_config.weight_decay,
        wd_incr_steps=spec.ITERS * GBS,
        wd_incr_style="constant",
    )
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = opt.scale_loss
    return ddp, opt, sched


def forward_step(data_iterator, model):  # noqa: ANN001, ANN201 - the schedule's interface
    """pretrain_gpt.py's forward step: per-token losses, averaged over the loss mask."""
    batch = next(data_iterator)
    losses = model(
        batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"]
    )

    def loss_func(loss_mask, output):  # noqa: ANN001, ANN202
        mask = loss_mask.view(-1).float()
        loss = (output.float().view(-1) * mask).sum() / mask.sum()
        return loss, {"lm loss": loss.detach()}

    return losses, partial(loss_func, batch["loss_mask"])


def train(ddp, opt, sched, dataset, start: int, stop: int) -> dict[int, float]:  # noqa: ANN001
    """Iterations start+1 .. stop, on consecutive samples from start * GBS (Megatron's
    pretraining sampler, which a resumed run continues with consumed samples)."""
    import torch
    from megatron.core.pipeline_parallel.schedules import get_forward_backward_func

    fwd_bwd = get_forward_backward_func()
    losses: dict[int, float] = {}
    for it in range(start + 1, stop + 1):
        first = (it - 1) * GBS
        samples = [dataset[i] for i in range(first, first + MBS)]
        batches = iter([torch.utils.data.default_collate(samples)])
        ddp.zero_grad_buffer()
        opt.zero_grad()
        reported = fwd_bwd(
            forward_step_func=forward_step,
            data_iterator=batches,
            model=[ddp],
            num_microbatches=GBS // MBS,
            seq_length=SEQ,
            micro_batch_size=MBS,
            decoder_seq_length=SEQ,
            forward_only=False,
        )
        ok, _, _ = opt.step()
        if not ok:
            raise RuntimeError(f"optimizer step {it} skipped")
        sched.step(increment=GBS)
        losses[it] = float(torch.stack([r["lm loss"] for r in reported]).mean())
        print(f"iteration {it}/{stop} | lm loss: {losses[it]:.4f}", flush=True)
    return losses


def checkpoint_state(ddp, opt, sched, loading: bool) -> dict:  # noqa: ANN001
    model_sd = ddp.module.sharded_state_dict()
    return {
        "model": model_sd,
        "optimizer": opt.sharded_state_dict(model_sd, is_loading=loading),
        "opt_param_scheduler": sched.state_dict(),
        "iteration": HALF,
    }


def run(phase: str, tree: Path, work: Path) -> dict:
    sys.path.insert(0, str(tree))
    warnings.simplefilter("ignore")
    import cpu_shim
    import torch
    import torch.distributed as dist

    cpu_shim.install()
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    dist.init_process_group(
        "gloo",
        rank=0,
        world_size=1,
        init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}",
        timeout=datetime.timedelta(seconds=120),
    )
    from megatron.core import dist_checkpointing, parallel_state

    parallel_state.initialize_model_parallel()
    texts, vocab, ranks = spec.corpus_and_tokenizer(work)
    tok = bpe_tokenizer(work, vocab, ranks)
    result: dict = {"phase": phase}
    if phase == "first":
        result["tokens"], result["entropy"] = write_dataset(work, texts, tok)
        build_helpers(tree)
    dataset = train_dataset(work, tok)
    ddp, opt, sched = model_and_optimizer(tok)
    qkv = type(ddp.module.decoder.layers[0].self_attention.linear_qkv)
    result["linear_qkv"] = f"{qkv.__module__}.{qkv.__qualname__}"
    ckpt = work / "checkpoint"
    if phase == "first":
        result["losses"] = train(ddp, opt, sched, dataset, 0, HALF)
        ckpt.mkdir(parents=True, exist_ok=True)
        dist_checkpointing.save(checkpoint_state(ddp, opt, sched, False), str(ckpt))
    else:
        loaded = dist_checkpointing.load(checkpoint_state(ddp, opt, sched, True), str(ckpt))
        ddp.module.load_state_dict(loaded["model"])
        opt.load_state_dict(loaded["optimizer"])
        sched.load_state_dict(loaded["opt_param_scheduler"])
        inner = [o.optimizer for o in getattr(opt, "chained_optimizers", [opt])]
        steps = {float(st["step"]) for o in inner for st in o.state.values() if "step" in st}
        result["loaded"] = {"scheduler_samples": sched.num_steps, "adam_steps": sorted(steps)}
        result["losses"] = train(ddp, opt, sched, dataset, loaded["iteration"], spec.ITERS)
    dist.barrier()
    dist.destroy_process_group()
    return result


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("phase", choices=("first", "resume"))
    ap.add_argument("--tree", required=True, type=Path)
    ap.add_argument("--work", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path)
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(run(args.phase, args.tree.resolve(), args.work.resolve())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
