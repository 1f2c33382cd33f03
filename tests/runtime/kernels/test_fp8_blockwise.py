"""FP8 block scaling (``--fp8-recipe blockwise``): the casts, the block-scaled GEMM and the
linear's three GEMMs.

The oracle is written here from TE's rules in float64 Python, one block at a time: the amax of
each 1 x 128 run (or 128 x 128 tile) without NaNs, the scale ``fp8_max / amax`` in fp32 rounded
down to a power of two by ``math.frexp`` (1 for a zero block or one with an inf), the value
clamped and cast by torch. The GEMMs are checked against float64 products of the oracle's
dequantized operands. ``triton`` cases run the kernels (a GPU, or the interpreter in a child
pytest); the others torch's path; ``gpu`` cases also cuBLASLt's block-scaled GEMM.
"""

from __future__ import annotations

import math

import pytest
import torch
from triton_interpreter import TRITON_DEVICE, triton_test

from megatron_rocm.runtime.backend import fp8 as backend_fp8
from megatron_rocm.runtime.kernels import fp8_blockwise as bw

TRITON_SKIPS_ALLOWED = False
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FORMATS = [E4M3, E5M2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz]


@pytest.fixture(autouse=True)
def fresh_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts with no GEMM path failed or checked (module-wide state)."""
    monkeypatch.setattr(bw, "_failed", set())
    monkeypatch.setattr(bw, "_checked", set())


def oracle_scale(amax: float, dtype: torch.dtype) -> float:
    if amax == 0 or math.isinf(amax):
        return 1.0
    fp8_max = torch.finfo(dtype).max
    quotient = (torch.tensor(fp8_max) / torch.tensor(amax, dtype=torch.float32)).item()
    quotient = min(quotient, torch.finfo(torch.float32).max)
    return 2.0 ** (math.frexp(quotient)[1] - 1)


def oracle_blocks(x: torch.Tensor, dtype: torch.dtype, tiles: bool) -> tuple:
    """(FP8 tensor, inverse scales) of a 2-D ``x``, block by block in float64."""
    rows, cols = x.shape
    fp8_max = torch.finfo(dtype).max
    xd = x.double()
    out = torch.empty(rows, cols, dtype=torch.float64)
    br = -(-rows // 128) if tiles else rows
    inv = torch.empty(br, -(-cols // 128), dtype=torch.float64)
    for i in range(br):
        r = slice(i * 128, (i + 1) * 128) if tiles else slice(i, i + 1)
        for j in range(inv.shape[1]):
            c = slice(j * 128, (j + 1) * 128)
            block = xd[r, c]
            finite = block[~torch.isnan(block)]
            amax = float(finite.abs().max()) if finite.numel() else 0.0
            s = oracle_scale(amax, dtype)
            out[r, c] = (block * s).clamp(-fp8_max, fp8_max)
            inv[i, j] = 1.0 / s
    return out.float().to(dtype), inv


def oracle_dequantize(data: torch.Tensor, inv: torch.Tensor, tiles: bool) -> torch.Tensor:
    rows, cols = data.shape
    r = torch.arange(rows) // 128 if tiles else torch.arange(rows)
    c = torch.arange(cols) // 128
    return data.double() * inv.double()[r[:, None], c[None, :]]


def _data(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Values over twelve decades (so blocks scale differently), a zero block, NaN and inf."""
    g = torch.Generator().manual_seed(seed)
    x = (
        torch.randn(rows, cols, generator=g)
        * torch.logspace(-6, 6, cols)[torch.randperm(cols, generator=g)]
    )
    x[: min(rows, 3), :128] = 0.0
    if rows > 6 and cols > 256:
        x[4, 130], x[5, 140] = float("nan"), float("inf")
        x[6, 256:] = 1e-38  # a subnormal block: its scale 2^127, the inverse 2^-127 subnormal
    return x


def _same_bytes(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got.view(torch.uint8).cpu(), want.view(torch.uint8).cpu())


