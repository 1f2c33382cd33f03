"""Test-only: Megatron-Bridge's HF <-> Megatron conversion of a config-made tiny Llama on the
patched tree without TransformerEngine (CPU, one gloo rank). Prints one JSON line.

argv: OUT_DIR. Needs ``transformers`` (< 5) and ``megatron.bridge`` (installed ``--no-deps``)
importable, and the patched tree on ``sys.path``. Two bridge modules import TE at module level
for LoRA only (``megatron.bridge.peft.lora_layers`` and ``.lora``): placeholders stand in for
them, so ``transformer_engine`` is never imported and the tree's ``HAVE_TE`` stays False.
"""

import json
import os
import sys
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "upstream"))
import cpu_shim  # noqa: E402

cpu_shim.install()
torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: 1
torch.cuda.set_device = lambda *a, **k: None
torch.compile = lambda f=None, **k: f if f is not None else (lambda g: g)


def placeholders() -> None:
    """What the bridge's LoRA modules export, as empty classes (LoRA is not used here)."""
    layers = types.ModuleType("megatron.bridge.peft.lora_layers")
    for n in ("LinearAdapter", "LoRALinear", "LoRATopKRouter", "TEFusedLoRALinear"):
        setattr(layers, n, type(n, (torch.nn.Module,), {}))
    layers.TELinearAdapter = type("TELinearAdapter", (torch.nn.Module,), {})
    layers.patch_linear_module = lambda *a, **k: None
    lora = types.ModuleType("megatron.bridge.peft.lora")
    for n in ("LoRA", "LoRAMerge", "VLMLoRA", "DoRA"):
        setattr(lora, n, type(n, (), {}))
    sys.modules[layers.__name__] = layers
    sys.modules[lora.__name__] = lora


def main(out: Path) -> dict:
    placeholders()
    torch.distributed.init_process_group("gloo")
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from transformers import LlamaConfig, LlamaForCausalLM

    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1)
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    hf = LlamaForCausalLM(cfg).eval()
    hf.save_pretrained(out / "hf")

    from megatron.bridge import AutoBridge

    bridge = AutoBridge.from_hf_pretrained(str(out / "hf"))
    provider = bridge.to_megatron_provider(load_weights=True)
    provider.params_dtype = torch.float32
    provider.finalize()
    model = provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True)
    m = model[0].eval()
    ids = torch.randint(0, cfg.vocab_size, (1, 16))
    with torch.no_grad():
        diff = (m(ids, torch.arange(16)[None], None) - hf(ids).logits).abs().max().item()
    layer = m.decoder.layers[0].self_attention
    back = dict(bridge.export_hf_weights(model, cpu=True))
    ref = hf.state_dict()
    return {
        "have_te": "transformer_engine" in sys.modules,
        "qkv_module": type(layer.linear_qkv).__module__,
        "max_logit_diff": diff,
        "same_names": sorted(ref) == sorted(back),
        "exact": all(torch.equal(ref[k], back[k].to(ref[k].dtype)) for k in ref if k in back),
    }


if __name__ == "__main__":
    for k, v in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1").items():
        os.environ.setdefault(k, v)
    print("RESULT", json.dumps(main(Path(sys.argv[1]))), flush=True)
