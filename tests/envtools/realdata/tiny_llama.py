"""Test-only: the tiny Llama the Hugging Face <-> Megatron tests convert and train, as HF's
config values and as ``pretrain_gpt.py``'s flags (no side effects: the test imports it too)."""

VOCAB = 512  # the real-data tier's GPT-2 BPE (457 tokens) as Megatron pads it (multiple of 128)
HIDDEN, FFN, LAYERS, HEADS, GROUPS, SEQ = 64, 128, 2, 4, 2, 64
EPS, ROPE_BASE = 1e-6, 10000

HF_CONFIG = dict(
    vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
    num_attention_heads=HEADS, num_key_value_heads=GROUPS, max_position_embeddings=SEQ,
    tie_word_embeddings=False, rms_norm_eps=EPS, rope_theta=float(ROPE_BASE),
)  # fmt: skip

MEGATRON_ARGS = [
    f"--num-layers={LAYERS}", f"--hidden-size={HIDDEN}", f"--ffn-hidden-size={FFN}",
    f"--num-attention-heads={HEADS}", "--group-query-attention", f"--num-query-groups={GROUPS}",
    f"--seq-length={SEQ}", f"--max-position-embeddings={SEQ}", "--normalization=RMSNorm",
    f"--norm-epsilon={EPS}", "--swiglu", "--position-embedding-type=rope",
    f"--rotary-base={ROPE_BASE}", "--untie-embeddings-and-output-weights",
    "--disable-bias-linear", "--attention-dropout=0.0", "--hidden-dropout=0.0",
    "--make-vocab-size-divisible-by=128",
]  # fmt: skip