@pytest.mark.parametrize("amax", [0.0, 1e-45, 1e-30, 3.0, 448.0, 449.0, 1e30, 3e38, float("inf")])
@pytest.mark.parametrize("dtype", FORMATS)
def test_scales_are_tes_power_of_two(amax, dtype) -> None:
    got = bw.scales_of(torch.tensor([amax], dtype=torch.float32), torch.finfo(dtype).max)
    assert got.item() == oracle_scale(float(torch.tensor(amax, dtype=torch.float32)), dtype)


def _check_cast(x: torch.Tensor, dtype: torch.dtype) -> None:
    rows_want = oracle_blocks(x, dtype, tiles=False)
    cols_want = oracle_blocks(x.t(), dtype, tiles=False)
    tiles_want = oracle_blocks(x, dtype, tiles=True)
    direct, turned = bw.quantize_rows(x, dtype, transposed=True)
    _same_bytes(direct.data, rows_want[0])
    assert torch.equal(direct.inv.double().cpu(), rows_want[1])
    width = bw.padded_tokens(x.shape[0])
    assert turned.data.shape == (x.shape[1], width)
    _same_bytes(turned.data[:, : x.shape[0]].contiguous(), cols_want[0])
    assert not turned.data[:, x.shape[0] :].view(torch.uint8).any()  # the zero padding
    assert torch.equal(turned.inv.double().cpu(), cols_want[1])
    tiles, tiles_t = bw.quantize_tiles(x, dtype, transposed=True)
    _same_bytes(tiles.data, tiles_want[0])
    assert torch.equal(tiles.inv.double().cpu(), tiles_want[1])
    _same_bytes(tiles_t.data[:, : x.shape[0]].contiguous(), tiles_want[0].t().contiguous())
    assert torch.equal(tiles_t.inv.double().cpu(), tiles_want[1].t())


@pytest.mark.parametrize("dtype", FORMATS)
def test_torch_casts_match_the_oracle(monkeypatch, dtype) -> None:
    monkeypatch.setattr(bw, "_triton_takes", lambda x: False)
    _check_cast(_data(200, 300), dtype)


@triton_test
@pytest.mark.parametrize("dtype", FORMATS)
def test_triton_casts_match_the_oracle(monkeypatch, dtype) -> None:
    calls = []
    from megatron_rocm.runtime.kernels import fp8_blockwise_triton as kernels

    real = kernels.cast_blocks
    monkeypatch.setattr(kernels, "cast_blocks", lambda *a: calls.append(a[2:]) or real(*a))
    _check_cast(_data(200, 300).to(TRITON_DEVICE), dtype)
    assert len(calls) == 2  # the rows with their transpose, the tiles with theirs: all Triton


def _operands(m: int, n: int, k: int, device: str) -> tuple:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(m, k, generator=g) * torch.logspace(-2, 2, k)
    # every weight tile its own scale, along the rows and along the columns
    w = (
        torch.randn(n, k, generator=g)
        * torch.logspace(-3, -1, n)[:, None]
        * torch.logspace(0, 2, k)
    )
    return x.to(device), w.to(device)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Within fp32 rounding on the CPU; on a GPU within its FP8 accumulation (about 2e-4 of
    the largest value on an H200), far below a wrong scale's error (a factor of 2 or more)."""
    bound = (1e-5 if got.device.type == "cpu" else 1e-3) * float(want.abs().max())
    torch.testing.assert_close(got.double().cpu(), want, rtol=0, atol=bound)


