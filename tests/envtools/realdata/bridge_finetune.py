"""Test-only: a Hugging Face Llama -> a Megatron checkpoint -> ``pretrain_gpt.py`` trains it ->
back to Hugging Face, on the patched tree without TransformerEngine (CPU, one gloo rank).

    bridge_finetune.py import OUT     HF model (config-made) -> OUT/megatron
    bridge_finetune.py export OUT     OUT/trained (pretrain_gpt's checkpoint) -> OUT/hf-out,
                                      and the HF model from it against Megatron's logits

Each prints one ``RESULT {json}`` line; ``tiny_llama`` holds the model's shape (HF config and
``pretrain_gpt.py`` flags). Megatron-Bridge converts (its ``models.conversion``),
Megatron's own ``dist_checkpointing`` writes and reads the files: the bridge's
``save_megatron_model``/``load_megatron_model`` import its training package, which needs
``nvidia-modelopt``, HF ``datasets`` and more at import time. The HF model's output layer is scaled up ``HEAD_SCALE``
times, so its loss on any text is far above ln(vocab), where a freshly initialised model starts:
a first training loss that high proves pretrain_gpt started from these weights.
Megatron-Bridge's two LoRA modules import TE at module level; placeholders stand in for them
(``bridge_roundtrip.placeholders``), so ``transformer_engine`` is never imported.
"""

import json
import os
import shutil
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bridge_roundtrip  # noqa: E402 - cpu_shim and the CUDA answers, as the round trip has them
from tiny_llama import HF_CONFIG, SEQ, VOCAB  # noqa: E402

HEAD_SCALE = 25.0


def _start() -> None:
    bridge_roundtrip.placeholders()
    torch.distributed.init_process_group("gloo")
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1)


def megatron_model(bridge, load_weights: bool) -> list:  # noqa: ANN001 - an AutoBridge
    """The bridge's Megatron model of the HF model, in fp32 on the CPU (HF's weights or none)."""
    provider = bridge.to_megatron_provider(load_weights=load_weights)
    provider.params_dtype = torch.float32
    provider.finalize()
    return provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True)


def save_release(model: torch.nn.Module, folder: Path) -> None:
    """``model`` as a Megatron-LM checkpoint that ``pretrain_gpt.py --load`` reads: a
    ``torch_dist`` checkpoint in ``release/`` and the tracker file naming it."""
    from megatron.core import dist_checkpointing

    (folder / "release").mkdir(parents=True)
    state = {"model": model.sharded_state_dict(), "checkpoint_version": 3.0, "iteration": 0}
    dist_checkpointing.save(state, str(folder / "release"))
    (folder / "latest_checkpointed_iteration.txt").write_text("release")


def load_latest(model: torch.nn.Module, folder: Path) -> None:
    """The model weights of the newest ``iter_*`` checkpoint ``pretrain_gpt.py`` saved."""
    from megatron.core import dist_checkpointing

    iteration = int((folder / "latest_checkpointed_iteration.txt").read_text())
    path = folder / f"iter_{iteration:07d}"
    loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(path))
    model.load_state_dict(loaded["model"])


def do_import(out: Path) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    _start()
    cfg = LlamaConfig(**HF_CONFIG)
    torch.manual_seed(0)
    hf = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        hf.lm_head.weight.mul_(HEAD_SCALE)
    hf.save_pretrained(out / "hf")
    ids = torch.randint(0, VOCAB, (4, SEQ))
    with torch.no_grad():
        hf_loss = hf(ids, labels=ids).loss.item()
    from megatron.bridge import AutoBridge

    bridge = AutoBridge.from_hf_pretrained(str(out / "hf"))
    model = megatron_model(bridge, load_weights=True)
    save_release(model[0], out / "megatron")
    return {"hf_loss_on_random_tokens": hf_loss, "have_te": "transformer_engine" in sys.modules}


def do_export(out: Path) -> dict:
    from transformers import LlamaForCausalLM

    _start()
    from megatron.bridge import AutoBridge

    bridge = AutoBridge.from_hf_pretrained(str(out / "hf"))
    model = megatron_model(bridge, load_weights=False)
    load_latest(model[0], out / "trained")
    bridge.save_hf_weights(model, str(out / "hf-out"))  # the weights alone: the config is HF's
    shutil.copy(out / "hf" / "config.json", out / "hf-out" / "config.json")
    trained = LlamaForCausalLM.from_pretrained(str(out / "hf-out")).float().eval()
    original = LlamaForCausalLM.from_pretrained(str(out / "hf")).float().eval()
    m = model[0].float().eval()
    ids = torch.randint(0, VOCAB, (2, 16))
    with torch.no_grad():
        megatron_logits = m(ids, torch.arange(16)[None].expand(2, -1), None)
        diff = (megatron_logits - trained(ids).logits).abs().max().item()
    changed = [
        name
        for name, tensor in trained.state_dict().items()
        if not torch.equal(tensor, original.state_dict()[name])
    ]
    # a decoder weight (not only the scaled-up head) started from HF's: after training it still
    # points along HF's original (cosine), where a freshly initialised one is unrelated to it
    name = "model.layers.0.mlp.gate_proj.weight"
    torch.manual_seed(1)
    fresh = LlamaForCausalLM(original.config).state_dict()[name]
    ref = original.state_dict()[name].flatten()

    def cosine(t: torch.Tensor) -> float:
        return torch.nn.functional.cosine_similarity(t.flatten(), ref, dim=0).item()

    return {
        "decoder_cosine": cosine(trained.state_dict()[name]),
        "fresh_cosine": cosine(fresh),
        "max_logit_diff": diff,
        "logit_scale": megatron_logits.abs().max().item(),
        "changed": len(changed),
        "tensors": len(original.state_dict()),
        "have_te": "transformer_engine" in sys.modules,
    }


if __name__ == "__main__":
    for k, v in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1").items():
        os.environ.setdefault(k, v)
    stage, folder = sys.argv[1], Path(sys.argv[2])
    result = {"import": do_import, "export": do_export}[stage](folder)
    print("RESULT", json.dumps(result), flush=True)
