"""Upstream's T5, BERT and heterogeneous GPT TE specs without TE: built and run forward (CPU).

    python model_specs_probe.py --tree PATCHED_TREE --out RESULT.json

One gloo rank. Each model is built twice, from its TE spec (the native backend's modules
without TE) and from its local spec, with the same small config. Recorded per model: the
classes the TE spec's attention got, both parameter counts (the TE linears fuse the norms the
local spec builds apart, so they match), the TE model's output shape and whether it is finite;
for T5 and BERT also whether the output at unpadded positions ignores the tokens at padded
ones, and changes when the mask is dropped (the padding mask reaches the native attention).
A model whose spec or build raises records its error instead, so an unpatched tree reports
the upstream failure of each model.
"""

from __future__ import annotations

import argparse
import json
import traceback

import probe_cli  # beside this script (sys.path[0])

HIDDEN, HEADS, LAYERS, VOCAB, SEQ, BATCH = 64, 4, 2, 128, 8, 2
PAD = 3  # the last PAD tokens of sample 0 are padding


def _config(cls, **extra):  # noqa: ANN001, ANN003, ANN202
    return cls(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
        use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
        bias_dropout_fusion=False, masked_softmax_fusion=False, bias_activation_fusion=False,
        gradient_accumulation_fusion=False, apply_rope_fusion=False, **extra,
    )  # fmt: skip


def _params(model) -> int:  # noqa: ANN001
    return sum(p.numel() for p in model.parameters())


def _where(module) -> str:  # noqa: ANN001
    """``module``'s class, and where its TE part comes from: the module of its first TE-named
    class from outside megatron.core (TE's or the native backend's)."""
    te = (
        c for c in type(module).__mro__
        if c.__name__.startswith("TE") and not c.__module__.startswith("megatron.core")
    )  # fmt: skip
    return f"{type(module).__name__} ({getattr(next(te, None), '__module__', None)})"


def _attention_classes(model) -> list[str]:  # noqa: ANN001
    stack = model.encoder if hasattr(model, "encoder") else model.decoder  # T5, BERT; GPT
    attn = stack.layers[0].self_attention
    return [_where(m) for m in (attn.linear_qkv, attn.core_attention, attn.linear_proj)]


def _tokens(torch):  # noqa: ANN001, ANN202
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    other = ids.clone()
    other[0, SEQ - PAD :] = (other[0, SEQ - PAD :] + 1) % VOCAB  # only padded tokens differ
    keep = torch.ones(BATCH, SEQ, dtype=torch.bool)
    keep[0, SEQ - PAD :] = False
    return ids, other, keep


def _built(torch, model, local, y) -> dict:  # noqa: ANN001
    """What every probe reports: the attention's classes, parameter counts against the local
    spec's, the output's shape and whether it is finite."""
    return {
        "attention": _attention_classes(model),
        "params": _params(model),
        "local_params": _params(local),
        "shape": list(y.shape),
        "finite": bool(torch.isfinite(y).all()),
    }


def t5(torch) -> dict:  # noqa: ANN001
    from megatron.core.models.T5 import t5_spec
    from megatron.core.models.T5.t5_model import T5Model
    from megatron.core.transformer.transformer_config import TransformerConfig

    def build(encoder_spec, decoder_spec):  # noqa: ANN001, ANN202
        torch.manual_seed(0)
        config = _config(TransformerConfig)
        return T5Model(
            config, config, encoder_spec(LAYERS), decoder_spec(LAYERS), vocab_size=VOCAB,
            max_sequence_length=SEQ,
        )  # fmt: skip

    model = build(
        t5_spec.get_t5_encoder_with_transformer_engine_block_spec,
        t5_spec.get_t5_decoder_with_transformer_engine_block_spec,
    )
    local = build(
        t5_spec.get_t5_encoder_with_local_block_spec, t5_spec.get_t5_decoder_with_local_block_spec
    )
    enc, enc_other, keep = _tokens(torch)
    dec = torch.randint(0, VOCAB, (BATCH, SEQ))
    masked_key = ~keep[:, None, None, :]  # True = masked, as Megatron's masks
    enc_mask = masked_key.expand(BATCH, 1, SEQ, SEQ)
    dec_mask = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1).expand(BATCH, 1, SEQ, SEQ)
    model.eval()
    with torch.no_grad():
        y = model(enc, dec, enc_mask, dec_mask, enc_mask)
        y_other = model(enc_other, dec, enc_mask, dec_mask, enc_mask)
        no_pad = torch.zeros_like(enc_mask)
        y_unmasked = model(enc_other, dec, no_pad, dec_mask, no_pad)
    return {
        **_built(torch, model, local, y),
        "padding_ignored": bool(torch.equal(y, y_other)),
        "padding_reaches": bool(not torch.equal(y, y_unmasked)),
    }