def _gemm_cases(device: str, m: int = 200, n: int = 256, k: int = 384) -> None:
    x, w = _operands(m, n, k, device)
    a, _ = bw.quantize_rows(x, E4M3, transposed=False)
    b, b_t = bw.quantize_tiles(w, E4M3, transposed=True)
    want = (
        oracle_dequantize(*oracle_blocks(x.cpu(), E4M3, False), False)
        @ oracle_dequantize(*oracle_blocks(w.cpu(), E4M3, True), True).t()
    )
    _close(bw.block_mm(a, b, True, torch.float32), want)
    # the weight gradient's GEMM: both operands in 1 x 128 blocks over the tokens, added into C
    dy = torch.randn(m, n, device=device)
    dy_t = bw.quantize_transposed_rows(dy, E5M2)
    x_t = bw.quantize_transposed_rows(x, E4M3)
    want_w = oracle_dequantize(*oracle_blocks(dy.t().cpu(), E5M2, False), False) @ (
        oracle_dequantize(*oracle_blocks(x.t().cpu(), E4M3, False), False).t()
    )
    c = torch.full((n, k), 1.0, device=device)
    assert bw.block_mm(dy_t, x_t, False, torch.float32, add_into=c) is None
    _close(c - 1.0, want_w)
    # the input gradient's GEMM reads the weight's tiles transposed
    dy_rows, _ = bw.quantize_rows(dy, E5M2, transposed=False)
    want_d = oracle_dequantize(*oracle_blocks(dy.cpu(), E5M2, False), False) @ oracle_dequantize(
        *oracle_blocks(w.cpu(), E4M3, True), True
    )
    _close(bw.block_mm(dy_rows, b_t, True, torch.float32), want_d)


def test_emulated_gemms_match_float64() -> None:
    assert bw.gemm_path(torch.empty(1)) == "emulated"
    _gemm_cases("cpu")


@triton_test
@pytest.mark.parametrize("hip", [False, True], ids=["cuda-tiles", "rocm-tiles"])
def test_triton_gemms_match_float64(monkeypatch, hip: bool) -> None:
    monkeypatch.setattr(bw, "gemm_path", lambda a, problem=None: "triton")
    ran = []
    from megatron_rocm.runtime.kernels import fp8_blockwise_triton as kernels

    monkeypatch.setattr(kernels, "is_hip", lambda: hip)  # the launch's tile and stages
    real = kernels.block_mm
    monkeypatch.setattr(kernels, "block_mm", lambda *a: ran.append(a[4]) or real(*a))
    _gemm_cases(TRITON_DEVICE)
    # K past a multiple of 128 (masked loads), M and N past the GEMM's tiles (wrapped loads)
    _gemm_cases(TRITON_DEVICE, 70, 200, 300)
    _gemm_cases(TRITON_DEVICE, 70, 200, 256)  # unmasked K, wrapped M and N
    assert ran == [True, False, True] * 3 and not bw._failed


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or bool(torch.version.hip), reason="cuBLASLt")
def test_cublaslt_gemms_match_float64(monkeypatch) -> None:
    """Sizes cuBLASLt takes (every contraction a multiple of 512): all three GEMMs on it."""
    served = []
    real = bw._scaled_mm
    monkeypatch.setattr(bw, "_scaled_mm", lambda *a: served.append(a[2]) or real(*a))
    _gemm_cases("cuda", 512, 512, 1024)
    assert served == [True, False, True] and not bw._failed  # nothing fell back


def test_cublaslt_takes_tiles_only_over_multiples_of_four_blocks() -> None:
    bf16 = torch.bfloat16
    assert bw.cublaslt_takes((4096, 6144, True, E4M3, E4M3, bf16, True))
    assert bw.cublaslt_takes((1536, 11008, True, E4M3, E4M3, bf16, True))
    for k in (384, 5504, 11008):  # 3, 43 and 86 blocks: wrong products on an H200
        assert not bw.cublaslt_takes((k, 1536, True, E4M3, E4M3, bf16, True))
    assert bw.cublaslt_takes((200, 1536, False, E5M2, E4M3, torch.float32, True))
    assert not bw.cublaslt_takes((4096, 6144, True, E4M3, E4M3, bf16, False))  # M % 4 != 0


