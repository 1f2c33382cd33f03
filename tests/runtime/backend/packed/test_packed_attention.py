"""Packed (THD) attention against attention done document by document (forward and dq/dk/dv).

The oracle slices the packed tensors with plain Python offsets (not the module's plan) and
computes each document's attention in float64 with its own masks (sharing no code with the
"reference" implementation, which runs ``attention_reference`` per document); padding rows must
come out zero and receive zero gradient. The varlen flash kernel has no CPU implementation:
its glue (offsets, padding, gather, zeroed rows) is tested here with a CPU stand-in that has
the kernel's contract, including the rows it leaves unwritten; the kernel itself runs in the
``gpu`` tests.
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from megatron_rocm.runtime.backend.packed import document_mask  # noqa: E402
from megatron_rocm.runtime.backend.packed import plan as packed_plan  # noqa: E402
from megatron_rocm.runtime.backend.packed import thd_attention as pa  # noqa: E402
from megatron_rocm.runtime.kernels.local_sdpa import attention_reference  # noqa: E402

TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 3e-3}
GARBAGE = 1.0e4


class Batch:
    """Documents packed into storage rows, with optional padding after each and a tail."""

    def __init__(
        self,
        lens,
        pads=None,
        tail=0,
        heads=4,
        groups=2,
        dim=8,
        dim_v=None,
        dtype=torch.float32,
        kv_lens=None,
        seed=0,
    ):  # noqa: ANN001
        gen = torch.Generator().manual_seed(seed)
        self.lens, self.kv_lens = list(lens), list(kv_lens or lens)
        self.pads = list(pads or [0] * len(lens))
        self.starts = [
            sum(a + p for a, p in zip(self.lens[:i], self.pads[:i])) for i in range(len(lens))
        ]
        self.kv_starts = (
            self.starts if kv_lens is None else [sum(self.kv_lens[:i]) for i in range(len(lens))]
        )
        t = self.starts[-1] + self.lens[-1] + self.pads[-1] + tail
        t_kv = t if kv_lens is None else sum(self.kv_lens)
        dim_v = dim_v or dim

        def rand(rows, h, d):  # noqa: ANN001, ANN202
            return torch.randn(rows, h, d, generator=gen)

        self.q, self.k, self.v = (
            rand(t, heads, dim),
            rand(t_kv, groups, dim),
            rand(t_kv, groups, dim_v),
        )
        real_q = torch.zeros(t, dtype=torch.bool)
        for s, n in zip(self.starts, self.lens):
            real_q[s : s + n] = True
        self.real_q = real_q
        # Padding holds large values: attending to it anywhere would show.
        for x in (self.q, self.k, self.v) if kv_lens is None else (self.q,):
            x[~real_q] *= 100
        self.q, self.k, self.v = (x.to(dtype) for x in (self.q, self.k, self.v))
        self.cu = torch.tensor([0] + list(_cumsum(self.lens)), dtype=torch.int32)
        self.cu_kv = (
            self.cu
            if kv_lens is None
            else torch.tensor([0] + list(_cumsum(self.kv_lens)), dtype=torch.int32)
        )
        padded = any(self.pads) or tail
        stored = [n + p for n, p in zip(self.lens, self.pads)]
        self.cu_padded = (
            torch.tensor([0] + list(_cumsum(stored)), dtype=torch.int32) if any(self.pads) else None
        )
        self.t, self.padded = t, padded

    def kwargs(self, causal: bool, **extra) -> dict:  # noqa: ANN003
        return dict(cu_seqlens_q=self.cu, cu_seqlens_kv=self.cu_kv, cu_seqlens_q_padded=self.cu_padded,
                    cu_seqlens_kv_padded=self.cu_padded, causal=causal, **extra)  # fmt: skip


def _cumsum(xs):  # noqa: ANN001, ANN202
    total = 0
    for x in xs:
        total += x
        yield total


def oracle(batch: Batch, q, k, v, causal, scale=None, window=None):  # noqa: ANN001, ANN201
    """Per document with Python offsets, dense float64 attention written out here (no code of
    the module or of ``attention_reference``); zeros elsewhere. Query i of a document sees key
    j when ``i + d - left <= j <= i + d + right`` (``d`` = keys - queries, bottom-right
    aligned; a negative bound is unbounded) and, causal, ``j <= i``."""
    heads, groups, dim_v = q.shape[1], k.shape[1], v.shape[-1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    left, right = window if window is not None else (-1, -1)
    dev = q.device  # the gpu tests' operands stay on the GPU, in float64 there
    out = torch.zeros(q.shape[0], heads, dim_v, dtype=torch.float64, device=dev)
    for s, n, ks, kn in zip(batch.starts, batch.lens, batch.kv_starts, batch.kv_lens):
        if n == 0:
            continue
        i = torch.arange(n, device=dev)[:, None] + (kn - n)  # each query's diagonal key
        j = torch.arange(kn, device=dev)[None, :]
        keep = torch.ones(n, kn, dtype=torch.bool, device=dev)
        if causal:
            keep &= j <= torch.arange(n, device=dev)[:, None]
        if left >= 0:
            keep &= j >= i - left
        if right >= 0:
            keep &= j <= i + right
        qd = q[s : s + n].double().transpose(0, 1)  # [heads, n, dim]
        kd, vd = (x[ks : ks + kn].double().transpose(0, 1) for x in (k, v))
        kd, vd = (x.repeat_interleave(heads // groups, dim=0) for x in (kd, vd))
        scores = (qd @ kd.transpose(1, 2) * scale).masked_fill(~keep, -math.inf)
        out[s : s + n] = (torch.softmax(scores, dim=-1) @ vd).transpose(0, 1)
    return out.reshape(q.shape[0], -1).to(q.dtype)


def run_both(batch: Batch, impl: str, causal: bool, scale=None, window=None, **extra):  # noqa: ANN001, ANN003, ANN201
    """(ours, expected) outputs and (ours, expected) grads of q, k, v (None: not checked).

    Flex attention has no CPU backward: on the CPU its gradients are left to the gpu tests.
    """
    backward = not (impl == "flex" and not batch.q.is_cuda)
    leaves = [x.clone().requires_grad_(backward) for x in (batch.q, batch.k, batch.v)]
    refs = [x.clone().float().requires_grad_() for x in (batch.q, batch.k, batch.v)]
    win = tuple(window) if window is not None else None
    out = pa.packed_attention(*leaves, softmax_scale=scale, window_size=win, implementation=impl,
                              **batch.kwargs(causal), **extra)  # fmt: skip
    exp = oracle(batch, *refs, causal, scale if scale is not None else batch.q.shape[-1] ** -0.5,
                 None if win is None else _causal_window(win, causal))  # fmt: skip
    if not backward:
        return out, exp, None, None
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out.device)
    out.backward(grad.to(out.dtype))
    exp.backward(grad)
    return out, exp, [x.grad for x in leaves], [x.grad for x in refs]


def _causal_window(win, causal):  # noqa: ANN001, ANN202
    return (win[0], 0) if causal else win


def assert_parity(batch: Batch, impl: str, causal: bool, **kw) -> None:  # noqa: ANN003
    out, exp, grads, exp_grads = run_both(batch, impl, causal, **kw)
    tol = TOL[batch.q.dtype]
    assert (
        out.shape == (batch.t, batch.q.shape[1] * batch.v.shape[-1]) and out.dtype == batch.q.dtype
    )
    torch.testing.assert_close(out.float(), exp.detach(), atol=tol, rtol=tol)
    assert torch.all(out[~batch.real_q] == 0)
    if grads is None:
        return
    for ours, theirs, name in zip(grads, exp_grads, "qkv"):
        message = f"d{name}: {{}}"
        torch.testing.assert_close(
            ours.float(), theirs, atol=tol * 4, rtol=tol * 4, msg=message.format
        )
    assert torch.all(grads[0][~batch.real_q] == 0)


# --------------------------------------------------------------------------- flash stand-in


class FakeFlash(torch.autograd.Function):
    """The varlen flash contract on the CPU: documents at ``cu`` offsets, bottom-right causal
    and window, rows past ``cu[-1]`` left unwritten (garbage) in the output and gradients."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window):  # noqa: ANN001, ANN205
        ctx.calls = (cu_q.tolist(), cu_k.tolist())
        with torch.enable_grad():
            leaves = [x.detach().requires_grad_() for x in (q, k, v)]
            out = _fake_forward(
                *leaves, cu_q.tolist(), cu_k.tolist(), max_q, max_k, causal, scale, window
            )
        ctx.graph = (out, leaves)
        return out.detach()

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        out, leaves = ctx.graph
        grads = list(torch.autograd.grad(out, leaves, grad, allow_unused=True))
        cu_q, cu_k = ctx.calls
        grads = [torch.zeros_like(x) if g is None else g for g, x in zip(grads, leaves)]
        grads[0][cu_q[-1] :] = GARBAGE
        grads[1][cu_k[-1] :] = GARBAGE
        grads[2][cu_k[-1] :] = GARBAGE
        return (*grads, None, None, None, None, None, None, None)


