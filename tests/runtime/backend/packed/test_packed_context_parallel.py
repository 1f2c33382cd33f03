"""Packed (THD) sequences under context parallelism: TE's partitioner and the attention.

``thd_get_partitioned_indices`` is compared with ``_cp_world.thd_rows``, TE's per-document
zigzag restated independently of the package. The attention runs in worlds of 2 and 4 gloo
processes on each rank's rows of one whole packed q/k/v (documents with padding, a chunk or a
whole rank of padding only) and is compared, forward and dq/dk/dv, with single-process packed
attention over the whole sequence (``packed_attention``'s fp32 reference math).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
if not torch.distributed.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

from _cp_world import World, thd_rows  # noqa: E402

from megatron_rocm.runtime.backend.packed.context_parallel import chunk_layout  # noqa: E402
from megatron_rocm.runtime.backend.packed.thd_attention import packed_attention  # noqa: E402
from megatron_rocm.runtime.backend.packed.thd_partition import thd_get_partitioned_indices  # noqa: E402

pytestmark = pytest.mark.full

# (real document lengths, padded lengths or None): padded lengths are multiples of 2cp
LAYOUTS = {
    "padded": ([5, 12, 1, 7], [8, 12, 8, 8]),
    "unpadded": ([8, 16, 8], None),
    "chunks of padding": ([1, 3, 13], [8, 8, 16]),
}
ONLY_PADDING_ON_RANK_1 = ([1], [8])  # cp 2: rank 1 holds chunks 1 and 2, both padding


def _cumulative(lengths: list[int]) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


# --- the partitioner -------------------------------------------------------------------------


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_partition_matches_tes_layout_and_covers_every_row_once(cp: int) -> None:
    lengths = [2 * cp * n for n in (3, 1, 5, 2)]
    cu = torch.tensor(_cumulative(lengths), dtype=torch.int32)
    total = int(cu[-1])
    every = []
    for rank in range(cp):
        index = thd_get_partitioned_indices(cu, total, cp, rank)
        assert index.dtype == torch.int32 and index.shape == (total // cp,)
        assert index.tolist() == thd_rows(cu.tolist(), cp, rank)
        every += index.tolist()
    assert sorted(every) == list(range(total))


def test_partition_takes_chunks_r_and_2cp_minus_1_minus_r_of_each_document() -> None:
    cu = torch.tensor([0, 8, 12])  # documents of 8 and 4 tokens, cp 2: chunks of 2 and 1
    assert thd_get_partitioned_indices(cu, 12, 2, 0).tolist() == [0, 1, 6, 7, 8, 11]
    assert thd_get_partitioned_indices(cu, 12, 2, 1).tolist() == [2, 3, 4, 5, 9, 10]


def test_partition_accepts_upstreams_1_by_n_offsets() -> None:
    cu = torch.tensor([[0, 4, 8]], dtype=torch.int32)
    assert thd_get_partitioned_indices(cu, 8, 2, 1).tolist() == [1, 2, 5, 6]


@pytest.mark.parametrize(
    ("cu", "total", "world", "rank", "message"),
    [
        ([0, 6, 12], 12, 2, 0, "multiple of 2 x context-parallel-size = 4"),
        ([0, 8], 12, 2, 0, "ends at 8 but the batch has 12 tokens"),
        ([0, 8], 8, 2, 2, "rank 2 is not in a context-parallel group of 2"),
        ([4, 8], 8, 2, 0, "must start at 0"),
    ],
)
def test_partition_rejects_what_te_would_not_split(cu, total, world, rank, message) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match=message):
        thd_get_partitioned_indices(torch.tensor(cu), total, world, rank)


def test_chunk_layout_lists_each_chunks_queries_and_visible_keys() -> None:
    # cp 2, one document of 7 real tokens in 8 rows: chunks of 2 at positions 0..7
    # rank 0: chunks 0 (rows 0-1, keys 0-1) and 3 (position 6: one real token, keys 0-6)
    assert chunk_layout(4, [0, 7], [0, 8], 2, 0, causal=True) == ([0, 2], [2, 1], [2, 7], [0, 0])
    # rank 1: chunks 1 and 2, both real; without a mask every chunk sees the whole document
    assert chunk_layout(4, [0, 7], [0, 8], 2, 1, causal=False) == ([0, 2], [2, 2], [7, 7], [0, 0])


def test_chunk_layout_refuses_rows_that_were_not_split_for_this_cp_size() -> None:
    with pytest.raises(ValueError, match="split with thd_get_partitioned_indices"):
        chunk_layout(8, [0, 8], [0, 8], 2, 0, causal=True)


# --- the attention, across processes ---------------------------------------------------------


def _packed_inputs(total: int, heads: int, groups: int, dim: int, dim_v: int, dtype, seed: int = 0):  # noqa: ANN001, ANN202
    """Inputs already rounded to ``dtype``, so both sides see the same values."""
    g = torch.Generator().manual_seed(seed)
    shapes = {
        "q": (total, heads, dim),
        "k": (total, groups, dim),
        "v": (total, groups, dim_v),
        "grad": (total, heads * dim_v),
    }
    return {n: torch.randn(*s, generator=g).to(dtype).float() for n, s in shapes.items()}


def _whole_sequence(tensors, cu, padded, causal, scale):  # noqa: ANN001, ANN202
    q, k, v = (tensors[n].clone().requires_grad_() for n in "qkv")

    def offsets(values):  # noqa: ANN001, ANN202
        return None if values is None else torch.tensor(values, dtype=torch.int32)

    out = packed_attention(
        q, k, v,
        cu_seqlens_q=offsets(cu), cu_seqlens_kv=offsets(cu),
        cu_seqlens_q_padded=offsets(padded), cu_seqlens_kv_padded=offsets(padded),
        causal=causal, softmax_scale=scale, implementation="reference",
    )  # fmt: skip
    out.backward(tensors["grad"])
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def _assert_packed_parity(world: World, real: list[int], padded: list[int] | None, *,
                          causal: bool, scale: float | None = None,
                          rows_of: str = "thd", through_module: str | None = None,
                          dtype: torch.dtype = torch.float32, shape: tuple = (4, 2, 8, 8),
                          tol: float = 2e-5, kernel: str | None = None) -> list[str]:  # fmt: skip
    """Compare; return the implementation each rank ran."""
    cu, pad = _cumulative(real), None if padded is None else _cumulative(padded)
    total = (pad or cu)[-1]
    tensors = _packed_inputs(total, *shape, dtype)  # (heads, groups, head dim, value head dim)
    results = world.run(
        "packed_parity_case",
        tensors=tensors,
        cu_seqlens=cu,
        padded=pad,
        causal=causal,
        scale=scale,
        dtype=dtype,
        kernel=kernel,
        rows_of=rows_of,
        through_module=through_module,
    )
    expected = _whole_sequence(tensors, cu, pad, causal, scale)
    # every row once over the ranks; with CP turned off, every rank holds all of them
    shares = [[r] for r in results] if through_module == "off" else [results]
    for share in shares:
        assert sorted(r for result in share for r in result["rows"]) == list(range(total))
        for name, want in expected.items():
            got = torch.zeros_like(want)
            for result in share:
                got[torch.tensor(result["rows"])] = result[name]
            atol = tol * (1 if name == "out" else 4)
            torch.testing.assert_close(
                got, want, atol=atol, rtol=atol, msg=lambda m, n=name: f"{n}: {m}"
            )
    return [result["implementation"] for result in results]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_cp2_packed_matches_whole_sequence_attention(worlds, layout: str, causal: bool) -> None:  # noqa: ANN001
    _assert_packed_parity(worlds(2), *LAYOUTS[layout], causal=causal)


@pytest.mark.parametrize("causal", [True, False])
def test_cp4_packed_matches_whole_sequence_attention(worlds, causal: bool) -> None:  # noqa: ANN001
    _assert_packed_parity(worlds(4), [13, 3, 16], [16, 8, 16], causal=causal, scale=0.3)


def test_value_head_dim_differs(worlds) -> None:  # noqa: ANN001
    _assert_packed_parity(worlds(2), *LAYOUTS["padded"], causal=True, shape=(4, 2, 8, 6))


def test_a_rank_holding_only_padding_still_joins_the_backward(worlds) -> None:  # noqa: ANN001
    _assert_packed_parity(worlds(2), *ONLY_PADDING_ON_RANK_1, causal=True)


def test_the_parity_check_notices_a_wrong_layout(worlds) -> None:  # noqa: ANN001
    with pytest.raises(AssertionError, match="out"):
        _assert_packed_parity(worlds(2), *LAYOUTS["padded"], causal=True, rows_of="contiguous")


@pytest.mark.parametrize("causal", [True, False])
def test_te_dot_product_attention_takes_packed_batches_under_cp(worlds, causal: bool) -> None:  # noqa: ANN001
    """Upstream's call: ``TEDotProductAttention(q, k, v, mask, packed_seq_params=...)``."""
    _assert_packed_parity(worlds(2), *LAYOUTS["padded"], causal=causal, through_module="static")