def test_a_wrong_cublaslt_product_is_caught_and_its_problem_avoided(monkeypatch) -> None:
    """The first product of each problem is checked against the next path: a kernel that
    computes garbage is used once, for that check, never delivered."""
    monkeypatch.setattr(bw, "_failed", set())
    monkeypatch.setattr(bw, "_checked", set())
    monkeypatch.setattr(bw, "gemm_path", lambda a, problem=None: (
        "emulated" if problem in bw._failed else "scaled_mm"))  # fmt: skip
    calls = []

    def garbage(a, b, tiles, dtype):  # noqa: ANN001, ANN202
        calls.append(tiles)
        return torch.zeros(a.data.shape[0], b.data.shape[0], dtype=dtype)

    monkeypatch.setattr(bw, "_scaled_mm", garbage)
    x, w = _operands(64, 128, 512, "cpu")
    a, _ = bw.quantize_rows(x, E4M3, transposed=False)
    b, _ = bw.quantize_tiles(w, E4M3, transposed=False)
    want = bw._emulated(a, b, True)
    for _ in range(2):
        torch.testing.assert_close(bw.block_mm(a, b, True, torch.float32), want)
    assert calls == [True]  # the second call went straight to the next path
    assert (512, 128, True, E4M3, E4M3, torch.float32, True) in bw._failed


def _fake_cublaslt(monkeypatch, product) -> list:  # noqa: ANN001
    """cuBLASLt replaced by ``product(a, b, tiles, dtype)``, the next path the emulation."""
    monkeypatch.setattr(bw, "_failed", set())
    monkeypatch.setattr(bw, "_checked", set())
    monkeypatch.setattr(bw, "gemm_path", lambda a, problem=None: (
        "emulated" if problem in bw._failed else "scaled_mm"))  # fmt: skip
    calls = []
    monkeypatch.setattr(bw, "_scaled_mm", lambda *a: calls.append(a[2]) or product(*a))
    return calls


def test_a_checked_weight_gradient_problem_adds_in_the_gemm(monkeypatch) -> None:
    """Once a 1 x 128 by 1 x 128 problem's first product passed its check, the GEMM adds into
    ``main_grad`` itself (``fp8_accumulate.accumulate``, here emulated from the layout it
    documents: inverse scales [ceil(K/128), rows]); the first call adds separately."""
    _fake_cublaslt(monkeypatch, lambda a, b, tiles, dtype: bw._emulated(a, b, tiles).to(dtype))
    added = []

    def gemm_with_beta(into, a, a_inv, b, b_inv, blocks):  # noqa: ANN001, ANN202
        assert blocks and a_inv.is_contiguous() and b_inv.is_contiguous()
        rows = a_inv.repeat_interleave(128, 0)[: a.shape[1]]  # [K, M]
        cols = b_inv.repeat_interleave(128, 0)[: b.shape[0]]  # [K, N]
        into.add_((a.float() * rows.t()) @ (b.float() * cols))
        added.append(into.shape)
        return True

    monkeypatch.setattr(bw, "accumulate", gemm_with_beta)
    dy_t = bw.quantize_transposed_rows(torch.randn(200, 64) * torch.logspace(-3, 3, 64), E5M2)
    x_t = bw.quantize_transposed_rows(torch.randn(200, 96) * torch.logspace(3, -3, 96), E4M3)
    want = (
        2
        * oracle_dequantize(dy_t.data, dy_t.inv, False)
        @ (oracle_dequantize(x_t.data, x_t.inv, False).t())
    )
    main_grad = torch.zeros(64, 96)
    for _ in range(2):
        assert bw.block_mm(dy_t, x_t, False, torch.bfloat16, add_into=main_grad) is None
    assert added == [(64, 96)]  # the first call checked the product and added it separately
    torch.testing.assert_close(main_grad.double(), want, rtol=0, atol=1e-5 * want.abs().max())


def test_tile_scaled_problems_never_add_in_the_gemm(monkeypatch) -> None:
    _fake_cublaslt(monkeypatch, lambda a, b, tiles, dtype: bw._emulated(a, b, tiles).to(dtype))
    monkeypatch.setattr(bw, "accumulate", lambda *a, **k: pytest.fail("accumulate called"))
    x, w = _operands(64, 128, 512, "cpu")
    a, _ = bw.quantize_rows(x, E4M3, transposed=False)
    b, _ = bw.quantize_tiles(w, E4M3, transposed=False)
    into = torch.zeros(64, 128)
    for _ in range(2):
        bw.block_mm(a, b, True, torch.float32, add_into=into)
    torch.testing.assert_close(into, 2 * bw._emulated(a, b, True))


