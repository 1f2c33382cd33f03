"""Context-parallel attention vs single-process attention over the whole sequence.

Worlds of 2 and 4 gloo processes (``_cp_world``) run each case on their shards of one full
q/k/v in upstream's zigzag layout; the test process reassembles outputs and gradients and
compares them with ``attention_reference`` (the local DotProductAttention math) over the full
sequence: forward and dq/dk/dv, causal and not, GQA, odd head dims, every comm type, CP groups
that are strided subgroups of the world. The ``gpu`` cases (NCCL, 2 GPUs) run the flash and
memory-efficient kernels the same way.
"""

from __future__ import annotations

import logging

import pytest

torch = pytest.importorskip("torch")
if not torch.distributed.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

from _cp_world import World, shard, unshard  # noqa: E402

from megatron_rocm.runtime.backend import _cp_block_attention as blocks  # noqa: E402
from megatron_rocm.runtime.backend._cp_layout import (  # noqa: E402
    DIAGONAL,
    FULL,
    KV_FRONT,
    Q_BACK,
    global_to_rank_major,
    rank_major_to_global,
)
from megatron_rocm.runtime.backend.context_parallel import (  # noqa: E402
    SUPPORTED_CP_COMM_TYPES,
    context_parallel_attention,
    ring_step_plan,
    zigzag_chunk_ids,
    zigzag_shard,
    zigzag_unshard,
)
from megatron_rocm.runtime.kernels.attention import attention_reference  # noqa: E402

TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}
# (tokens of the whole sequence, batch, query heads, kv groups, head dim, value head dim)
GQA = (16, 2, 4, 2, 8, 8)
ODD = (24, 1, 2, 2, 5, 5)  # odd head dim, plain multi-head
VALUE_DIM = (16, 1, 4, 2, 8, 6)  # value head dim != query/key head dim
COMM = list(SUPPORTED_CP_COMM_TYPES)


# --- layout -------------------------------------------------------------------------------