def _fake_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window):  # noqa: ANN001, ANN202
    assert q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
    lens_q = [b - a for a, b in zip(cu_q, cu_q[1:])]
    lens_k = [b - a for a, b in zip(cu_k, cu_k[1:])]
    assert max_q >= max(lens_q) and max_k >= max(lens_k), "max_seqlen too small"
    heads, groups = q.shape[1], k.shape[1]
    pieces = []
    for sq, lq, sk, lk in zip(cu_q, lens_q, cu_k, lens_k):
        qi, ki, vi = q[sq : sq + lq], k[sk : sk + lk], v[sk : sk + lk]
        ki, vi = (x.repeat_interleave(heads // groups, dim=1) for x in (ki, vi))
        scores = torch.einsum("qhd,khd->hqk", qi.float(), ki.float()) * scale
        i = torch.arange(lq)[:, None] + (lk - lq)
        j = torch.arange(lk)[None, :]
        keep = torch.ones(lq, lk, dtype=torch.bool)
        left, right = window if window is not None else (-1, -1)
        if causal:
            right = 0
        if left >= 0:
            keep &= j >= i - left
        if right >= 0:
            keep &= j <= i + right
        probs = torch.softmax(scores.masked_fill(~keep, -math.inf), dim=-1).nan_to_num(0.0)
        pieces.append(torch.einsum("hqk,khd->qhd", probs, vi.float()).to(q.dtype))
    tail = q.shape[0] - cu_q[-1]
    pieces.append(torch.full((tail, heads, v.shape[-1]), GARBAGE, dtype=q.dtype))
    return torch.cat(pieces)


@pytest.fixture
def fake_flash(monkeypatch: pytest.MonkeyPatch) -> list:
    calls: list = []

    def kernel(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, causal, scale, window):  # noqa: ANN001, ANN202
        assert cu_q.dtype == torch.int32 and cu_k.dtype == torch.int32
        calls.append({"dropout_p": dropout_p, "cu_q": cu_q.tolist(), "window": window})
        return FakeFlash.apply(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window)

    monkeypatch.setattr(pa, "_flash_kernel", kernel)
    monkeypatch.setattr(pa, "flash_unavailable", lambda *a: None)
    monkeypatch.setattr(pa, "_flash_probe", lambda *a: None)
    return calls


CPU_IMPLS = ["reference", "sdpa_loop", "flex", "flash"]
FLEX_FULL = pytest.param("flex", marks=pytest.mark.full)  # eager flex on the CPU: seconds a case


@pytest.fixture(params=[FLEX_FULL if name == "flex" else name for name in CPU_IMPLS])
def impl(request: pytest.FixtureRequest) -> str:
    if request.param == "flash":
        request.getfixturevalue("fake_flash")
    return request.param


# --------------------------------------------------------------------------- parity

UNEVEN = [5, 1, 9, 1, 3]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads,groups", [(4, 4), (4, 2), (6, 1)])
def test_uneven_documents_with_length_one(impl: str, causal: bool, heads: int, groups: int) -> None:
    assert_parity(Batch(UNEVEN, heads=heads, groups=groups), impl, causal)


@pytest.mark.parametrize("dtype", list(TOL))
def test_dtypes(impl: str, dtype: torch.dtype) -> None:
    assert_parity(Batch([7, 2, 12], dtype=dtype, dim=16), impl, True)


@pytest.mark.parametrize("causal", [True, False])
def test_padded_cu_seqlens(impl: str, causal: bool) -> None:
    """cu_seqlens_padded: padding after documents (none after some) and rows past the end."""
    batch = Batch(UNEVEN, pads=[2, 0, 3, 1, 4], tail=3)
    assert batch.cu_padded is not None
    assert_parity(batch, impl, causal)


def test_rows_past_the_last_document(impl: str) -> None:
    batch = Batch([4, 6], tail=5)
    assert batch.cu_padded is None and batch.t == 15
    assert_parity(batch, impl, True)


def test_empty_document(impl: str) -> None:
    assert_parity(Batch([3, 0, 4], pads=[1, 2, 0]), impl, True)


@pytest.mark.parametrize(
    "causal,window", [(True, (2, 0)), (True, (3, -1)), (False, (2, 1)), (False, (-1, 2))]
)
def test_sliding_window(impl: str, causal: bool, window: tuple[int, int]) -> None:
    assert_parity(Batch([9, 1, 6]), impl, causal, window=window)


def test_softmax_scale(impl: str) -> None:
    assert_parity(Batch([6, 3]), impl, True, scale=0.37)


def test_cross_attention_lengths(impl: str) -> None:
    """Non-causal with different query and key lengths per document (cu_q != cu_kv)."""
    assert_parity(Batch([3, 5, 1], kv_lens=[6, 2, 4]), impl, False)


@pytest.mark.parametrize("impl_name", ["reference", "sdpa_loop", FLEX_FULL])
def test_value_head_dim_differs(impl_name: str) -> None:
    assert_parity(Batch([5, 4], dim=16, dim_v=8), impl_name, True)


@pytest.mark.full
def test_long_documents_span_flex_blocks() -> None:
    """Documents crossing 128-row blocks: full, partial and skipped blocks of the flex mask."""
    from megatron_rocm.runtime.backend.packed.flex import document_block_mask

    batch = Batch([300, 1, 90, 400], pads=[0, 0, 40, 0], tail=20, heads=2, groups=1, dim=8)
    for causal, window in [(True, None), (False, None), (True, (300, 0)), (False, (200, 40))]:
        assert_parity(batch, "flex", causal, window=window)
        plan = packed_plan.build_plan(batch.t, batch.t, batch.cu, batch.cu, batch.cu_padded,
                                      batch.cu_padded, causal=causal, device=torch.device("cpu"))  # fmt: skip
        mask = document_block_mask(plan, causal, window)
        _check_block_classes(batch, mask, causal, window)
        blocks = mask.kv_num_blocks.sum() + mask.full_kv_num_blocks.sum()
        assert blocks < mask.kv_indices.shape[-1] ** 2  # some blocks are skipped
        assert mask.full_kv_num_blocks.sum() > 0 or window == (200, 40)  # some skip mask_mod


def _check_block_classes(batch: Batch, mask, causal: bool, window) -> None:  # noqa: ANN001
    """Eager flex (CPU) applies mask_mod everywhere, so check the block classes directly:
    a "full" block holds only allowed pairs; every allowed pair lies in a visited block."""
    doc = torch.full((batch.t,), -1)
    for i, (s, n) in enumerate(zip(batch.starts, batch.lens)):
        doc[s : s + n] = i
    rows = torch.arange(batch.t)
    allowed = (doc[:, None] == doc[None, :]) & (doc[:, None] >= 0)
    left, right = window if window is not None else (-1, -1)
    if causal:
        allowed &= rows[:, None] >= rows[None, :]
    if left >= 0:
        allowed &= rows[:, None] - rows[None, :] <= left
    if right >= 0 and not causal:
        allowed &= rows[None, :] - rows[:, None] <= right
    nb = mask.kv_indices.shape[-1]
    padded = torch.zeros(nb * 128, nb * 128, dtype=torch.bool)
    padded[: batch.t, : batch.t] = allowed
    tiles = padded.view(nb, 128, nb, 128).permute(0, 2, 1, 3)
    visited = torch.zeros(nb, nb, dtype=torch.bool)
    for r in range(nb):
        full = mask.full_kv_indices[0, 0, r, : mask.full_kv_num_blocks[0, 0, r]].tolist()
        part = mask.kv_indices[0, 0, r, : mask.kv_num_blocks[0, 0, r]].tolist()
        for c in full:
            rows_in = min(128, batch.t - r * 128)
            cols_in = min(128, batch.t - c * 128)
            assert tiles[r, c, :rows_in, :cols_in].all(), f"full block {r},{c} has masked pairs"
        visited[r, full + part] = True
    assert not tiles.any(dim=(2, 3))[~visited].any(), "an allowed pair lies in a skipped block"


# --------------------------------------------------------------------------- leakage


def test_other_documents_do_not_leak(impl: str) -> None:
    """Changing document 0 (and the padding) changes nothing in documents 1 and 2."""
    batch = Batch([6, 5, 7], pads=[2, 0, 1])
    kwargs = batch.kwargs(True)
    out = pa.packed_attention(
        batch.q, batch.k, batch.v, softmax_scale=None, implementation=impl, **kwargs
    )
    q, k, v = batch.q.clone(), batch.k.clone(), batch.v.clone()
    doc0 = slice(0, 8)  # document 0 and its padding
    for x in (q, k, v):
        x[doc0] = torch.randn(x[doc0].shape)
    out2 = pa.packed_attention(q, k, v, softmax_scale=None, implementation=impl, **kwargs)
    assert not torch.equal(out[:6], out2[:6])
    torch.testing.assert_close(out2[8:], out[8:], atol=1e-6, rtol=0)


def test_the_comparison_catches_cross_document_attention() -> None:
    """Control: one causal attention over the whole packed tensor fails the parity check."""
    batch = Batch([6, 5, 7])
    exp = oracle(batch, batch.q, batch.k, batch.v, True)
    leaky = attention_reference(
        batch.q[:, None], batch.k[:, None], batch.v[:, None], None, "causal"
    )[:, 0]
    torch.testing.assert_close(leaky[:6], exp[:6])  # the first document has nothing to leak from
    with pytest.raises(AssertionError):
        torch.testing.assert_close(leaky, exp, atol=TOL[torch.float32], rtol=TOL[torch.float32])


# --------------------------------------------------------------------------- flash glue


def test_flash_direct_layout_runs_on_storage_offsets(fake_flash: list) -> None:
    """Causal with padding after documents: one kernel call on the padded offsets, no gather."""
    batch = Batch([4, 3], pads=[2, 1])
    assert_parity(batch, "flash", True)
    assert fake_flash[0]["cu_q"] == batch.cu_padded.tolist()


def test_flash_gathers_when_padding_is_visible(fake_flash: list) -> None:
    batch = Batch([4, 3], pads=[2, 1])
    assert_parity(batch, "flash", False)
    assert fake_flash[0]["cu_q"] == batch.cu.tolist()


def test_flash_passes_dropout_and_window(fake_flash: list) -> None:
    batch = Batch([4, 3])
    pa.packed_attention(batch.q, batch.k, batch.v, softmax_scale=None, dropout_p=0.1,
                        window_size=(2, 5), implementation="flash", **batch.kwargs(True))  # fmt: skip
    assert fake_flash[0]["dropout_p"] == 0.1 and fake_flash[0]["window"] == (2, 0)


# --------------------------------------------------------------------------- selection and input


def test_auto_on_cpu_runs_sdpa_loop_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(pa.ENV_VAR, raising=False)
    batch = Batch([3, 2])
    pa.packed_attention(batch.q, batch.k, batch.v, softmax_scale=None, **batch.kwargs(True))
    assert pa.last_implementation() == "sdpa_loop"


def test_environment_selects(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(pa.ENV_VAR, "reference")
    batch = Batch([3, 2])
    pa.packed_attention(batch.q, batch.k, batch.v, softmax_scale=None, **batch.kwargs(True))
    assert pa.last_implementation() == "reference"
    monkeypatch.setenv(pa.ENV_VAR, "nonsense")
    with pytest.raises(ValueError, match="MEGATRON_ROCM_PACKED_ATTENTION"):
        pa.packed_attention(batch.q, batch.k, batch.v, softmax_scale=None, **batch.kwargs(True))


def test_explicit_flash_without_gpu_fails_loudly() -> None:
    batch = Batch([3, 2])
    with pytest.raises(
        RuntimeError, match="'flash' was requested but the tensors are not on a GPU"
    ):
        pa.packed_attention(batch.q, batch.k, batch.v, softmax_scale=None, implementation="flash",
                            **batch.kwargs(True))  # fmt: skip


@pytest.mark.parametrize("impl_name", ["flex", "reference"])
def test_dropout_where_unsupported_raises(impl_name: str) -> None:
    batch = Batch([3, 2])
    with pytest.raises(NotImplementedError, match="no dropout"):
        pa.packed_attention(batch.q, batch.k, batch.v, softmax_scale=None, dropout_p=0.1,
                            implementation=impl_name, **batch.kwargs(True))  # fmt: skip


def test_sdpa_loop_dropout_follows_the_rng() -> None:
    batch = Batch([6, 5], tail=3)
    kwargs = dict(softmax_scale=None, implementation="sdpa_loop", **batch.kwargs(False))

    def run(p: float) -> torch.Tensor:
        torch.manual_seed(3)
        return pa.packed_attention(batch.q, batch.k, batch.v, dropout_p=p, **kwargs)

    assert torch.equal(run(0.5), run(0.5))
    assert not torch.allclose(run(0.5), run(0.0))
    assert run(0.5)[11:].shape[0] == 3 and torch.all(run(0.5)[11:] == 0)


@pytest.mark.parametrize(
    "cu,padded,match",
    [
        ([0, 5, 3], None, "not decrease"),
        ([1, 5, 8], None, "start at 0"),
        ([0, 5, 8], [0, 4, 9], "cannot hold"),
        ([0, 5, 20], None, "cannot hold"),
    ],
)
def test_bad_offsets(cu: list[int], padded: list[int] | None, match: str) -> None:
    q = torch.randn(12, 2, 8)
    cu_t = torch.tensor(cu, dtype=torch.int32)
    pad_t = None if padded is None else torch.tensor(padded, dtype=torch.int32)
    with pytest.raises(ValueError, match=match):
        pa.packed_attention(q, q, q, cu_seqlens_q=cu_t, cu_seqlens_kv=cu_t, cu_seqlens_q_padded=pad_t,
                            cu_seqlens_kv_padded=pad_t, causal=True, softmax_scale=None)  # fmt: skip


def test_causal_needs_equal_lengths() -> None:
    batch = Batch([3, 5], kv_lens=[4, 4])
    with pytest.raises(ValueError, match="equal query and key lengths"):
        pa.packed_attention(batch.q, batch.k, batch.v, softmax_scale=None, **batch.kwargs(True))


def test_plan_is_shared_by_layers_and_renewed_on_change() -> None:
    batch = Batch([3, 4], pads=[1, 1])
    args = (batch.t, batch.t, batch.cu, batch.cu, batch.cu_padded, batch.cu_padded)
    first = packed_plan.build_plan(*args, causal=True, device=torch.device("cpu"))
    assert packed_plan.build_plan(*args, causal=True, device=torch.device("cpu")) is first
    batch.cu[2] -= 1  # in place: a new batch in the same tensor
    second = packed_plan.build_plan(*args, causal=True, device=torch.device("cpu"))
    assert second is not first and second.documents() == [(0, 3, 0, 3), (4, 3, 4, 3)]


# --------------------------------------------------------------------------- GPU


@pytest.fixture
def cuda() -> torch.device:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA/ROCm GPU")
    return torch.device("cuda")


def _to(batch: Batch, device: torch.device, dtype: torch.dtype) -> Batch:
    batch.q, batch.k, batch.v = (x.to(device, dtype) for x in (batch.q, batch.k, batch.v))
    batch.cu, batch.cu_kv = batch.cu.to(device), batch.cu_kv.to(device)
    batch.cu_padded = None if batch.cu_padded is None else batch.cu_padded.to(device)
    batch.real_q = batch.real_q.to(device)
    return batch


@pytest.mark.gpu
@pytest.mark.parametrize("impl_name", ["flash", "flex", "sdpa_loop"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("pads", [None, [3, 0, 5, 1]])
def test_gpu_parity(
    cuda: torch.device, impl_name: str, causal: bool, pads: list[int] | None
) -> None:
    batch = _to(
        Batch([300, 1, 129, 64], pads=pads, tail=7, heads=8, groups=2, dim=64), cuda, torch.bfloat16
    )
    assert_parity(batch, impl_name, causal)


@pytest.mark.gpu
@pytest.mark.parametrize("impl_name", ["flash", "flex"])
def test_gpu_window(cuda: torch.device, impl_name: str) -> None:
    batch = _to(Batch([300, 1, 129], heads=4, groups=2, dim=64), cuda, torch.bfloat16)
    assert_parity(batch, impl_name, True, window=(100, 0))


@pytest.mark.gpu
def test_gpu_auto_takes_flash(cuda: torch.device, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(pa.ENV_VAR, raising=False)
    batch = _to(Batch([64, 32], heads=4, groups=2, dim=64), cuda, torch.bfloat16)
    pa.packed_attention(batch.q, batch.k, batch.v, softmax_scale=None, **batch.kwargs(True))
    assert pa.last_implementation() == "flash"


@pytest.mark.gpu
def test_gpu_flash_dropout_follows_the_rng(cuda: torch.device) -> None:
    batch = _to(Batch([256, 128], heads=4, groups=2, dim=64), cuda, torch.bfloat16)

    def run(p: float) -> torch.Tensor:
        torch.cuda.manual_seed(3)
        return pa.packed_attention(batch.q, batch.k, batch.v, softmax_scale=None, dropout_p=p,
                                   implementation="flash", **batch.kwargs(True))  # fmt: skip

    assert torch.equal(run(0.3), run(0.3))
    assert not torch.allclose(run(0.3), run(0.0))


# --------------------------------------------------------------------------- --reset-attention-mask


def _reset_mask(eods: list[list[int]], s: int) -> torch.Tensor:
    """Upstream's dataset mask, written out: causal, then mask earlier documents after each EOD."""
    masks = []
    for positions in eods:
        keep = torch.ones(s, s).tril()
        for i in positions:
            keep[i + 1 :, : i + 1] = 0
        masks.append(keep < 0.5)
    return torch.stack(masks).unsqueeze(1)


def test_reset_attention_mask_becomes_documents() -> None:
    mask = _reset_mask([[2, 3, 8], [5]], 11)
    docs = document_mask.documents_from_causal_mask(mask, 2)
    assert docs.cu_seqlens.tolist() == [0, 3, 4, 9, 11, 17, 22]
    assert docs.max_seqlen == 6 and not docs.plain_causal


def test_block_causal_attention_matches_the_dense_mask_math(impl: str) -> None:
    """Against the local spec's unfused path, which applies the dense mask."""
    s, b, heads, groups, dim = 11, 2, 4, 2, 8
    mask = _reset_mask([[0, 3, 8], [5]], s)
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(s, b, h, dim, generator=gen) for h in (heads, groups, groups))
    leaves = [x.clone().requires_grad_(impl != "flex") for x in (q, k, v)]
    refs = [x.clone().requires_grad_() for x in (q, k, v)]
    docs = document_mask.documents_from_causal_mask(mask, b)
    out = document_mask.block_causal_attention(
        *leaves, docs, softmax_scale=None, implementation=impl
    )
    exp = attention_reference(*refs, mask, "arbitrary")
    assert out.shape == (s, b, heads * dim)
    torch.testing.assert_close(out, exp.detach(), atol=2e-5, rtol=2e-5)
    if impl == "flex":
        return
    grad = torch.randn(out.shape, generator=gen)
    out.backward(grad)
    exp.backward(grad)
    for ours, theirs in zip(leaves, refs):
        torch.testing.assert_close(ours.grad, theirs.grad, atol=1e-4, rtol=1e-4)


def test_plain_causal_and_shared_masks() -> None:
    docs = document_mask.documents_from_causal_mask(_reset_mask([[]], 6), 3)
    assert docs.plain_causal and docs.cu_seqlens.tolist() == [0, 6, 12, 18]
    shared = document_mask.documents_from_causal_mask(_reset_mask([[1]], 4), 2)
    assert shared.cu_seqlens.tolist() == [0, 2, 4, 6, 8]


def test_other_masks_are_not_documents() -> None:
    s = 6
    padding = torch.zeros(2, 1, s, s, dtype=torch.bool)
    padding[..., 4:] = True  # key padding
    holes = _reset_mask([[]], s)
    holes[0, 0, 4, 1] = True  # a hole inside a document
    skewed = _reset_mask([[2]], s)
    skewed[0, 0, 4, 3] = True  # row 4 starts a "document" at 4 while row 3 is in one from 3
    for mask in (padding, holes, skewed, torch.zeros(1, 1, s, s, dtype=torch.bool)):
        assert document_mask.documents_from_causal_mask(mask, 2 if mask is padding else 1) is None


def test_mask_is_read_once_per_tensor() -> None:
    mask = _reset_mask([[1]], 5)
    first = document_mask.documents_from_causal_mask(mask, 1)
    assert document_mask.documents_from_causal_mask(mask, 1) is first
    mask[0, 0, 3, 0] = False  # in place: document boundary moves
    mask[0, 0, 3, 1] = False
    assert document_mask.documents_from_causal_mask(mask, 1) is None


def test_the_default_causal_mask_is_read_once_for_all_layers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each read of the mask syncs with the GPU: one per batch, not one per layer."""
    from megatron_rocm.runtime.backend.dot_product_attention import TEDotProductAttention

    reads = []
    real = document_mask._documents
    monkeypatch.setattr(document_mask, "_documents", lambda *a: reads.append(1) or real(*a))
    s, b = 6, 2
    mask = _reset_mask([[]], s)  # the default loader's plain causal mask
    q = torch.zeros(s, b, 4, 8)
    for _layer in range(24):
        assert TEDotProductAttention._documents(q, q, mask, "causal", None) is None
    assert len(reads) == 1
    reset = _reset_mask([[2]], s)
    for _layer in range(24):
        docs = TEDotProductAttention._documents(q, q, reset, "causal", None)
        assert docs.cu_seqlens.tolist() == [0, 3, 6, 9, 12]
    assert len(reads) == 2


# ------------------------------------------------------------------ inside a CUDA-graph capture


def test_a_mask_inside_a_capture_is_judged_by_the_eager_warm_up(monkeypatch) -> None:  # noqa: ANN001
    """A capture cannot read the mask: the masks of its shape read eagerly before (Megatron's
    warm-up iterations) decide, and documents, or no such read, are one line."""
    monkeypatch.setattr(document_mask, "_documents_met", {})
    plain, documents = _reset_mask([[]], 6), _reset_mask([[2]], 6)
    with pytest.raises(ValueError, match="no mask of its shape was read before the capture"):
        document_mask.ignorable_when_captured(plain, 2)
    document_mask.documents_from_causal_mask(plain, 2)
    assert document_mask.ignorable_when_captured(plain.clone(), 2)
    document_mask.documents_from_causal_mask(documents, 2)
    with pytest.raises(ValueError) as failure:
        document_mask.ignorable_when_captured(plain.clone(), 2)
    assert str(failure.value) == (
        "TEDotProductAttention: a causal attention mask cannot be read inside a CUDA graph "
        "(--cuda-graph-impl): its documents (--reset-attention-mask data) change with every "
        "batch; pass --no-create-attention-mask-in-dataloader for plain causal data, or leave "
        "CUDA graphs off"
    )


def test_the_attention_does_not_read_a_plain_mask_inside_a_capture(monkeypatch) -> None:  # noqa: ANN001
    from megatron_rocm.runtime.backend import dot_product_attention as attention

    monkeypatch.setattr(document_mask, "_documents_met", {})
    s, b = 6, 2
    q = k = torch.zeros(s, b, 2, 4)
    mask = _reset_mask([[]], s)
    document_mask.documents_from_causal_mask(mask, b)  # the eager warm-up
    monkeypatch.setattr(attention, "capturing", lambda device: True)

    def read(*args: object) -> None:
        raise AssertionError("the mask was read inside a capture")

    monkeypatch.setattr(document_mask, "documents_from_causal_mask", read)
    documents = attention.TEDotProductAttention._documents(q, k, mask.clone(), "causal", None)
    assert documents is None


def test_packed_sequences_inside_a_capture_are_one_line(monkeypatch) -> None:  # noqa: ANN001
    from types import SimpleNamespace

    from megatron_rocm.runtime.backend import dot_product_attention as attention

    monkeypatch.setattr(attention, "capturing", lambda device: True)
    q = torch.zeros(6, 1, 2, 4)
    with pytest.raises(ValueError) as failure:
        attention.TEDotProductAttention._packed(
            SimpleNamespace(cp_size=1), q, q, q, "causal", None, SimpleNamespace()
        )
    assert str(failure.value) == (
        "TEDotProductAttention: packed (THD) sequences read their cu_seqlens on the host, which "
        "a CUDA graph cannot (--cuda-graph-impl); leave CUDA graphs off for packed data"
    )