def test_a_scale_wrong_on_small_rows_only_is_caught(monkeypatch) -> None:
    """The check holds each row to its own largest value: doubling the rows that are 1,000
    times smaller than the rest still fails it."""
    _fake_cublaslt(monkeypatch, lambda a, b, t, d: bw._emulated(a, b, t) * torch.where(
        torch.arange(a.data.shape[0])[:, None] >= 32, 2.0, 1.0))  # fmt: skip
    x, w = _operands(64, 128, 512, "cpu")
    x[32:] *= 1e-3
    a, _ = bw.quantize_rows(x, E4M3, transposed=False)
    b, _ = bw.quantize_tiles(w, E4M3, transposed=False)
    torch.testing.assert_close(bw.block_mm(a, b, True, torch.float32), bw._emulated(a, b, True))
    assert len(bw._failed) == 1 and not bw._checked


@pytest.mark.parametrize("bad", ["zeros", "nan", "no tokens"])
def test_a_first_product_that_cannot_be_judged_is_not_trusted(monkeypatch, bad) -> None:
    """Zeros only (a zero tolerance), NaN (comparisons false) or nothing at all in the reference
    prove nothing: the reference is delivered and the next call checks again."""
    calls = _fake_cublaslt(monkeypatch, lambda a, b, t, d: torch.full(
        (a.data.shape[0], b.data.shape[0]), 5.0))  # fmt: skip
    x, w = _operands(64, 128, 512, "cpu")
    if bad == "zeros":
        x.zero_()
    elif bad == "nan":
        x[0] = float("nan")
    else:
        x = x[:0]
    a, _ = bw.quantize_rows(x, E4M3, transposed=False)
    b, _ = bw.quantize_tiles(w, E4M3, transposed=False)
    got = bw.block_mm(a, b, True, torch.float32)
    torch.testing.assert_close(got, bw._emulated(a, b, True), equal_nan=True)
    assert not bw._checked and not bw._failed
    bw.block_mm(a, b, True, torch.float32)
    assert calls == [True, True]  # checked again


def test_an_unchecked_problem_skips_cublaslt_while_a_graph_is_captured(monkeypatch) -> None:
    """The first-use check reads its verdict on the host, which a CUDA graph capture cannot:
    an unchecked problem takes the next path there, and is checked later, outside."""
    calls = _fake_cublaslt(monkeypatch, lambda a, b, t, d: bw._emulated(a, b, t))
    monkeypatch.setattr(bw, "capturing", lambda t: True)
    x, w = _operands(64, 128, 512, "cpu")
    a, _ = bw.quantize_rows(x, E4M3, transposed=False)
    b, _ = bw.quantize_tiles(w, E4M3, transposed=False)
    torch.testing.assert_close(bw.block_mm(a, b, True, torch.float32), bw._emulated(a, b, True))
    assert calls == [] and not bw._checked
    monkeypatch.setattr(bw, "capturing", lambda t: False)
    bw.block_mm(a, b, True, torch.float32)
    assert calls == [True] and len(bw._checked) == 1


@pytest.mark.parametrize("row_zero", [0.0, 1e-3])
def test_rows_of_zeros_are_judged_exactly(monkeypatch, row_zero) -> None:
    """Padded tokens give rows of zeros: the other rows still judge the product, and a zero row
    must come out zero."""

    def product(a, b, t, d):  # noqa: ANN001, ANN202
        out = bw._emulated(a, b, t)
        out[0] = row_zero
        return out

    _fake_cublaslt(monkeypatch, product)
    x, w = _operands(64, 128, 512, "cpu")
    x[0] = 0.0
    a, _ = bw.quantize_rows(x, E4M3, transposed=False)
    b, _ = bw.quantize_tiles(w, E4M3, transposed=False)
    torch.testing.assert_close(bw.block_mm(a, b, True, torch.float32), bw._emulated(a, b, True))
    assert (len(bw._checked), len(bw._failed)) == ((1, 0) if row_zero == 0 else (0, 1))