@pytest.mark.parametrize("how", ["dynamic", "off"])
def test_te_dot_product_attention_follows_hybrid_cps_group(worlds, how: str) -> None:  # noqa: ANN001
    """--hybrid-context-parallel: the batch's PackedSeqParams brings the CP group (or turns
    CP off with local_cp_size=1), as TE's wrapper honours it; never silently ignored."""
    _assert_packed_parity(worlds(2), *LAYOUTS["padded"], causal=True, through_module=how)


# --- on GPUs (NCCL / RCCL): the varlen kernels ----------------------------------------------


GPU_DOCUMENTS = ([300, 517, 99, 120], [300, 520, 100, 120])


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(("kernel", "ran"), [(None, "flash"), ("sdpa_loop", "sdpa_loop")])
def test_gpu_bf16_packed_parity(gpu_world: World, causal: bool, kernel, ran: str) -> None:  # noqa: ANN001
    """``auto`` must take the varlen flash kernel (its windows align bottom-right)."""
    implementations = _assert_packed_parity(
        gpu_world, *GPU_DOCUMENTS, causal=causal, dtype=torch.bfloat16, shape=(8, 2, 64, 64),
        tol=3e-2, kernel=kernel,
    )  # fmt: skip
    assert implementations == [ran, ran]


def _attention_without_cp(mask: str):  # noqa: ANN202
    from megatron_rocm.runtime.backend.dot_product_attention import TEDotProductAttention

    config = SimpleNamespace(
        kv_channels=8, attention_dropout=0.0, window_size=None, softmax_type="vanilla",
        num_attention_heads=4, tensor_model_parallel_size=1, context_parallel_size=1,
    )  # fmt: skip
    return TEDotProductAttention(config, 1, mask, "self")


