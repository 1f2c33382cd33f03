"""a2a attention that computes its own QKV projection (``_cp_a2a_qkv``) against upstream's order.

Worlds of gloo processes (``_cp_world``) run upstream's ``SelfAttention`` math from the
normalised input to the output projection on their shards, once as upstream computes it (one
QKV GEMM, torch's split, RoPE, ``context_parallel_attention``; plain autograd) and once through
the projection split by rank around a2a's exchanges; output, input gradient and the gradients
of both weights and the bias must agree. The ``gpu`` cases run the same on two GPUs (NCCL and
copy engines, bf16).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
if not torch.distributed.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

from megatron_rocm.runtime.backend._cp_a2a_qkv import QKVRows  # noqa: E402
from megatron_rocm.runtime.kernels.rope import rope_reference, rotate_sbhd  # noqa: E402


def _inputs(s: int, b: int, hidden: int, heads: int, groups: int, head_dim: int, *,
            bias: bool, rope: int | None, seed: int = 0) -> dict:  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    rows = (heads + 2 * groups) * head_dim
    width = heads * head_dim
    freqs = None
    if rope is not None:
        inv = 1.0 / 10000 ** (torch.arange(0, rope, 2, dtype=torch.float32) / rope)
        angles = torch.outer(torch.arange(s, dtype=torch.float32), inv)
        freqs = torch.cat((angles, angles), dim=-1)[:, None, None, :]
    return {
        "x": torch.randn(s, b, hidden, generator=g),
        "weight": torch.randn(rows, hidden, generator=g) / hidden**0.5,
        "bias": torch.randn(rows, generator=g) if bias else None,
        "freqs": freqs,
        "out_weight": torch.randn(hidden, width, generator=g) / width**0.5,
        "grad": torch.randn(s, b, hidden, generator=g),
        "heads": heads,
        "groups": groups,
    }


def test_rows_split_like_upstream() -> None:
    """A rank's block of the fused projection gives the heads upstream's view and split give
    it under a2a's head split: kv groups ``j*g ..`` and their query heads."""
    heads, groups, dim, cp, s, b = 8, 4, 3, 2, 5, 2
    mixed = torch.randn(s, b, (heads + 2 * groups) * dim)
    grouped = mixed.view(s, b, groups, (heads // groups + 2) * dim)
    q, k, v = torch.split(grouped, [heads // groups * dim, dim, dim], dim=3)
    q = q.reshape(s, b, heads, dim)
    rows = QKVRows(heads, groups, dim, cp)
    for rank in range(cp):
        rq, rk, rv = rows.split(mixed[..., rows.rows(rank)].contiguous())
        per_rank_q, per_rank_kv = heads // cp, groups // cp
        torch.testing.assert_close(
            rows.merge_heads(rq.contiguous(), b),
            q[:, :, rank * per_rank_q : (rank + 1) * per_rank_q],
            rtol=0, atol=0,
        )  # fmt: skip
        want_k = k[:, :, rank * per_rank_kv : (rank + 1) * per_rank_kv]
        torch.testing.assert_close(rows.merge_heads(rk.contiguous(), b), want_k, rtol=0, atol=0)
        want_v = v[:, :, rank * per_rank_kv : (rank + 1) * per_rank_kv]
        torch.testing.assert_close(rv, want_v, rtol=0, atol=0)


def test_rows_refuse_kv_groups_that_do_not_split() -> None:
    with pytest.raises(ValueError, match="do not split over 4 CP ranks"):
        QKVRows(8, 2, 16, 4)


@pytest.mark.parametrize("interleaved", [False, True])
def test_rotation_without_autograd_and_its_transpose(interleaved: bool) -> None:
    """``rotate_sbhd`` is RoPE on a strided slice; ``inverse`` is its gradient."""
    t = torch.randn(6, 2, 5, 16)[:, :, 1:4]  # strided heads, as a slice of the projection
    freqs = torch.randn(6, 1, 1, 12)
    leaf = t.clone().requires_grad_()
    want = rope_reference(leaf, freqs, interleaved)
    torch.testing.assert_close(rotate_sbhd(t, freqs, interleaved), want.detach())
    grad = torch.randn_like(want)
    want.backward(grad)
    torch.testing.assert_close(rotate_sbhd(grad, freqs, interleaved, inverse=True), leaf.grad)


CASES = {
    # name -> (world, inputs, options)
    "gqa_rope_bias": (
        2,
        dict(s=16, b=2, hidden=12, heads=4, groups=2, head_dim=8, bias=True, rope=8),
        {},
    ),  # fmt: skip
    "mha_partial_rope_fused_wgrad": (
        2,
        dict(s=16, b=1, hidden=10, heads=4, groups=4, head_dim=6, bias=False, rope=4),
        {"fuse": True},
    ),  # fmt: skip
    "two_head_groups_no_rope": (
        2,
        dict(s=8, b=1, hidden=16, heads=8, groups=4, head_dim=4, bias=False, rope=None),
        {},
    ),  # fmt: skip
    "not_causal_interleaved": (
        2,
        dict(s=12, b=2, hidden=8, heads=2, groups=2, head_dim=4, bias=True, rope=4),
        {"causal": False, "interleaved": True},
    ),  # fmt: skip
    "no_handoffs": (
        2,
        dict(s=16, b=1, hidden=8, heads=4, groups=2, head_dim=4, bias=False, rope=4),
        {"handoff": "0"},
    ),  # fmt: skip
    "cp4": (4, dict(s=16, b=1, hidden=12, heads=8, groups=4, head_dim=4, bias=True, rope=4), {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_projected_a2a_matches_upstreams_order(worlds, case: str) -> None:  # noqa: ANN001
    """Output and every gradient as upstream's order computes them, and as many exchanges."""
    size, shape, options = CASES[case]
    results = worlds(size).run("projected_case", **_inputs(**shape), **options)
    for rank, result in enumerate(results):
        upstream, projected = result["upstream"], result["projected"]
        assert set(projected) == set(upstream)
        assert projected["posts"] == upstream["posts"] > 0
        for name in ("y", "dx", "dw", "dwo", "db"):
            if name in upstream:
                assert upstream[name].abs().sum() > 0, name
                torch.testing.assert_close(
                    projected[name], upstream[name], atol=2e-5, rtol=2e-5,
                    msg=lambda m, n=name, r=rank: f"rank {r} {n}: {m}",
                )  # fmt: skip


def test_the_comparison_notices_a_wrong_head_order(worlds) -> None:  # noqa: ANN001
    """The parity above can fail: with the projection's rows of the two ranks swapped (the
    heads a rank owns computed from its peer's rows) the outputs differ."""
    inputs = _inputs(16, 1, 8, 4, 2, 4, bias=False, rope=4)
    swapped = inputs["weight"].view(2, -1, inputs["weight"].shape[1]).flip(0).reshape_as(
        inputs["weight"])  # fmt: skip
    results = worlds(2).run("projected_case", **inputs, projected_weight=swapped)
    for result in results:
        assert not torch.allclose(result["projected"]["y"], result["upstream"]["y"], atol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("transport", ["process-group", "copy-engine"])
def test_gpu_projected_a2a_matches_upstreams_order(gpu_world, transport: str) -> None:  # noqa: ANN001
    """bf16 on two GPUs, through NCCL and through copy engines, Llama's 4:1 grouping."""
    import torch.cuda

    if transport == "copy-engine" and getattr(torch.version, "hip", None):
        pytest.skip("copy engines are not measured on ROCm yet")
    inputs = _inputs(1024, 2, 256, 8, 2, 64, bias=False, rope=64)
    results = gpu_world.run("projected_case", **inputs, dtype=torch.bfloat16, fuse=True,
                            transport=transport)  # fmt: skip
    for rank, result in enumerate(results):
        assert result["copy_engine"] == (transport == "copy-engine")
        upstream, projected = result["upstream"], result["projected"]
        for name in ("y", "dx", "dw", "dwo"):
            scale = upstream[name].abs().max().item()
            err = (projected[name] - upstream[name]).abs().max().item()
            assert err <= 2e-2 * scale, f"rank {rank} {name}: {err} against {scale}"


def test_the_native_projection_is_on_unless_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron_rocm.runtime.backend import a2a_projection

    monkeypatch.delenv(a2a_projection.QKV_ENV, raising=False)
    assert a2a_projection.enabled()
    monkeypatch.setenv(a2a_projection.QKV_ENV, "0")
    assert not a2a_projection.enabled()
    monkeypatch.setenv(a2a_projection.QKV_ENV, "1")
    assert a2a_projection.enabled()
    monkeypatch.setenv(a2a_projection.QKV_ENV, "off")
    assert not a2a_projection.enabled()
    monkeypatch.setenv(a2a_projection.QKV_ENV, "maybe")
    with pytest.raises(ValueError, match="'maybe' is not a boolean"):
        a2a_projection.enabled()


def test_rope_table_takes_one_shared_table_only() -> None:
    from megatron_rocm.runtime.backend.a2a_projection import rope_table

    freqs = torch.zeros(8, 1, 1, 4)
    assert rope_table(None, 8) == (None, None)
    assert rope_table((freqs, freqs), 8)[0] is freqs
    assert "different" in rope_table((freqs, freqs.clone()), 8)[1]
    assert "shorter" in rope_table((freqs, freqs), 9)[1]
    flat = freqs[:, 0]
    assert "[s, 1, 1, rot]" in rope_table((flat, flat), 8)[1]
    learned = freqs.clone().requires_grad_()
    assert "learned" in rope_table((learned, learned), 8)[1]


def test_a_landed_forward_keeps_no_receive_buffers_to_the_backward(worlds) -> None:  # noqa: ANN001
    """Each Function keeps its call for the backward; the forward's way back, once landed,
    must not stay in it (one receive buffer per peer and layer until the backward)."""
    g = torch.Generator().manual_seed(0)
    tensors = {n: torch.randn(16, 1, h, 8, generator=g) for n, h in (("q", 4), ("k", 2), ("v", 2))}
    for result in worlds(2).run("retained_case", tensors=tensors):
        assert result["alive"] == 0


def test_bf16_forward_and_input_gradient_are_upstreams_bit_for_bit(worlds) -> None:  # noqa: ANN001
    """In bf16 the projection rounds as upstream's linear does (the GEMM, then the bias), and
    the input gradient is upstream's one GEMM over every head: the same bits."""
    inputs = _inputs(16, 2, 12, 4, 2, 8, bias=True, rope=8)
    for result in worlds(2).run("projected_case", **inputs, dtype=torch.bfloat16):
        for name in ("y", "dx"):
            assert torch.equal(result["projected"][name], result["upstream"][name]), name