@triton_test
def test_a_failing_triton_kernel_falls_back_to_the_emulation(monkeypatch) -> None:
    from megatron_rocm.runtime.kernels import fp8_blockwise_triton as kernels

    monkeypatch.setattr(bw, "_failed", set())

    def broken(*args):  # noqa: ANN002, ANN202
        raise RuntimeError("no kernel")

    monkeypatch.setattr(kernels, "block_mm", broken)
    x, w = _operands(64, 128, 256, TRITON_DEVICE)
    a, _ = bw.quantize_rows(x, E4M3, transposed=False)
    b, _ = bw.quantize_tiles(w, E4M3, transposed=False)
    got = bw.block_mm(a, b, True, torch.float32)
    torch.testing.assert_close(got, bw._emulated(a, b, True))
    assert "triton" in bw._failed


def test_rocm_takes_the_triton_gemm(monkeypatch) -> None:
    """hipBLASLt has no block-scaled GEMM: a ROCm GPU's tensors go to the Triton kernel, and
    the reference switch to the emulation."""
    from types import SimpleNamespace

    monkeypatch.setattr(torch.version, "hip", "6.4", raising=False)
    on_gpu = SimpleNamespace(device=torch.device("cuda", 0), is_cuda=True)
    monkeypatch.setattr("megatron_rocm.runtime.kernels.launch.triton_available", lambda: True)
    assert bw.gemm_path(on_gpu) == "triton"
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    assert bw.gemm_path(on_gpu) == "scaled_mm"
    monkeypatch.setenv("MEGATRON_ROCM_KERNELS", "reference:fp8_blockwise")
    assert bw.gemm_path(on_gpu) == "emulated"


def _recipe(fmt: str = "hybrid") -> backend_fp8.Fp8Recipe:
    from types import SimpleNamespace

    config = SimpleNamespace(fp8=fmt, fp8_recipe="blockwise", num_layers=1, fp8_margin=0,
                             fp8_wgrad=True, first_last_layers_bf16=False)  # fmt: skip
    recipe = backend_fp8.module_recipe("TELinear", config, torch.empty(256, 384))
    assert recipe.blockwise and recipe.delayed is None
    return recipe


def _linear_case(device: str) -> None:
    x, w = _operands(200, 256, 384, device)
    x = x.view(40, 5, 384).requires_grad_()
    w = w.clone().requires_grad_()
    w.main_grad = torch.full((256, 384), 2.0, device=device)
    w.grad_added_to_main_grad = False
    dy = torch.randn(40, 5, 256, device=device)
    out = backend_fp8.fp8_linear(x, w, True, _recipe())
    out.backward(dy)
    xs, dys = x.detach().reshape(200, 384).cpu(), dy.reshape(200, 256).cpu()
    wq = oracle_dequantize(*oracle_blocks(w.detach().cpu(), E4M3, True), True)
    want = oracle_dequantize(*oracle_blocks(xs, E4M3, False), False) @ wq.t()
    want_dx = oracle_dequantize(*oracle_blocks(dys, E5M2, False), False) @ wq
    want_dw = oracle_dequantize(*oracle_blocks(dys.t(), E5M2, False), False) @ (
        oracle_dequantize(*oracle_blocks(xs.t(), E4M3, False), False).t()
    )
    for got, ref in ((out.reshape(200, 256), want), (x.grad.reshape(200, 384), want_dx),
                     (w.main_grad - 2.0, want_dw)):  # fmt: skip
        _close(got, ref)
    assert w.grad_added_to_main_grad is True


def test_the_linear_runs_three_block_scaled_gemms() -> None:
    _linear_case("cpu")


def _count_triton_gemms(monkeypatch) -> list:  # noqa: ANN001
    from megatron_rocm.runtime.kernels import fp8_blockwise_triton as kernels

    ran, real = [], kernels.block_mm
    monkeypatch.setattr(kernels, "block_mm", lambda *a: ran.append(a[4]) or real(*a))
    return ran