def bert(torch) -> dict:  # noqa: ANN001
    from megatron.core.models.bert import bert_layer_specs
    from megatron.core.models.bert.bert_model import BertModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    def build(spec):  # noqa: ANN001, ANN202
        torch.manual_seed(0)
        return BertModel(
            _config(TransformerConfig), num_tokentypes=0, transformer_layer_spec=spec,
            vocab_size=VOCAB, max_sequence_length=SEQ, add_binary_head=False,
        )  # fmt: skip

    model = build(bert_layer_specs.get_bert_layer_with_transformer_engine_spec())
    local = build(bert_layer_specs.bert_layer_local_spec)
    ids, other, keep = _tokens(torch)
    model.eval()
    with torch.no_grad():
        y = model(ids, keep.long())[0]  # (the LM logits, no binary head's)
        y_other = model(other, keep.long())[0]
        y_unmasked = model(other, torch.ones_like(keep).long())[0]
    kept = keep[:, :, None].expand_as(y)
    return {
        **_built(torch, model, local, y),
        "padding_ignored": bool(torch.equal(y[kept], y_other[kept])),
        "padding_reaches": bool(not torch.equal(y[kept], y_unmasked[kept])),
    }


def heterogeneous(torch) -> dict:  # noqa: ANN001
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.models.gpt.heterogeneous.heterogeneous_layer_specs import (
        get_gpt_heterogeneous_layer_spec,
    )
    from megatron.core.transformer.heterogeneous.heterogeneous_config import (
        HeterogeneousTransformerConfig,
    )

    def block(attn: dict, mlp: dict) -> dict:
        a = {"no_op": False, "replace_with_linear": False, "num_query_groups": 2} | attn
        m = {"no_op": False, "replace_with_linear": False, "ffn_hidden_size": 96} | mlp
        return {"attention": a, "mlp": m}

    blocks = [  # a GQA layer, then one whose attention and MLP are replaced by linears
        block({}, {}),
        block({"replace_with_linear": True, "num_query_groups": None},
              {"replace_with_linear": True, "ffn_hidden_size": None}),
    ]  # fmt: skip
    layers_json = json.dumps({"block_configs": blocks})

    def build(use_te: bool):  # noqa: ANN202
        torch.manual_seed(0)
        config = _config(
            HeterogeneousTransformerConfig, add_bias_linear=False, normalization="RMSNorm",
            gated_linear_unit=True, heterogeneous_layers_config_encoded_json=layers_json,
        )  # fmt: skip
        spec = get_gpt_heterogeneous_layer_spec(config, use_te=use_te)
        return GPTModel(
            config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ,
            position_embedding_type="rope",
        )  # fmt: skip

    model = build(True)
    local = build(False)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    position_ids = torch.arange(SEQ).repeat(BATCH, 1)
    model.eval()
    with torch.no_grad():
        y = model(input_ids=ids, position_ids=position_ids, attention_mask=None)
    second = model.decoder.layers[1]
    return {
        **_built(torch, model, local, y),
        "replaced": [_where(second.self_attention), _where(second.mlp)],
    }


def run(args: argparse.Namespace) -> dict:
    probe_cli.one_rank_world(args)
    import torch
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(0)
    out: dict = {}
    for name, probe in (("t5", t5), ("bert", bert), ("heterogeneous", heterogeneous)):
        try:
            out[name] = probe(torch)
        except Exception as exc:  # the unpatched tree: the error upstream's tests meet
            out[name] = {"failed": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
    return out


if __name__ == "__main__":
    raise SystemExit(probe_cli.main(run))