def _upstream_split(x: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """get_batch_on_this_cp_rank's indexing, restated: view as 2cp chunks, pick r and 2cp-1-r."""
    chunked = x.view(2 * cp, x.shape[0] // (2 * cp), *x.shape[1:])
    return chunked.index_select(0, torch.tensor([rank, 2 * cp - 1 - rank])).reshape(
        -1, *x.shape[1:]
    )


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_zigzag_layout_matches_upstream_and_round_trips(cp: int) -> None:
    x = torch.arange(2 * cp * 3 * 2).view(2 * cp * 3, 2)
    shards = [zigzag_shard(x, cp, r) for r in range(cp)]
    for rank, part in enumerate(shards):
        assert torch.equal(part, _upstream_split(x, cp, rank))
        assert torch.equal(part, shard(x, cp, rank))  # the worlds' own sharding agrees
        assert zigzag_chunk_ids(cp, rank) == (rank, 2 * cp - 1 - rank)
    assert torch.equal(zigzag_unshard(shards), x)
    assert torch.equal(unshard(shards), x)
    assert torch.equal(global_to_rank_major(x, cp), torch.cat(shards))
    assert torch.equal(rank_major_to_global(global_to_rank_major(x, cp), cp), x)


def test_zigzag_shard_rejects_a_length_not_divisible_by_2cp() -> None:
    with pytest.raises(ValueError, match="not a multiple of 2 \\* cp = 4"):
        zigzag_shard(torch.zeros(6, 1), 2, 0)


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_ring_step_plan_matches_the_causal_mask(cp: int) -> None:
    """Each ring step's plan is exactly the causal mask between the two ranks' positions."""
    positions = torch.arange(2 * cp * 2)
    half = 2
    for rank in range(cp):
        q_pos = shard(positions, cp, rank)
        for step in range(cp):
            kv_pos = shard(positions, cp, (rank - step) % cp)
            keep = q_pos[:, None] >= kv_pos[None, :]
            plan = ring_step_plan(rank, cp, step, causal=True)
            if plan == DIAGONAL:
                assert torch.equal(keep, torch.ones_like(keep).tril())
            elif plan == KV_FRONT:
                assert keep[:, :half].all() and not keep[:, half:].any()
            else:
                assert plan == Q_BACK
                assert keep[half:].all() and not keep[:half].any()
            assert ring_step_plan(rank, cp, step, causal=False) == FULL


# --- argument checks (no process group needed: they come first) ---------------------------


def _qkv(s: int = 4, heads: int = 4, groups: int = 2) -> list[torch.Tensor]:
    return [torch.zeros(s, 1, heads, 8), torch.zeros(s, 1, groups, 8), torch.zeros(s, 1, groups, 8)]


def test_supported_comm_types() -> None:
    assert SUPPORTED_CP_COMM_TYPES == ("p2p", "all_gather", "a2a")


@pytest.mark.parametrize(
    ("kwargs", "tensors", "message"),
    [
        ({"comm_type": "a2a+p2p"}, _qkv(), "--cp-comm-type 'a2a\\+p2p' is not supported"),
        ({"dropout_p": 1.0}, _qkv(), "dropout must be in \\[0, 1\\)"),
        ({}, _qkv(s=5), "even local sequence"),
        ({}, _qkv(heads=3), "3 query heads are not a multiple of 2 kv groups"),
        ({}, _qkv()[:2] + [torch.zeros(3, 1, 2, 8)], "do not match"),
    ],
)
def test_bad_arguments_fail_with_one_clear_line(kwargs: dict, tensors: list, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        context_parallel_attention(
            *tensors, cp_group=None, causal=True, softmax_scale=None, **kwargs
        )


# --- block kernels and the log-sum-exp merge (one process) --------------------------------


def _block_reference(q, k, v, causal: bool, scale: float):  # noqa: ANN001, ANN202
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = (q.double() @ k.double().transpose(-1, -2)) * scale
    if causal:
        s = q.shape[2]
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    return scores.softmax(-1) @ v.double(), scores.logsumexp(-1)


@pytest.mark.parametrize("name", ["cpu_flash", "math"])
@pytest.mark.parametrize("causal", [True, False])
def test_block_kernel_returns_natural_log_lse_and_exact_gradients(name: str, causal: bool) -> None:
    kernel = blocks.KERNELS[name]
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, n, 6, 8, generator=g) for n in (4, 2, 2))
    out, lse, state = kernel.forward(q, k, v, causal=causal, scale=0.4, dropout_p=0.0)
    want_out, want_lse = _block_reference(q, k, v, causal, 0.4)
    torch.testing.assert_close(out.double(), want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5)
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    dout = torch.randn(out.shape, generator=g)
    _block_reference(*leaves, causal, 0.4)[0].backward(dout.double())
    grads = kernel.backward(dout, q, k, v, out, lse, state, causal=causal, scale=0.4, dropout_p=0.0)
    for got, leaf in zip(grads, leaves):
        torch.testing.assert_close(got.double(), leaf.grad, atol=1e-4, rtol=1e-4)


def test_merging_key_blocks_gives_the_full_softmax() -> None:
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 6, 4, generator=g) for _ in range(3))
    merger = blocks.SoftmaxMerger(q, 4)
    for index, part in enumerate((slice(2, 5), slice(0, 2), slice(5, 6))):  # uneven, any order
        out, lse, _ = blocks.KERNELS["math"].forward(
            q, k[:, :, part], v[:, :, part], causal=False, scale=0.5, dropout_p=0.0
        )
        merger.add(slice(None), out, lse, first=index == 0)
    want_out, want_lse = _block_reference(q, k, v, False, 0.5)
    torch.testing.assert_close(merger.out.double(), want_out, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(merger.lse.double(), want_lse, atol=1e-6, rtol=1e-6)


def test_kernel_choice_on_cpu(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("MEGATRON_ROCM_CP_KERNEL", raising=False)
    q, k, v = _qkv()
    assert blocks.pick_kernel(q, k, v, 0.0).name == "cpu_flash"
    with caplog.at_level(logging.WARNING, logger="megatron_rocm.runtime.kernels"):
        assert blocks.pick_kernel(q, k, v, 0.1).name == "math"
    assert "cannot replay dropout" in caplog.text
    assert blocks.pick_kernel(q, k, torch.zeros(4, 1, 2, 6), 0.0).name == "math"


class _GpuTensor:
    """Stands in for a CUDA query: ``pick_kernel`` reads ``is_cuda`` and hands it to the
    kernels' ``unsupported``, which the tests below replace."""

    is_cuda = True


class _Kernel(blocks.BlockKernel):
    def __init__(self, name: str, reason: str | None) -> None:
        self.name, self.reason = name, reason

    def unsupported(self, q, k, v, dropout_p):  # noqa: ANN001, ANN201
        return self.reason


@pytest.mark.parametrize(
    ("declines", "hip", "picked", "logged"),
    [
        ({}, False, "cudnn", None),  # NVIDIA: cuDNN blocks first (the twelfth session's run)
        ({"cudnn": "failed its probe (x)"}, False, "flash", "runs flash blocks (cudnn failed"),
        ({"cudnn": "needs an NVIDIA GPU (cuDNN)"}, True, "flash", None),  # ROCm: flash, quietly
        (
            {"cudnn": "no", "flash": "no"},
            False,
            "efficient",
            "runs efficient blocks (cudnn no; flash no)",
        ),
    ],
)
def test_auto_prefers_cudnn_then_flash_on_gpus(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    declines: dict[str, str],
    hip: bool,
    picked: str,
    logged: str | None,
) -> None:
    monkeypatch.delenv("MEGATRON_ROCM_CP_KERNEL", raising=False)
    monkeypatch.setattr(blocks, "is_hip", lambda: hip)
    for name in ("cudnn", "flash", "efficient"):
        monkeypatch.setitem(blocks.KERNELS, name, _Kernel(name, declines.get(name)))
    monkeypatch.setattr(blocks, "log_fallback_once", lambda key, message: logging.getLogger(
        "megatron_rocm.runtime.kernels").warning(message))  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="megatron_rocm.runtime.kernels"):
        assert blocks.pick_kernel(_GpuTensor(), None, None, 0.0).name == picked
    if logged:
        assert logged in caplog.text
    else:
        assert "blocks (" not in caplog.text


def test_cudnn_declines_under_deterministic_algorithms(monkeypatch: pytest.MonkeyPatch) -> None:
    """Upstream's --deterministic-mode turns them on; torch's SDPA then skips cuDNN too."""
    monkeypatch.setattr(blocks, "is_hip", lambda: False)
    monkeypatch.setattr(blocks, "_cudnn_probe", lambda *args: None)  # the GPU part passes
    fields = {"dtype": torch.bfloat16, "shape": (1, 8, 16, 64), "device": "cuda:0"}
    q = type("Q", (_GpuTensor,), fields)()
    cudnn = blocks.KERNELS["cudnn"]
    if not hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention"):
        pytest.skip("this torch build has no cuDNN attention op")
    monkeypatch.setattr(torch.backends.cuda, "cudnn_sdp_enabled", lambda: True)
    assert cudnn.unsupported(q, q, q, 0.0) is None
    try:
        torch.use_deterministic_algorithms(True, warn_only=True)  # a warning only: still cuDNN
        assert cudnn.unsupported(q, q, q, 0.0) is None
        torch.use_deterministic_algorithms(True)
        assert "is not deterministic" in cudnn.unsupported(q, q, q, 0.0)
    finally:
        torch.use_deterministic_algorithms(False)


def test_cudnn_declines_on_rocm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(blocks, "is_hip", lambda: True)
    reason = blocks.KERNELS["cudnn"].unsupported(_GpuTensor(), None, None, 0.0)
    assert reason == "needs an NVIDIA GPU (cuDNN)"


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_the_cudnn_probe_runs_under_no_grad_and_inference_mode(
    monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """The first CP call may come from evaluation or inference. The probe's logic, on CPU with
    the math kernel standing in for cuDNN's: it passes, and a failure inside is a reason."""
    monkeypatch.setitem(blocks.KERNELS, "cudnn", blocks.KERNELS["math"])
    probe = blocks._cudnn_probe.__wrapped__  # not the cache: every case probes afresh
    with getattr(torch, mode)():
        assert probe(torch.device("cpu"), torch.float32, 8) is None

    def broken(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise RuntimeError("no plan")

    monkeypatch.setattr(blocks.KERNELS["math"], "_fwd", broken)
    with getattr(torch, mode)():
        reason = probe(torch.device("cpu"), torch.float32, 8)
    assert reason == "failed its probe (RuntimeError: no plan)"


class _GroupedMath(blocks.MathKernel):
    """A stand-in for a kernel that takes grouped kv heads as they are: the math kernel on
    heads it expands itself. ``interleave=False`` maps query head i to kv head i % kv heads
    (not Megatron's i // group size); ``sum_back=False`` returns dK/dV per query head."""

    def __init__(self, *, interleave: bool = True, sum_back: bool = True) -> None:
        self.interleave, self.sum_back = interleave, sum_back

    def _expand(self, q: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        g = q.shape[1] // x.shape[1]
        return x.repeat_interleave(g, dim=1) if self.interleave else x.repeat(1, g, 1, 1)

    def _fold(self, grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
        if not self.sum_back:
            return grad
        split = (kv_heads, -1) if self.interleave else (-1, kv_heads)
        return grad.unflatten(1, split).sum(2 if self.interleave else 1)

    def _fwd(self, q, k, v, causal, scale, p):  # noqa: ANN001, ANN202
        return super()._fwd(q, self._expand(q, k), self._expand(q, v), causal, scale, p)

    def _bwd(self, do, q, k, v, out, lse, state, causal, scale, p):  # noqa: ANN001, ANN202
        ke, ve = self._expand(q, k), self._expand(q, v)
        dq, dk, dv = super()._bwd(do, q, ke, ve, out, lse, state, causal, scale, p)
        return dq, self._fold(dk, k.shape[1]), self._fold(dv, v.shape[1])


@pytest.mark.parametrize(
    ("stand_in", "reason"),
    [
        (blocks.MathKernel(), "failed its probe"),  # no grouped heads: shapes do not broadcast
        (_GroupedMath(), None),
        (_GroupedMath(interleave=False), "differs from fp64 math (out"),
        (_GroupedMath(sum_back=False), "gave dk of shape (1, 6, 128, 8), not (1, 2, 128, 8)"),
    ],
)
def test_the_cudnn_probe_checks_grouped_kv_heads(
    monkeypatch: pytest.MonkeyPatch, stand_in: blocks.BlockKernel, reason: str | None
) -> None:
    """cuDNN blocks take grouped kv heads unexpanded only if the probe, given 3 query heads per
    kv head, gets Megatron's grouping (query head i reads kv head i // 3) and dK/dV per kv head."""
    monkeypatch.setitem(blocks.KERNELS, "cudnn", stand_in)
    got = blocks._cudnn_probe.__wrapped__(torch.device("cpu"), torch.float32, 8, 3)
    assert got is None if reason is None else reason in got
    assert blocks._cudnn_probe.__wrapped__(torch.device("cpu"), torch.float32, 8, 1) is None


def test_query_heads_that_do_not_group_over_the_kv_heads_are_refused() -> None:
    q, k = torch.randn(1, 6, 4, 8), torch.randn(1, 4, 4, 8)
    with pytest.raises(ValueError, match="6 query heads do not group over 4 kv heads"):
        blocks.KERNELS["cudnn"]._heads(q, k, k)


@pytest.mark.parametrize("grouped_ok", [True, False])
def test_cudnn_blocks_expand_kv_heads_only_when_the_grouped_probe_fails(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, grouped_ok: bool
) -> None:
    asked = []

    def probe(device, dtype, dim, group_size=1):  # noqa: ANN001, ANN202
        asked.append(group_size)
        return None if grouped_ok or group_size == 1 else "failed its probe (RuntimeError: x)"

    monkeypatch.setattr(blocks, "_cudnn_probe", probe)
    monkeypatch.setattr(blocks, "log_fallback_once", lambda key, message: logging.getLogger(
        "megatron_rocm.runtime.kernels").warning(message))  # fmt: skip
    q, k, v = torch.randn(1, 6, 4, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)
    with caplog.at_level(logging.WARNING, logger="megatron_rocm.runtime.kernels"):
        ke, ve = blocks.KERNELS["cudnn"]._heads(q, k, v)
    assert asked == [3]
    assert (ke is k and ve is v) == grouped_ok
    if grouped_ok:
        assert not caplog.text
    else:
        assert ke.shape[1] == 6 and torch.equal(ke[:, 3:6], k[:, 1:2].expand(1, 3, 4, 8))
        assert "expand grouped kv heads (3 query heads each): grouped heads failed" in caplog.text


@pytest.mark.parametrize(
    ("requested", "dropout_p", "message"),
    [
        ("cpu_flash", 0.1, "cpu_flash: this kernel cannot replay dropout"),
        ("flash", 0.0, "flash: this kernel needs a GPU"),
        ("cudnn", 0.0, r"cudnn: this kernel needs an NVIDIA GPU \(cuDNN\)"),
        ("fast", 0.0, "'fast' is not one of auto, flash, efficient, cudnn, cpu_flash, math"),
    ],
)
def test_an_explicit_kernel_that_cannot_run_fails_loudly(
    monkeypatch: pytest.MonkeyPatch, requested: str, dropout_p: float, message: str
) -> None:
    monkeypatch.setenv("MEGATRON_ROCM_CP_KERNEL", requested)
    with pytest.raises(ValueError, match=message):
        blocks.pick_kernel(*_qkv(), dropout_p)


def test_cudnn_backward_gets_output_and_gradient_with_the_querys_strides() -> None:
    """torch caches cuDNN's backward plan by q/k/v layouts but bakes in the output's and its
    gradient's strides: they must always follow the query, copied only when they differ."""
    query = torch.randn(6, 1, 4, 8).permute(1, 2, 0, 3)  # [s, b, h, d] seen as [b, h, s, d]
    same = torch.randn(6, 1, 4, 8).permute(1, 2, 0, 3)
    assert blocks.laid_out_like(same, query) is same
    other = torch.randn(1, 4, 6, 8)  # contiguous [b, h, s, d]: another layout
    moved = blocks.laid_out_like(other, query)
    assert moved.stride() == query.stride() and torch.equal(moved, other)
    rows = query[:, :, 3:]  # a block of query rows keeps the whole query's strides
    moved = blocks.laid_out_like(other[:, :, 3:].contiguous(), rows)
    assert moved.stride() == rows.stride() and torch.equal(moved, other[:, :, 3:])


def test_copy_wide_moves_the_same_bits_as_words_where_the_layout_allows() -> None:
    from megatron_rocm.runtime.backend import _cp_a2a

    bits = torch.randint(-(2**15), 2**15, (4, 2, 6, 8), dtype=torch.int16)
    src = bits.view(torch.bfloat16).permute(2, 0, 1, 3)  # NaN payloads and all
    assert _cp_a2a._widens(src)
    dst = torch.empty(src.shape, dtype=torch.bfloat16)
    _cp_a2a.copy_wide(dst, src)
    assert torch.equal(dst.view(torch.int16), src.contiguous().view(torch.int16))
    odd = torch.randn(3, 5, dtype=torch.bfloat16)  # 10-byte rows: no whole words
    shifted = torch.randn(17, dtype=torch.bfloat16)[1:].view(4, 4)  # 2 bytes off a word
    for x in (odd, shifted, odd.double()):
        assert not _cp_a2a._widens(x)
        assert torch.equal(_cp_a2a.copy_wide(torch.empty_like(x), x), x)


# --- parity across processes ---------------------------------------------------------------


def _inputs(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    """Full-sequence q/k/v and output gradient, already rounded to ``dtype`` (both sides see
    the same values)."""
    s, b, heads, groups, dim, value_dim = shape
    g = torch.Generator().manual_seed(seed)
    shapes = {
        "q": (s, b, heads, dim),
        "k": (s, b, groups, dim),
        "v": (s, b, groups, value_dim),
        "grad": (s, b, heads * value_dim),
    }
    return {n: torch.randn(*sh, generator=g).to(dtype).float() for n, sh in shapes.items()}


def _reference(tensors: dict[str, torch.Tensor], causal: bool, scale: float | None) -> dict:
    q, k, v = (tensors[n].clone().requires_grad_() for n in "qkv")
    if v.shape[-1] == q.shape[-1]:
        out = attention_reference(q, k, v, None, "causal" if causal else "no_mask", scale)
    else:  # attention_reference assumes one head dim; same math with the value's own
        rep = q.shape[2] // k.shape[2]
        scores = torch.einsum("qbnh,kbnh->bnqk", q, k.repeat_interleave(rep, 2))
        scores = scores * (q.shape[-1] ** -0.5 if scale is None else scale)
        if causal:
            mask = torch.ones(q.shape[0], q.shape[0], dtype=torch.bool).triu(1)
            scores = scores.masked_fill(mask, float("-inf"))
        out = torch.einsum("bnqk,kbnh->qbnh", scores.softmax(-1), v.repeat_interleave(rep, 2))
        out = out.reshape(q.shape[0], q.shape[1], -1)
    out.backward(tensors["grad"])
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def _assert_parity(world: World, shape, dtype=torch.float32, *, causal: bool = True,  # noqa: ANN001
                   scale: float | None = None, tol: float | None = None, layout: str = "zigzag",
                   run: str = "parity_case", **case) -> list[dict]:  # fmt: skip
    """Every rank's result (``run``: the world's case), once outputs and gradients matched the
    reference."""
    tensors = _inputs(shape, dtype)
    results = world.run(
        run,
        tensors=tensors,
        causal=causal,
        scale=scale,
        dtype=dtype,
        layout=layout,
        **case,
    )
    expected = _reference(tensors, causal, scale)
    groups: dict[tuple[int, ...], list[dict]] = {}
    for result in results:  # world ranks ascend, so each group's list is in CP-rank order
        groups.setdefault(result["members"], []).append(result)
    join = unshard if layout == "zigzag" else torch.cat
    for name, want in expected.items():
        atol = (tol or TOL[dtype]) * (1 if name == "out" else 4)
        for members, parts in groups.items():
            got = join([part[name] for part in parts])
            torch.testing.assert_close(
                got,
                want,
                atol=atol,
                rtol=atol,
                msg=lambda m, n=name, g=members: f"{n} (CP group {g}): {m}",
            )
    return results


@pytest.mark.parametrize("comm_type", COMM)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(("shape", "scale"), [(GQA, None), (ODD, 0.37)])
def test_cp2_matches_full_attention(worlds, comm_type: str, causal: bool, shape, scale) -> None:  # noqa: ANN001
    _assert_parity(worlds(2), shape, causal=causal, scale=scale, comm_type=comm_type)


@pytest.mark.parametrize("comm_type", COMM)
def test_cp2_bf16(worlds, comm_type: str) -> None:  # noqa: ANN001
    _assert_parity(worlds(2), GQA, torch.bfloat16, comm_type=comm_type)


@pytest.mark.parametrize("comm_type", COMM)
def test_value_head_dim_differs(worlds, comm_type: str) -> None:  # noqa: ANN001
    _assert_parity(worlds(2), VALUE_DIM, comm_type=comm_type)


@pytest.mark.parametrize("comm_type", COMM)
def test_strided_views_of_one_projection(worlds, comm_type: str) -> None:  # noqa: ANN001
    _assert_parity(worlds(2), GQA, comm_type=comm_type, fused=True)


@pytest.mark.parametrize("comm_type", ["p2p", "all_gather"])
def test_math_kernel(worlds, comm_type: str) -> None:  # noqa: ANN001
    _assert_parity(worlds(2), GQA, comm_type=comm_type, kernel="math")


@pytest.mark.parametrize(("comm_type", "causal"), [(c, True) for c in COMM] + [("p2p", False)])
def test_cp4_matches_full_attention(worlds, comm_type: str, causal: bool) -> None:  # noqa: ANN001
    # 2 kv groups over 4 ranks: a2a must expand the kv heads
    _assert_parity(worlds(4), (32, 1, 4, 2, 8, 8), causal=causal, comm_type=comm_type)


@pytest.mark.parametrize("comm_type", COMM)
def test_strided_cp_subgroups(worlds, comm_type: str) -> None:  # noqa: ANN001
    """CP groups {0, 2} and {1, 3}, as Megatron builds them next to TP=2: ring peers are
    global ranks, not group ranks."""
    _assert_parity(worlds(4), GQA, comm_type=comm_type, partition=[[0, 2], [1, 3]])


@pytest.mark.parametrize(
    ("cp", "shape", "stages", "used"),
    [
        (2, (16, 2, 8, 4, 8, 8), None, 2),  # unset, through the process group: two groups
        (2, (16, 2, 8, 4, 8, 8), 2, 2),
        (2, (16, 1, 8, 8, 8, 8), 4, 4),
        (2, (16, 1, 8, 8, 8, 6), 3, 1),  # 4 kv heads per rank do not split in 3: one group
        (2, (16, 1, 8, 4, 8, 8), 4, 2),  # 2 kv heads per rank: at most two groups
        (4, (32, 1, 16, 8, 8, 8), 2, 2),
        (4, (32, 1, 8, 2, 8, 8), 2, 2),  # kv heads expanded to the 8 query heads first
    ],
)
@pytest.mark.parametrize("causal", [True, False])
def test_a2a_pipelines_head_groups(worlds, cp, shape, stages, used, causal) -> None:  # noqa: ANN001
    """Each head group is exchanged and computed on its own (one batch of transfers per group
    and direction, forward and backward) and the result is still exact attention."""
    results = _assert_parity(worlds(cp), shape, causal=causal, comm_type="a2a", a2a_stages=stages)
    assert {r["posts"] for r in results} == {4 * used}


@pytest.mark.parametrize("value", ["0", "two", "-1"])
def test_a2a_stages_must_be_a_positive_whole_number(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    from megatron_rocm.runtime.backend import _cp_a2a

    monkeypatch.setenv(_cp_a2a.STAGES_ENV, value)
    with pytest.raises(ValueError, match=f"MEGATRON_ROCM_CP_A2A_STAGES={value!r} is not a pos"):
        _cp_a2a.stage_count(8, 8, 2, copy_engines=False)


def test_a2a_head_groups_follow_the_transport_unless_asked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Unset: one group on copy engines (NVLink within a host), two through the process group
    (RCCL, other hosts), lowered to what the kv heads split into; asked: the count asked."""
    from megatron_rocm.runtime.backend import _cp_a2a

    monkeypatch.delenv(_cp_a2a.STAGES_ENV, raising=False)
    assert _cp_a2a.stage_count(64, 8, 2, copy_engines=True) == 1
    assert _cp_a2a.stage_count(64, 8, 2, copy_engines=False) == 2
    assert _cp_a2a.stage_count(64, 8, 8, copy_engines=False) == 1  # one kv head per rank
    monkeypatch.setenv(_cp_a2a.STAGES_ENV, "1")
    assert _cp_a2a.stage_count(64, 8, 2, copy_engines=False) == 1
    monkeypatch.setenv(_cp_a2a.STAGES_ENV, "4")
    assert _cp_a2a.stage_count(64, 8, 2, copy_engines=True) == 4


@pytest.mark.parametrize("comm_type", COMM)
def test_cp1_groups(worlds, comm_type: str) -> None:  # noqa: ANN001
    _assert_parity(worlds(4), GQA, comm_type=comm_type, partition=[[0], [1], [2], [3]])


@pytest.mark.parametrize("comm_type", COMM)
def test_the_parity_check_notices_a_wrong_layout(worlds, comm_type: str) -> None:  # noqa: ANN001
    """Contiguous shards instead of upstream's zigzag (reassembled the same way): without a
    mask the order does not matter, with the causal mask it must come out wrong."""
    _assert_parity(worlds(2), GQA, causal=False, comm_type=comm_type, layout="contiguous")
    with pytest.raises(AssertionError, match="out"):
        _assert_parity(worlds(2), GQA, comm_type=comm_type, layout="contiguous")


@pytest.mark.parametrize(
    ("comm_type", "kernel"), [("p2p", "math"), ("all_gather", "math"), ("a2a", "auto")]
)
def test_dropout_backward_replays_the_forward_mask(worlds, comm_type: str, kernel: str) -> None:  # noqa: ANN001
    (result, _) = worlds(2).run(
        "dropout_case", comm_type=comm_type, p=0.3, kernel=kernel, dtype=torch.float64,
        shape=(4, 1, 2, 1, 3), eps=1e-6,
    )  # fmt: skip
    assert result["repeatable"] and result["dropped"] > 0.1
    assert result["numeric"] == pytest.approx(result["analytic"], rel=1e-6, abs=1e-8)


@pytest.mark.parametrize(
    ("cp", "dtype", "shape"),
    [(4, torch.bfloat16, GQA), (2, torch.float16, VALUE_DIM), (2, torch.float32, GQA)],
)
def test_the_rings_last_hop_is_sent_finished_in_the_input_dtype(worlds, cp, dtype, shape) -> None:  # noqa: ANN001
    """The dK/dV sums hop in fp32 while blocks still add to them; the last hop, which no block's
    backward overlaps, carries the finished sums in the inputs' dtype: half the bytes in bf16
    or fp16, the same bits the owner got by rounding the fp32 sums itself."""
    tensors = _inputs(shape, dtype)
    low, fp32 = [str(dtype)] * 2, ["torch.float32"] * 2
    # per step: K/V on to the next rank, then the sums; the last step sends no K/V
    expected = [low, fp32] * (cp - 1) + [low]
    for result in worlds(cp).run("ring_hop_case", tensors=tensors, dtype=dtype):
        assert result["hops"] == expected
        for name, sent, reference in zip("kv", result["final"], result["fp32"]):
            assert sent.dtype == dtype
            assert torch.equal(sent, reference), f"d{name} differs"


# --- GPUs (NCCL/RCCL, one GPU per rank) ------------------------------------------------------


GPU_SHAPE = (512, 1, 8, 2, 64, 64)


@pytest.mark.gpu
@pytest.mark.parametrize("comm_type", COMM)
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_bf16_parity(gpu_world: World, comm_type: str, causal: bool) -> None:
    _assert_parity(gpu_world, GPU_SHAPE, torch.bfloat16, causal=causal, comm_type=comm_type)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("kernel", "dtype"),
    [
        ("flash", torch.float16),
        ("efficient", torch.float32),
        ("efficient", torch.bfloat16),
        ("cudnn", torch.bfloat16),  # auto's first choice there; its probe must pass
    ],
)
@pytest.mark.parametrize("comm_type", ["p2p", "all_gather"])
def test_gpu_kernels(gpu_world: World, kernel: str, dtype: torch.dtype, comm_type: str) -> None:
    if kernel == "cudnn" and torch.version.hip:
        pytest.skip("cuDNN attention is NVIDIA's; ROCm builds have no such kernel")
    tol = {torch.float32: 2e-3, torch.float16: 1e-2}.get(dtype)  # fp32 kernels may use TF32
    _assert_parity(gpu_world, GPU_SHAPE, dtype, comm_type=comm_type, kernel=kernel, tol=tol)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_gpu_auto_takes_cudnn_blocks_even_when_first_called_without_grad(
    monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if torch.version.hip:
        pytest.skip("cuDNN attention is NVIDIA's; on ROCm auto starts at flash (CPU test above)")
    monkeypatch.delenv("MEGATRON_ROCM_CP_KERNEL", raising=False)
    blocks._cudnn_probe.cache_clear()
    q = torch.randn(1, 8, 256, 64, device="cuda", dtype=torch.bfloat16)
    k = v = torch.randn(1, 2, 256, 64, device="cuda", dtype=torch.bfloat16)
    with getattr(torch, mode)():  # evaluation or inference may make the first CP call
        assert blocks.pick_kernel(q, k, v, 0.0).name == "cudnn"
    assert blocks.pick_kernel(q, k, v, 0.1).name == "flash"  # cuDNN blocks take no dropout


@pytest.mark.gpu
def test_gpu_cudnn_blocks_with_grouped_heads_match_the_expanded_ones() -> None:
    """Where the grouped-head probe passes, a causal cuDNN block fed 8 query heads over 2 kv
    heads as they are gives the outputs and gradients of the same block on expanded heads."""
    if not torch.cuda.is_available() or torch.version.hip:
        pytest.skip("needs an NVIDIA GPU (cuDNN attention)")
    cudnn = blocks.KERNELS["cudnn"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, do = (torch.randn(1, 8, 256, 64, device="cuda", generator=gen, dtype=torch.bfloat16)
             for _ in range(2))  # fmt: skip
    k, v = (torch.randn(1, 2, 256, 64, device="cuda", generator=gen, dtype=torch.bfloat16)
            for _ in range(2))  # fmt: skip
    reason = blocks._cudnn_probe(q.device, q.dtype, 64, 4)
    if reason is not None:
        pytest.skip(f"this build's cuDNN op does not take grouped heads: {reason}")
    assert cudnn.native_gqa(q, k)
    runs = {}
    for grouped in (True, False):
        kk, vv = (k, v) if grouped else (k.repeat_interleave(4, 1), v.repeat_interleave(4, 1))
        out, lse, state = cudnn._fwd(q, kk, vv, True, 0.125, 0.0)
        dq, dk, dv = cudnn._bwd(do, q, kk, vv, out, lse, state, True, 0.125, 0.0)
        if not grouped:
            dk, dv = (g.unflatten(1, (2, 4)).sum(2) for g in (dk, dv))
        runs[grouped] = (out, dq, dk, dv)
    for got, want in zip(runs[True], runs[False]):
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("comm_type", "kernel", "dtype", "eps", "rel"),
    [
        ("p2p", "efficient", torch.float32, 1e-2, 5e-3),
        ("all_gather", "efficient", torch.float32, 1e-2, 5e-3),
        ("p2p", "flash", torch.float16, 5e-2, 3e-2),
        ("a2a", "auto", torch.float32, 1e-2, 5e-3),
    ],
)
def test_gpu_dropout_backward_replays_the_forward_mask(
    gpu_world: World, comm_type: str, kernel: str, dtype: torch.dtype, eps: float, rel: float
) -> None:
    (result, _) = gpu_world.run(
        "dropout_case", comm_type=comm_type, p=0.3, kernel=kernel, dtype=dtype,
        shape=(256, 1, 4, 2, 64), eps=eps,
    )  # fmt: skip
    assert result["repeatable"] and result["dropped"] > 0.1
    assert result["numeric"] == pytest.approx(result["analytic"], rel=rel)


# --- a2a's transport ------------------------------------------------------------------------


@pytest.mark.parametrize("transport", [None, "auto", "process-group"])
def test_a2a_on_cpu_exchanges_through_the_process_group(worlds, transport) -> None:  # noqa: ANN001
    """gloo on the CPU: every exchange is a batch posted to the process group."""
    results = _assert_parity(worlds(2), GQA, comm_type="a2a", a2a_transport=transport)
    assert {(r["posts"], r["copy_engine"]) for r in results} == {(4, False)}


def test_a2a_inside_a_cuda_graph_capture_exchanges_through_the_process_group(worlds) -> None:  # noqa: ANN001
    """Megatron's ``--cuda-graph-impl``: captured, a2a neither decides the group's transport
    (the copy engines' side stream cannot join a capture) nor hands exchanges to the
    projection, and gives the same attention through the process group."""
    results = _assert_parity(worlds(2), GQA, comm_type="a2a", run="captured_parity_case")
    assert {(r["posts"], r["copy_engine"]) for r in results} == {(4, False)}


@pytest.mark.parametrize("choice", ["auto", "process-group", "copy-engine"])
def test_copy_engines_asked_for_inside_a_capture_fail_in_one_line(
    monkeypatch: pytest.MonkeyPatch, choice: str
) -> None:
    from megatron_rocm.runtime.backend import _cp_copy_engine

    def decided(*args: object) -> None:
        raise AssertionError("the group's transport was decided inside a capture")

    monkeypatch.setattr(_cp_copy_engine, "capturing", lambda device: True)
    monkeypatch.setattr(_cp_copy_engine, "link_for", decided)
    monkeypatch.setenv(_cp_copy_engine.TRANSPORT_ENV, choice)
    if choice != "copy-engine":
        assert _cp_copy_engine.link_for_call(None, torch.device("cuda", 0)) is None
        return
    with pytest.raises(ValueError) as failure:
        _cp_copy_engine.link_for_call(None, torch.device("cuda", 0))
    assert str(failure.value) == (
        "MEGATRON_ROCM_CP_A2A_TRANSPORT=copy-engine: copy engines cannot join a CUDA-graph "
        "capture (--cuda-graph-impl); unset it or use process-group"
    )


def test_copy_engines_asked_for_where_they_cannot_work_fail_in_one_line(worlds) -> None:  # noqa: ANN001
    with pytest.raises(AssertionError) as failure:  # the world's report of each rank's error
        _assert_parity(worlds(2), GQA, comm_type="a2a", a2a_transport="copy-engine")
    assert (
        "ValueError: MEGATRON_ROCM_CP_A2A_TRANSPORT=copy-engine: the tensors are on cpu, not a GPU"
    ) in str(failure.value)


@pytest.mark.parametrize("value", ["nccl", "copy", "copy_engine"])
def test_a2a_transport_must_be_one_of_the_three(monkeypatch: pytest.MonkeyPatch, value) -> None:  # noqa: ANN001
    from megatron_rocm.runtime.backend import _cp_copy_engine

    monkeypatch.setenv(_cp_copy_engine.TRANSPORT_ENV, value)
    with pytest.raises(ValueError) as failure:
        _cp_copy_engine.requested_transport()
    assert str(failure.value) == (
        f"MEGATRON_ROCM_CP_A2A_TRANSPORT={value!r} is not one of auto, process-group, copy-engine"
    )


def test_rocm_keeps_rccl_unless_copy_engines_are_asked_for() -> None:
    """Checked before any collective: under ``auto`` a ROCm build says why at once."""
    from megatron_rocm.runtime.backend._cp_copy_engine import why_not_copy_engines

    cuda = torch.device("cuda", 0)
    reason = why_not_copy_engines(None, cuda, on_rocm=True, auto=True)
    assert reason == "ROCm keeps RCCL until copy engines are measured on AMD GPUs"
    assert why_not_copy_engines(None, torch.device("cpu"), on_rocm=False, auto=False) == (
        "the tensors are on cpu, not a GPU"
    )


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_each_peer_has_a_segment_of_its_own_in_every_region(ranks: int) -> None:
    """What rank a keeps for rank b (outbox) and what b finds there (peer_outbox) are the
    same segment, and no two peers of one owner share a segment."""
    from megatron_rocm.runtime.backend._cp_copy_engine import Layout, slot

    for owner in range(ranks):
        slots = [slot(owner, other) for other in range(ranks) if other != owner]
        assert sorted(slots) == list(range(ranks - 1))
    layout = Layout([((3, 5), torch.bfloat16), ((7,), torch.float32)], ranks)
    assert layout.offsets == [0, 256]  # 30 and 28 bytes, each on its own 256-byte boundary
    assert layout.segment == 512 and layout.nbytes == 512 * (ranks - 1)


A2A_GPU_SHAPE = (512, 2, 8, 4, 64, 64)  # two kv heads per rank: up to two head groups


@pytest.mark.gpu
@pytest.mark.parametrize("transport", ["copy-engine", "process-group"])
@pytest.mark.parametrize("stages", [1, 2])
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_a2a_transports(gpu_world: World, transport: str, stages: int, causal: bool) -> None:
    """Copy engines through symmetric memory and the process group's point-to-point give
    the same exact attention, with one or two head groups; the case says which one ran (no
    batch is posted to the process group on copy engines)."""
    if transport == "copy-engine" and torch.version.hip:
        pytest.skip("copy engines through symmetric memory are not measured on ROCm yet")
    results = _assert_parity(
        gpu_world, A2A_GPU_SHAPE, torch.bfloat16, causal=causal, comm_type="a2a",
        a2a_stages=stages, a2a_transport=transport,
    )  # fmt: skip
    want = (0, True) if transport == "copy-engine" else (4 * stages, False)
    assert {(r["posts"], r["copy_engine"]) for r in results} == {want}


@pytest.mark.gpu
def test_gpu_a2a_captured_in_a_cuda_graph_replays_the_eager_attention(gpu_world: World) -> None:
    """Eager a2a on copy engines, then the same step captured in a CUDA graph (through the
    process group) and replayed: the same output and gradients."""
    if torch.version.hip:
        pytest.skip("copy engines through symmetric memory are not measured on ROCm yet")
    results = gpu_world.run("graph_case", tensors=_inputs(A2A_GPU_SHAPE, torch.bfloat16))
    for result in results:
        assert result["copy_engine"]
        for name, eager, replayed in zip(["out", "dq", "dk", "dv"], result["eager"],
                                         result["replayed"], strict=True):  # fmt: skip
            torch.testing.assert_close(replayed, eager, atol=1e-2, rtol=1e-2, msg=name)


@pytest.mark.gpu
def test_gpu_a2a_auto_takes_copy_engines_and_grows_its_window() -> None:
    """Under ``auto`` on one CUDA host a2a exchanges by copy engines; a longer sequence after a
    shorter one grows the symmetric window (a collective every rank makes at the same call)."""
    if torch.cuda.device_count() < 2 or torch.version.hip:
        pytest.skip("needs 2 CUDA GPUs")
    world = World(2, backend="nccl")
    try:
        for shape in [(128, 1, 8, 4, 64, 64), A2A_GPU_SHAPE]:
            results = _assert_parity(world, shape, torch.bfloat16, comm_type="a2a")
            assert {(r["posts"], r["copy_engine"]) for r in results} == {(0, True)}
    finally:
        world.close()


@pytest.mark.gpu
def test_gpu_a2a_exchanges_from_two_streams_stay_ordered(gpu_world: World) -> None:
    """Two a2a attentions on copy engines queued from two CUDA streams that nothing else
    orders: the link's own waits (packing after its last barrier, its next barrier after the
    unpacking) keep the one-barrier protocol sound, so both come out as they do alone; also
    when the first stream unpacks late (without the second wait, a peer's next push would
    overwrite the inbox before it is read)."""
    if torch.version.hip:
        pytest.skip("copy engines through symmetric memory are not measured on ROCm yet")
    shape = (4096, 1, 8, 4, 64, 64)  # long enough that the GPU trails the host
    first, second = _inputs(shape, torch.bfloat16), _inputs(shape, torch.bfloat16, 1)
    for late_unpack in (False, True):
        for distances in gpu_world.run(
            "two_streams_case", first=first, second=second, late_unpack=late_unpack
        ):
            # a race mixes in the other input's values: errors of the order of the values
            assert len(distances) == 8 and max(distances) < 5e-2, (late_unpack, distances)


@pytest.mark.parametrize("failing", [[], [1], [0, 1]])
def test_the_ranks_agree_whether_symmetric_memory_mapped(worlds, failing: list[int]) -> None:  # noqa: ANN001
    """One rank that cannot map the window keeps every rank on the process group."""
    got = worlds(2).run("probe_case", failing_ranks=failing)
    own = "symmetric memory did not map (RuntimeError: CUDA driver error: invalid device ordinal)"
    other = "symmetric memory did not map on another rank of the CP group"
    want = (
        {0: None, 1: None} if not failing else {r: own if r in failing else other for r in (0, 1)}
    )
    assert got == [want[0], want[1]]


class _Group:
    group_name = "cp-test"


@pytest.mark.parametrize("choice", ["auto", "copy-engine"])
def test_a_failed_probe_falls_back_under_auto_and_fails_when_asked_for(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, choice: str
) -> None:
    from megatron_rocm.runtime.backend import _cp_copy_engine

    class Unmappable:
        def __init__(self, group, device) -> None:  # noqa: ANN001
            pass

        def probe(self) -> str:
            return "symmetric memory did not map on another rank of the CP group"

    monkeypatch.setattr(_cp_copy_engine, "why_not_copy_engines", lambda *a, **k: None)
    monkeypatch.setattr(_cp_copy_engine, "CopyEngineLink", Unmappable)
    monkeypatch.setattr(_cp_copy_engine, "_links", {})
    monkeypatch.setattr(_cp_copy_engine, "_mapped_names", {})
    monkeypatch.setenv(_cp_copy_engine.TRANSPORT_ENV, choice)
    group = _Group()
    if choice == "copy-engine":
        with pytest.raises(ValueError, match="=copy-engine: symmetric memory did not map on an"):
            _cp_copy_engine.link_for(group, torch.device("cpu"))
        return
    with caplog.at_level(logging.WARNING):
        assert _cp_copy_engine.link_for(group, torch.device("cpu")) is None
    assert "a2a exchanges through the process group: symmetric memory did not map" in caplog.text
    assert _cp_copy_engine._links == {("cp-test", id(group)): None}  # decided once
    # the probe failed somewhere, yet PyTorch's store for the name exists on every rank: each
    # rank recorded it, so a later group of that name is refused on all of them alike
    assert _cp_copy_engine._mapped_names["cp-test"]() is group


def _one_nccl_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CP group of two NCCL ranks on this host, as ``why_not_copy_engines`` sees it."""
    import torch.distributed as dist

    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_gather_object", lambda out, obj, group=None: out.__setitem__(
        slice(None), [obj] * len(out)))  # fmt: skip


def test_a_group_made_again_under_an_earlier_name_keeps_the_process_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """PyTorch caches symmetric memory's store by group name: a new group under the name of one
    that mapped a window before must not meet that store (the same group may map again)."""
    import weakref

    from megatron_rocm.runtime.backend import _cp_copy_engine

    _one_nccl_host(monkeypatch)
    earlier, group = _Group(), _Group()
    monkeypatch.setattr(_cp_copy_engine, "_mapped_names", {"cp-test": weakref.ref(earlier)})
    cuda = torch.device("cuda")
    reason = _cp_copy_engine.why_not_copy_engines(group, cuda, on_rocm=False, auto=True)
    assert reason == (
        "an earlier group named 'cp-test' mapped symmetric memory, whose store PyTorch caches by "
        "group name"
    )
    assert _cp_copy_engine.why_not_copy_engines(earlier, cuda, on_rocm=False, auto=True) is None
    del earlier  # gone, but its store is still cached under the name
    assert _cp_copy_engine.why_not_copy_engines(group, cuda, on_rocm=False, auto=True) == reason


def test_the_barrier_waits_as_long_as_the_groups_collectives() -> None:
    """A peer that never reaches a barrier fails it after the CP group's own timeout (Megatron's
    --distributed-timeout-minutes), PyTorch's NCCL default where the group does not say."""
    from datetime import timedelta
    from types import SimpleNamespace

    import torch.distributed as dist

    from megatron_rocm.runtime.backend._cp_copy_engine import group_timeout_ms

    class Timed(_Group):
        def _get_backend(self, device: torch.device) -> SimpleNamespace:
            return SimpleNamespace(options=SimpleNamespace(_timeout=timedelta(minutes=3)))

    assert group_timeout_ms(Timed()) == 180_000
    default = getattr(dist.constants, "default_pg_nccl_timeout", None) or timedelta(minutes=10)
    assert group_timeout_ms(_Group()) == int(default.total_seconds() * 1000)


def test_the_window_grows_at_least_twofold(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each growth remaps the window on every rank (a collective, after a device sync), so
    growing sizes remap it a few times, not at every new size."""
    import torch.distributed._symmetric_memory as symm_mem

    from megatron_rocm.runtime.backend._cp_copy_engine import CopyEngineLink

    mapped: list[int] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(symm_mem, "empty", lambda n, **kw: mapped.append(n) or torch.empty(0))
    monkeypatch.setattr(symm_mem, "rendezvous", lambda window, name: object())
    monkeypatch.setattr(symm_mem, "enable_symm_mem_for_group", lambda name: None, raising=False)
    link = object.__new__(CopyEngineLink)  # no CUDA stream on the CPU: the sizes only
    link.group, link.device, link._region = _Group(), torch.device("cpu"), 0
    for nbytes in (1 << 20, 80 << 20, 81 << 20, 100 << 20, 170 << 20):
        link.reserve(nbytes)
    # two regions (outbox, inbox) of: 1 MiB, 80 MiB, 160 MiB (81 asked), none for 100 (160
    # hold it), 320 MiB (170 asked)
    assert [n // 2 >> 20 for n in mapped] == [1, 80, 160, 320]


def test_a2a_copies_the_ranks_own_heads_while_the_peers_travel(worlds) -> None:  # noqa: ANN001
    """Forward: pack q, k, v for the peer; post; only then the rank's own q, k, v into place.
    The way back: post the peer's tokens first, then place the own ones, then unpack."""
    events = worlds(2).run("a2a_order_case", tensors=_inputs(GQA, torch.float32))
    scatter = ["copy"] * 3 + ["post"] + ["copy"] * 3
    relayout = ["copy"]  # the math kernel's [b, h, s, d] output as [s, b, h, d]
    gather = ["post", "copy", "copy"]
    assert events == [scatter + relayout + gather] * 2


# --- a2a's backward exchange, started by the output projection ------------------------------


def _handoff_inputs(shape: tuple[int, ...] = GQA) -> dict:
    """q/k/v and output gradient of ``shape``, and a square projection weight over the
    attention's output (so the loss can also read that output directly)."""
    width = shape[2] * shape[5]
    weight = torch.randn(width, width, generator=torch.Generator().manual_seed(3)) / width**0.5
    return {"tensors": _inputs(shape, torch.float32), "weight": weight}


# shape -> head groups a2a runs through the process group (gloo here, RCCL on ROCm) when
# none are asked for: one kv head per rank gives one; two kv heads per rank two, and every
# batch one group posts becomes one per group
HANDOFF_SHAPES = {"one_group": (GQA, 1), "two_groups": ((16, 2, 8, 4, 8, 8), 2)}

# case -> (taken per step, settled exchanges, posted batches with / without the handoff)
HANDOFF_CASES = {
    "plain": ({}, [True, True], 0, (8, 8)),
    # the loss reads the output too: the started exchange is settled, a fresh one made
    "also_read": ({"also_read": True}, [False, False], 2, (10, 8)),
    # the first step's attention backward never runs: settled before the second step's
    "prune_first": ({"prune_first": True}, [True], 1, (7, 6)),
}


@pytest.mark.parametrize("layout", list(HANDOFF_SHAPES))
@pytest.mark.parametrize("case", list(HANDOFF_CASES))
def test_the_projection_starts_a2a_backward_exchange_with_the_same_results(
    worlds,  # noqa: ANN001
    case: str,
    layout: str,
) -> None:
    """The output projection starts the attention's first backward exchange between its two
    GEMMs, and the attention takes it: results bit for bit those of the exchange made by the
    attention itself. An exchange started for another gradient than the one the attention gets,
    or for an attention whose backward never runs, is settled (completed unread) before the
    group's next exchange, and the exchanges after it still pair up (per step and head group:
    two batches posted forward, two backward, one more for a started exchange that is
    settled); with one head group and with two."""
    options, taken, settled, posts = HANDOFF_CASES[case]
    shape, groups = HANDOFF_SHAPES[layout]
    inputs = _handoff_inputs(shape)
    on = worlds(2).run("handoff_case", handoff="backward", **options, **inputs)
    off = worlds(2).run("handoff_case", handoff="0", **options, **inputs)
    for with_handoff, without in zip(on, off, strict=True):
        assert with_handoff["taken"] == taken and without["taken"] == []
        assert (with_handoff["settled"], without["settled"]) == (settled, 0)
        assert (with_handoff["posts"], without["posts"]) == tuple(groups * n for n in posts)
        assert (with_handoff["split"], without["split"]) == (0, 0)
        assert with_handoff["dq"].abs().sum() > 0
        for name in ("out", "dq", "dk", "dv", "dw"):
            assert torch.equal(with_handoff[name], without[name]), name


@pytest.mark.parametrize("layout", list(HANDOFF_SHAPES))
@pytest.mark.parametrize("case", list(HANDOFF_CASES))
def test_the_projection_computes_while_the_a2a_output_lands(
    worlds,  # noqa: ANN001
    case: str,
    layout: str,
) -> None:
    """With the forward handoff too (the default), the attention returns its output before the
    peers' heads have landed and the projection computes over the rank's own heads meanwhile,
    once per step: the same gradients bit for bit (the landed output is the same tensor, the
    input gradient the same GEMM), the backward's exchange taken or settled as without it, the
    output equal but for the order of the GEMM's sums; with one head group and with two."""
    options, taken, settled, posts = HANDOFF_CASES[case]
    shape, groups = HANDOFF_SHAPES[layout]
    inputs = _handoff_inputs(shape)
    both = worlds(2).run("handoff_case", handoff="1", **options, **inputs)
    backward = worlds(2).run("handoff_case", handoff="backward", **options, **inputs)
    for with_forward, without in zip(both, backward, strict=True):
        assert (with_forward["split"], without["split"]) == (2, 0)
        assert with_forward["taken"] == taken and with_forward["settled"] == settled
        assert with_forward["posts"] == groups * posts[0]
        for name in ("dq", "dk", "dv", "dw"):
            assert torch.equal(with_forward[name], without[name]), name
        torch.testing.assert_close(with_forward["out"], without["out"], rtol=1e-5, atol=1e-5)
        assert not torch.equal(with_forward["out"], torch.zeros_like(without["out"]))


@pytest.mark.parametrize("value", ["0", "two"])
def test_a_bad_head_group_count_fails_the_first_a2a_attention(
    worlds,  # noqa: ANN001
    value: str,
) -> None:
    """``MEGATRON_ROCM_CP_A2A_STAGES`` that is not a positive whole number stops the first a2a
    attention call on every rank with one line naming it."""
    with pytest.raises(AssertionError, match=f"MEGATRON_ROCM_CP_A2A_STAGES='{value}' is not a"):
        _assert_parity(worlds(2), GQA, comm_type="a2a", a2a_stages=value)


@pytest.mark.parametrize("cp", [2, 4])
def test_an_early_output_lands_before_anything_reads_it(worlds, cp: int) -> None:  # noqa: ANN001
    """Whatever reads the attention's early output first (here a reshape, as upstream does for
    packed sequences, then a plain matmul) sees the peers' heads: equal to the output of the
    exchange finished inside the attention; and one nobody reads lands before the group's next
    exchange, which still pairs up. At cp=4 the middle ranks' peers' heads land on both sides
    of their own."""
    results = worlds(cp).run("early_output_case", tensors=_inputs(GQA, torch.float32))
    for result in results:
        assert result["early_type"] == "EarlyOutput" and result["finished_type"] == "Tensor"
        assert not result["finished"].isnan().any()
        assert torch.equal(result["read"], result["finished"])
        assert torch.equal(result["after_unread"], result["finished"])
        assert result["open_after"] == 0


def _early_input(link: str) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """An fp32 early output of 8 columns whose last 4 are NaN until they land, its full
    values, and a log of the landing."""
    from megatron_rocm.runtime.backend._cp_early_output import hand_on_early, untracked

    full = torch.randn(4, 2, 8, generator=torch.Generator().manual_seed(11))
    x, log = full.clone(), []
    untracked(x)[..., 4:] = float("nan")

    def land() -> None:
        log.append("landed")
        untracked(x)[..., 4:] = full[..., 4:]

    return hand_on_early(x, slice(0, 4), land, link), full, log


def test_the_projection_lands_an_early_output_under_autocast() -> None:
    """Under autocast the own heads' GEMM gives bf16, and the peers' columns are added in bf16
    too (an in-place addmm would meet fp32 inputs): the result is autocast's GEMM's."""
    from megatron_rocm.runtime.backend._linear_function import project_attention_output

    weight = torch.randn(6, 8, generator=torch.Generator().manual_seed(12))
    view, full, log = _early_input("autocast")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = project_attention_output(view, weight, False)
        reference = torch.matmul(full, weight.t())
    assert log == ["landed"] and y.dtype == reference.dtype == torch.bfloat16
    torch.testing.assert_close(y, reference, rtol=2e-2, atol=2e-2)


def test_a_failing_gemm_still_lands_the_early_output(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every rank must land the exchange where the others do: a GEMM that fails between taking
    the landing and finishing it still lands it, then the error goes on."""
    from megatron_rocm.runtime.backend import _cp_early_output
    from megatron_rocm.runtime.backend._linear_function import project_attention_output

    def failing_mm(*args: object) -> None:
        raise RuntimeError("out of memory")

    view, _, log = _early_input("failing")
    monkeypatch.setattr(torch, "mm", failing_mm)
    with pytest.raises(RuntimeError, match="out of memory"):
        project_attention_output(view, torch.randn(6, 8), False)
    assert log == ["landed"] and "failing" not in _cp_early_output._landings


@pytest.mark.parametrize("value", ["2", "both", "sideways", "y"])
def test_the_handoff_switch_names_its_directions(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    from megatron_rocm.runtime.backend import _cp_handoff

    for text, directions in (
        ("1", {"forward", "backward"}),
        ("0", set()),
        ("", {"forward", "backward"}),
        ("Yes", {"forward", "backward"}),  # the one boolean grammar (runtime.settings)
        ("off", set()),
    ):
        monkeypatch.setenv(_cp_handoff.HANDOFF_ENV, text)
        assert _cp_handoff.handoff_directions() == directions
    monkeypatch.setenv(_cp_handoff.HANDOFF_ENV, "forward")
    assert _cp_handoff.handoff_directions() == {"forward"}
    monkeypatch.setenv(_cp_handoff.HANDOFF_ENV, value)
    with pytest.raises(ValueError) as failure:
        _cp_handoff.handoff_directions()
    assert str(failure.value) == (
        f"MEGATRON_ROCM_CP_A2A_HANDOFF={value!r} is not a boolean (1/true/on/yes or "
        "0/false/off/no) or one of forward, backward"
    )


class _Exchange:
    def __init__(self, log: list[str]) -> None:
        self.log = log

    def post(self) -> None:
        self.log.append("post")

    def result(self) -> str:
        self.log.append("result")
        return "exchanged"

    def settle(self) -> None:
        self.log.append("settle")


def test_only_the_offered_output_untouched_is_claimed_and_only_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from megatron_rocm.runtime.backend import _cp_handoff

    monkeypatch.setattr(_cp_handoff, "_offered", None)
    output = torch.randn(4, 2, 6, requires_grad=True) * 1  # an op's result, as attention's
    handoff = _cp_handoff.Handoff(lambda grad: _Exchange([]), "cp")
    _cp_handoff.offer(handoff, output)
    assert _cp_handoff.claim(output.clone()) is None  # same values, other memory
    assert _cp_handoff.claim(output.view(4, 12)) is None  # another shape
    assert _cp_handoff.claim(output.detach()) is None  # out of the graph: no backward to take
    assert _cp_handoff.claim(output.view(4, 2, 6)) is handoff  # a view alike
    assert _cp_handoff.claim(output) is None  # claimed already
    _cp_handoff.offer(handoff, output)
    output.add_(1)  # changed after the offer: the gradient it would start from is unknown
    assert _cp_handoff.claim(output) is None


def test_a_started_exchange_is_taken_for_its_gradient_and_settled_for_another(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from megatron_rocm.runtime.backend import _cp_handoff

    monkeypatch.setattr(_cp_handoff, "_open", {})
    log: list[str] = []
    handoff = _cp_handoff.Handoff(lambda grad: log.append("begin") or _Exchange(log), "cp")
    grad = torch.randn(4, 2, 6)
    assert handoff.take(grad) is None and log == []  # nothing started: the caller exchanges
    handoff.begin(grad)
    handoff.post()
    assert handoff.take(grad.view(4, 2, 6)) == "exchanged"
    assert log == ["begin", "post", "result"]
    handoff.begin(grad)
    assert handoff.take(grad + 0) is None and log[-2:] == ["begin", "settle"]
    handoff.begin(grad)
    grad.mul_(2)  # changed in place after the exchange packed it
    assert handoff.take(grad) is None and log[-1] == "settle"
    assert handoff.take(grad) is None and log[-1] == "settle"  # once only
    assert _cp_handoff._open == {}


def test_an_exchange_nobody_takes_is_settled_before_the_groups_next(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A started exchange whose attention backward never runs (left out of the graph autograd
    ran) is completed before the next exchange of its group, and only of its group."""
    from megatron_rocm.runtime.backend import _cp_handoff

    monkeypatch.setattr(_cp_handoff, "_open", {})
    log: list[str] = []
    first = _cp_handoff.Handoff(lambda grad: log.append("begin 1") or _Exchange(log), "cp")
    other = _cp_handoff.Handoff(lambda grad: log.append("begin 2") or _Exchange(log), "cp-b")
    first.begin(torch.randn(3))
    other.begin(torch.randn(3))
    _cp_handoff.settle_open("cp-c")  # another group: nothing to do
    assert log == ["begin 1", "begin 2"]
    _cp_handoff.settle_open("cp")  # the group's next exchange
    assert log[-1] == "settle" and first.take(torch.randn(3)) is None
    second = _cp_handoff.Handoff(lambda grad: log.append("begin 3") or _Exchange(log), "cp-b")
    second.begin(torch.randn(3))  # a handoff's own start settles the group's open one first
    assert log == ["begin 1", "begin 2", "settle", "settle", "begin 3"]
    assert other.take(torch.randn(3)) is None
    assert list(_cp_handoff._open) == ["cp-b"]


@pytest.mark.gpu
@pytest.mark.parametrize("transport", ["copy-engine", "process-group"])
def test_gpu_an_early_output_lands_before_anything_reads_it(
    gpu_world: World, transport: str
) -> None:
    """On two GPUs, both transports: a reader that is not the projection sees the whole output,
    and one nobody reads lands before the group's next exchange."""
    if transport == "copy-engine" and torch.version.hip:
        pytest.skip("copy engines through symmetric memory are not measured on ROCm yet")
    shape = A2A_GPU_SHAPE
    results = gpu_world.run(
        "early_output_case", tensors=_inputs(shape, torch.float32), transport=transport
    )
    for result in results:
        assert result["early_type"] == "EarlyOutput" and result["open_after"] == 0
        assert result["copy_engine"] is (transport == "copy-engine")
        assert not result["finished"].isnan().any()
        assert torch.equal(result["read"], result["finished"])
        assert torch.equal(result["after_unread"], result["finished"])


@pytest.mark.gpu
@pytest.mark.parametrize("transport", ["copy-engine", "process-group"])
@pytest.mark.parametrize("case", list(HANDOFF_CASES))
def test_gpu_the_projection_starts_a2a_backward_exchange(
    gpu_world: World, transport: str, case: str
) -> None:
    """On two GPUs, both transports: the projection computing while the output lands and
    starting the backward's exchange gives what the attention's own exchanges give (cuDNN's
    backward may sum in another order, and bf16 rounds the projection's first partial sum:
    close, not always equal)."""
    if transport == "copy-engine" and torch.version.hip:
        pytest.skip("copy engines through symmetric memory are not measured on ROCm yet")
    options, taken, settled, _ = HANDOFF_CASES[case]
    inputs = _handoff_inputs(A2A_GPU_SHAPE)
    run = dict(transport=transport, dtype=torch.bfloat16, **options, **inputs)
    on = gpu_world.run("handoff_case", handoff="1", **run)
    off = gpu_world.run("handoff_case", handoff="0", **run)
    for with_handoff, without in zip(on, off, strict=True):
        assert with_handoff["taken"] == taken and with_handoff["settled"] == settled
        assert (with_handoff["split"], without["split"]) == (2, 0)
        assert with_handoff["copy_engine"] is (transport == "copy-engine")
        for name in ("out", "dq", "dk", "dv", "dw"):
            torch.testing.assert_close(with_handoff[name], without[name], atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_gpu_a2a_peer_that_never_reaches_the_barrier_fails_it_after_the_group_timeout() -> None:
    """A rank left alone in an a2a exchange on copy engines (its peer gone, as after a crash)
    does not spin: its barrier traps after the CP group's own timeout, and the process gets a
    CUDA error instead of hanging. Its own world: the trap leaves the CUDA context unusable."""
    if torch.cuda.device_count() < 2 or torch.version.hip:
        pytest.skip("needs 2 CUDA GPUs (copy engines are not measured on ROCm yet)")
    timeout_s = 5.0
    world = World(2, backend="nccl")
    try:
        alone, absent = world.run(
            "missing_peer_case", timeout=120, tensors=_inputs(A2A_GPU_SHAPE, torch.float32),
            absent=1, timeout_s=timeout_s,
        )  # fmt: skip
    finally:
        world.close()
    assert absent == "absent"
    assert alone["error"] is not None and "CUDA error" in alone["error"], alone
    assert timeout_s <= alone["seconds"] < timeout_s + 60, alone