@triton_test
def test_the_linear_on_the_triton_kernels(monkeypatch) -> None:
    monkeypatch.setattr(bw, "gemm_path", lambda a, problem=None: "triton")
    ran = _count_triton_gemms(monkeypatch)
    _linear_case(TRITON_DEVICE)
    assert ran == [True, True, False] and "triton" not in bw._failed


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_the_linear_on_the_gpus_gemm(monkeypatch) -> None:
    """Its forward and input gradient contract over 384 and 256 (3 and 2 tile-scaled blocks,
    which cuBLASLt gets wrong): Triton; the weight gradient's 1 x 128 blocks: cuBLASLt."""
    from megatron_rocm.runtime.kernels import fp8_blockwise_triton as kernels

    served = []
    real_lt, real_triton = bw._scaled_mm, kernels.block_mm
    monkeypatch.setattr(bw, "_scaled_mm", lambda *a: served.append("lt") or real_lt(*a))
    monkeypatch.setattr(kernels, "block_mm", lambda *a: served.append("triton") or real_triton(*a))
    _linear_case("cuda")
    assert served[0] == "triton" and served.count("lt") == 1 and "triton" not in bw._failed


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or bool(torch.version.hip), reason="cuBLASLt")
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_the_gpus_gemm_adds_the_weight_gradient_into_main_grad(monkeypatch, grad_dtype) -> None:
    """Three steps: the first weight gradient is checked and added apart, the next two added by
    cuBLASLt's GEMM; ``main_grad`` as the separate add leaves it (same operands, only the
    kernel differs)."""

    def run(separate: bool) -> torch.Tensor:
        if separate:
            monkeypatch.setenv("MEGATRON_ROCM_KERNELS", "reference:fp8_accumulate")
        else:
            monkeypatch.delenv("MEGATRON_ROCM_KERNELS", raising=False)
        monkeypatch.setattr(bw, "_checked", set())
        calls, real = [], bw.accumulate
        monkeypatch.setattr(
            bw, "accumulate", lambda *a, **k: calls.append(real(*a, **k)) or calls[-1]
        )
        torch.manual_seed(3)
        w = torch.nn.Parameter(torch.randn(256, 512, device="cuda", dtype=torch.bfloat16) * 0.05)
        w.main_grad = torch.zeros(256, 512, device="cuda", dtype=grad_dtype)
        recipe = _recipe()
        for _ in range(3):
            x = torch.randn(1000, 512, device="cuda", dtype=torch.bfloat16)
            y = backend_fp8.fp8_linear(x, w, True, recipe)
            y.backward(torch.randn_like(y))
        assert calls == [not separate] * 2 and not bw._failed
        return w.main_grad.clone()

    fused, separate = run(False), run(True)
    err = (fused.float() - separate.float()).abs().max().item()
    assert err <= (1e-5 if grad_dtype == torch.float32 else 1e-2) * separate.abs().max().item()


def _run_linear(x, w, fuse, recipe, reuse=None):  # noqa: ANN001, ANN202
    return backend_fp8.fp8_linear(x, w, fuse, recipe, reuse)