@pytest.mark.parametrize(
    ("mask", "causal"),
    [("padding_causal", True), ("causal_bottom_right", True), ("padding", False)],
)
def test_packed_mask_types_keep_their_causality(mask: str, causal: bool) -> None:
    """The bottom-right causal forms are causal too (equal lengths: the same mask)."""
    real, padded = LAYOUTS["padded"]
    cu, pad = _cumulative(real), _cumulative(padded)
    tensors = _packed_inputs(pad[-1], 4, 2, 8, 8, torch.float32)
    attention = _attention_without_cp(mask)
    offsets = {
        "cu_seqlens_q": torch.tensor(cu, dtype=torch.int32),
        "cu_seqlens_kv": torch.tensor(cu, dtype=torch.int32),
        "cu_seqlens_q_padded": torch.tensor(pad, dtype=torch.int32),
        "cu_seqlens_kv_padded": torch.tensor(pad, dtype=torch.int32),
    }
    params = SimpleNamespace(qkv_format="thd", **offsets)
    out = attention(tensors["q"], tensors["k"], tensors["v"], None, packed_seq_params=params)
    want = _whole_sequence(tensors, cu, pad, causal, None)["out"]
    torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)


def test_an_arbitrary_mask_with_packed_sequences_is_refused() -> None:
    attention = _attention_without_cp("arbitrary")
    cu = torch.tensor([0, 4, 8], dtype=torch.int32)
    params = SimpleNamespace(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    q = torch.randn(8, 4, 8)
    with pytest.raises(ValueError, match="arbitrary attention mask is not supported"):
        attention(q, q[:, :2], q[:, :2], None, packed_seq_params=params)