@pytest.mark.parametrize("case", ["unfused", "no_fp8_wgrad", "frozen_input", "cached"])
def test_the_linears_other_paths(case) -> None:
    """Without fusion the gradient comes back in the weight's dtype; --no-fp8-wgrad computes it
    in fp32 from the input; an input without gradient gets none; a weight quantized without its
    transpose (a no-grad forward) is quantized again when a backward needs it."""
    x, w = _operands(200, 256, 384, "cpu")
    w.requires_grad_()
    recipe = _recipe()
    if case == "no_fp8_wgrad":
        recipe = backend_fp8.Fp8Recipe(formats=recipe.formats, wgrad_in_fp8=False, blockwise=True)
    if case == "cached":
        with torch.no_grad():
            _run_linear(x, w, False, recipe, reuse=False)
        assert recipe.weight_cache.quantized[1] is None
    xg = x.clone().requires_grad_(case != "frozen_input")
    dy = torch.randn(200, 256)
    _run_linear(xg, w, False, recipe, reuse=True if case == "cached" else None).backward(dy)
    wq = oracle_dequantize(*oracle_blocks(w.detach(), E4M3, True), True)
    if case == "no_fp8_wgrad":
        want_dw = dy.double().t() @ x.double()
        torch.testing.assert_close(
            w.grad.double(), want_dw, rtol=0, atol=1e-4 * want_dw.abs().max()
        )
    else:
        want_dw = oracle_dequantize(*oracle_blocks(dy.t(), E5M2, False), False) @ (
            oracle_dequantize(*oracle_blocks(x.t(), E4M3, False), False).t()
        )
        _close(w.grad, want_dw)
    assert w.grad.dtype == w.dtype
    if case == "frozen_input":
        assert xg.grad is None
    else:
        _close(xg.grad, oracle_dequantize(*oracle_blocks(dy, E5M2, False), False) @ wq)
    if case == "cached":
        assert recipe.weight_cache.quantized[1] is not None


@triton_test
def test_a_bf16_main_grad_is_added_into_by_the_triton_gemm(monkeypatch) -> None:
    monkeypatch.setattr(bw, "gemm_path", lambda a, problem=None: "triton")
    ran = _count_triton_gemms(monkeypatch)
    x, w = _operands(200, 256, 384, TRITON_DEVICE)
    w = w.to(torch.bfloat16).requires_grad_()
    w.main_grad = torch.full((256, 384), 2.0, dtype=torch.bfloat16, device=TRITON_DEVICE)
    w.grad_added_to_main_grad = False
    dy = torch.randn(200, 256, device=TRITON_DEVICE)
    backend_fp8.fp8_linear(x.to(torch.bfloat16), w, True, _recipe()).backward(dy.to(torch.bfloat16))
    dyb, xb = dy.to(torch.bfloat16).float().cpu(), x.to(torch.bfloat16).float().cpu()
    dq = oracle_dequantize(*oracle_blocks(dyb.t(), E5M2, False), False)
    xq = oracle_dequantize(*oracle_blocks(xb.t(), E4M3, False), False)
    want = dq @ xq.t()
    got = w.main_grad.double().cpu() - 2.0
    # bf16 rounds the sum with 2.0 once (2^-8 of it); a GPU's FP8 accumulation errs by up to
    # about 2^-10 of the element's sum of |products|, which cancellation can make far larger
    # than the element
    bound = 2**-7 * (want + 2.0).abs() + 2**-9 * (dq.abs() @ xq.abs().t())
    assert bool(((got - want).abs() <= bound).all())
    assert ran == [True, False] and "triton" not in bw._failed  # the forward, the weight grad


def test_no_tokens_quantize_and_multiply_to_nothing() -> None:
    x = torch.empty(0, 384)
    a, a_t = bw.quantize_rows(x, E4M3, transposed=True)
    assert a.data.shape == (0, 384) and a_t.data.shape == (384, 0)
    w, _ = bw.quantize_tiles(torch.randn(256, 384), E4M3, transposed=False)
    assert bw.block_mm(a, w, True, torch.float32).shape == (0, 256)


def test_fp8_param_gather_is_refused_with_block_scaling_where_the_linear_is_built() -> None:
    from types import SimpleNamespace

    config = SimpleNamespace(fp8="hybrid", fp8_recipe="blockwise", num_layers=1, fp8_margin=0,
                             fp8_wgrad=True, first_last_layers_bf16=False, fp8_param=True)  # fmt: skip
    linear = SimpleNamespace(weight=torch.nn.Parameter(torch.randn(256, 384)))
    with pytest.raises(ValueError, match="--fp8-param-gather with --fp8-recipe blockwise") as info:
        backend_fp8.attach_recipe(linear, "TELinear", config)
    assert "\n" not in str(info.value)
