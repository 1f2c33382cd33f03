"""The FP8 GEMM that adds into its output (``kernels.fp8_accumulate``: cuBLASLt / hipBLASLt with
``beta = 1``), and the FP8 linears' weight gradients through it.

The oracle is torch's own ``torch._scaled_mm`` into fp32 followed by ``out.add_``, the path the
linears take without it. The GPU cases assert the BLAS path ran (``accumulate`` answered True),
so none passes on the fallback. On the CPU: the C layouts and enum tables against the libraries'
headers, and the fallbacks.
"""

from __future__ import annotations

import ctypes

import pytest

torch = pytest.importorskip("torch")

from megatron_rocm.runtime.backend import fp8 as backend_fp8  # noqa: E402
from megatron_rocm.runtime.kernels import fp8, fp8_accumulate  # noqa: E402

pytestmark = pytest.mark.torch


@pytest.mark.parametrize(
    ("vendor", "size"), [(fp8_accumulate.CUBLASLT, 96), (fp8_accumulate.HIPBLASLT, 56)]
)
def test_the_heuristic_result_has_the_headers_size(vendor, size) -> None:
    """cublasLt.h: a 64-byte algorithm; hipblaslt.h: 16 bytes and a size_t; then workspace
    size, state, waves and four reserved ints (a wrong size corrupts the caller's memory)."""
    assert ctypes.sizeof(fp8_accumulate._heuristic_type(vendor)) == size


@pytest.mark.parametrize(("hip", "arch"), [(None, None), ("6.4", "gfx942"), ("6.4", "gfx950")])
def test_every_fp8_format_of_a_gpu_has_a_blas_type(monkeypatch, hip, arch) -> None:
    monkeypatch.setattr(torch.version, "hip", hip, raising=False)
    monkeypatch.setattr(fp8, "gpu_arch", lambda: arch)
    vendor = fp8_accumulate.HIPBLASLT if hip else fp8_accumulate.CUBLASLT
    for name in ("hybrid", "e4m3"):
        formats = fp8.formats(name)
        assert {formats.forward, formats.backward} <= set(vendor.types)


def test_a_loaded_library_is_found_by_its_name() -> None:
    path = fp8_accumulate._loaded_library("libc.so")
    assert path is not None and path.rsplit("/", 1)[-1].startswith("libc.so")
    assert fp8_accumulate._loaded_library("libnothing-of-that-name.so") is None


@pytest.mark.parametrize(
    ("ptr", "want"), [(0x7F0000001000, 256), (0x1010, 16), (0x1008, 8), (0, 256)]
)
def test_a_pointers_alignment_is_its_lowest_set_bit_up_to_256(ptr, want) -> None:
    assert fp8_accumulate.alignment(ptr) == want


def test_cpu_tensors_add_separately() -> None:
    out = torch.zeros(16, 16)
    a = torch.zeros(16, 32).to(torch.float8_e4m3fn)
    b = torch.zeros(16, 32).to(torch.float8_e4m3fn).t()
    one = torch.tensor(1.0)
    assert fp8_accumulate.accumulate(out, a, one, b, one) is False


def _block_case(m: int, n: int, k: int, device="cpu", seed: int = 0) -> tuple:  # noqa: ANN001
    """FP8 ``a`` [m, k], column-major ``b`` [k, n] and 1 x 128 inverse scales that differ by
    block, in the layout ``accumulate(blocks=True)`` takes: [ceil(k/128), rows]."""
    gen = torch.Generator(device=device).manual_seed(seed)
    a = torch.randn(m, k, device=device, generator=gen).clamp(-6, 6).to(torch.float8_e5m2)
    b = torch.randn(n, k, device=device, generator=gen).clamp(-6, 6).to(torch.float8_e4m3fn).t()
    blocks = -(-k // 128)
    a_inv = torch.exp2(torch.randint(-12, -4, (blocks, m), device=device, generator=gen).float())
    b_inv = torch.exp2(torch.randint(-6, 2, (blocks, n), device=device, generator=gen).float())
    return a, a_inv, b, b_inv


@pytest.mark.parametrize(
    "case", ["fits", "m_not_multiple_of_4", "scales_transposed", "scales_strided", "bf16_scales"]
)
def test_block_scales_are_taken_only_in_cublaslts_layout(case) -> None:
    m, n, k = (30 if case == "m_not_multiple_of_4" else 32), 48, 300
    _, a_inv, _, b_inv = _block_case(m, n, k)
    if case == "scales_transposed":
        a_inv = a_inv.t().contiguous()
    if case == "scales_strided":
        b_inv = torch.zeros(3, 2 * n)[:, ::2]
    if case == "bf16_scales":
        a_inv = a_inv.to(torch.bfloat16)
    assert fp8_accumulate._block_scales_fit(a_inv, b_inv, m, n, k) is (case == "fits")


def test_rocm_has_no_block_scaled_accumulation(monkeypatch) -> None:
    """hipBLASLt has no block-scaled FP8 GEMM: the Triton kernel adds there instead."""
    monkeypatch.setattr(torch.version, "hip", "6.4", raising=False)
    _, a_inv, _, b_inv = _block_case(32, 48, 256)
    assert fp8_accumulate._block_scales_fit(a_inv, b_inv, 32, 48, 256) is False


def test_cpu_tensors_with_block_scales_add_separately() -> None:
    a, a_inv, b, b_inv = _block_case(32, 48, 256)
    assert fp8_accumulate.accumulate(torch.zeros(32, 48), a, a_inv, b, b_inv, blocks=True) is False


class _FakeBlas:
    """A BLAS whose GEMM adds ``factor`` times the true product (1: right), on the CPU."""

    vendor = fp8_accumulate.CUBLASLT

    def __init__(self, factor: float) -> None:
        self.factor, self.plans, self.released, self.unjudged = factor, {}, [], {}

    def plan(self, key, scales=None):  # noqa: ANN001, ANN201
        return ("plan", key)

    def release(self, plan) -> None:  # noqa: ANN001
        self.released.append(plan)

    def matmul(self, out, a, a_inv, b, b_inv, plan) -> None:  # noqa: ANN001
        out.add_(self.factor * _block_product(a, a_inv, b, b_inv))


def _block_product(a, a_inv, b, b_inv):  # noqa: ANN001, ANN202
    rows = a_inv.repeat_interleave(128, 0)[: a.shape[1]].t()  # [M, K]
    cols = b_inv.repeat_interleave(128, 0)[: b.shape[0]]  # [K, N]
    return (a.float() * rows) @ (b.float() * cols)


@pytest.fixture
def cpu_scaled_mm(monkeypatch):  # noqa: ANN001, ANN201
    """torch's block-scaled GEMM in fp32 math (the oracle the per-plan check compares to)."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch, "_scaled_mm", lambda a, b, scale_a, scale_b, out_dtype: (
        _block_product(a, scale_a.t(), b, scale_b)))  # fmt: skip


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("factor", [1.0, 1.1, 2.0])
def test_a_block_plan_is_checked_against_a_gradient_of_its_own_size(
    cpu_scaled_mm, out_dtype, factor
) -> None:
    """A product 10% off is refused even where it is tiny against 1 (a real weight gradient is
    often 1e-5 of that) and the sum is bf16: the check's start has the product's size."""
    a, a_inv, b, b_inv = _block_case(32, 48, 300)
    a_inv, b_inv = a_inv * 2.0**-20, b_inv * 2.0**-4
    blas = _FakeBlas(factor)
    out = torch.zeros(32, 48, dtype=out_dtype)
    key, plan = fp8_accumulate._plan_for(blas, out, a, b, (a_inv, b_inv))
    assert (plan is not None) is (factor == 1.0)
    assert key in blas.plans and key[-1] is True


@pytest.mark.parametrize("case", ["inf", "zeros", "no_memory"])
def test_a_product_that_cannot_judge_leaves_the_plan_to_a_later_call(
    monkeypatch, cpu_scaled_mm, case
) -> None:
    """Such a call adds apart (no plan) and frees what it planned; after ``UNJUDGED_TRIES``
    of them the shape stays on the add."""
    a, a_inv, b, b_inv = _block_case(32, 48, 300)
    if case == "inf":
        a_inv[0, 0] = float("inf")
    if case == "zeros":
        a_inv.zero_()
    if case == "no_memory":

        def full(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            raise torch.OutOfMemoryError("CUDA out of memory")

        monkeypatch.setattr(torch, "_scaled_mm", full)
    blas = _FakeBlas(1.0)
    out = torch.zeros(32, 48)
    for tries in range(1, fp8_accumulate.UNJUDGED_TRIES + 1):
        key, plan = fp8_accumulate._plan_for(blas, out, a, b, (a_inv, b_inv))
        assert plan is None and len(blas.released) == tries
        assert (key in blas.plans) is (tries == fp8_accumulate.UNJUDGED_TRIES)
    assert blas.plans[key] is None
    assert torch.equal(out, torch.zeros(32, 48))  # nothing added by a check


# -- on a GPU ----------------------------------------------------------------------------------


def _operands(device, m, n, k, a_dtype, b_dtype, seed=0):  # noqa: ANN001, ANN202
    gen = torch.Generator(device=device).manual_seed(seed)
    a = torch.randn(m, k, device=device, generator=gen).clamp(-6, 6).to(a_dtype)
    b = torch.randn(n, k, device=device, generator=gen).clamp(-6, 6).to(b_dtype).t()
    return a, torch.tensor(0.03, device=device), b, torch.tensor(0.7, device=device)


def _gpu_formats() -> list[tuple[torch.dtype, torch.dtype]]:
    """(a, b) as the weight gradient pairs them: the output gradient, then the input."""
    if not torch.cuda.is_available():
        return [(torch.float8_e5m2, torch.float8_e4m3fn)]
    hybrid = fp8.formats("hybrid")
    return [(hybrid.backward, hybrid.forward), (hybrid.forward, hybrid.forward)]


@pytest.mark.gpu
@pytest.mark.parametrize("formats", _gpu_formats())
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("m", "n", "k"), [(48, 64, 80), (1024, 1536, 4096), (4096, 1536, 2048)])
@pytest.mark.parametrize("offset", [0, 8], ids=["aligned", "offset-view"])
def test_gpu_accumulate_adds_what_scaled_mm_computes(
    cuda_device, formats, out_dtype, m, n, k, offset
) -> None:
    """Against torch's GEMM plus the add, and against float64 math on the dequantized
    operands; ``offset-view``: ``out`` a view 8 elements into a larger buffer, as ``main_grad``
    is a view into DDP's (the planner told the lesser alignment)."""
    a, a_inv, b, b_inv = _operands(cuda_device, m, n, k, *formats)
    start = torch.randn(m, n, device=cuda_device).to(out_dtype)
    want = start.clone()
    want.add_(torch._scaled_mm(a, b, scale_a=a_inv, scale_b=b_inv, out_dtype=torch.float32))
    exact = start.double() + (a.float().double() * a_inv.double()) @ (
        b.float().double() * b_inv.double()
    )
    buffer = torch.zeros(m * n + offset, device=cuda_device, dtype=out_dtype)
    got = buffer[offset:].view(m, n)
    got.copy_(start)
    assert fp8_accumulate.accumulate(got, a, a_inv, b, b_inv) is True
    scale = exact.abs().max().item()
    bound = (1e-5 if out_dtype == torch.float32 else 8e-3) * scale
    assert (got.float() - want.float()).abs().max().item() <= bound
    # the FP8 GEMM's own accumulation error (about 1.2e-4 of the largest value on an H200, the
    # same for torch._scaled_mm: scripts/bench/fp8_wgrad_accum.py) bounds the distance to exact
    exact_bound = (5e-4 if out_dtype == torch.float32 else 1.6e-2) * scale
    assert (got.double() - exact).abs().max().item() <= exact_bound
    assert torch.equal(buffer[:offset], torch.zeros_like(buffer[:offset]))


@pytest.mark.gpu
def test_gpu_accumulate_replays_in_a_cuda_graph(cuda_device) -> None:
    a, a_inv, b, b_inv = _operands(cuda_device, 256, 512, 1024, *_gpu_formats()[0])
    out = torch.zeros(256, 512, device=cuda_device)
    assert fp8_accumulate.accumulate(out, a, a_inv, b, b_inv)  # the first use, eager
    once = out.clone()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph):
        assert fp8_accumulate.accumulate(out, a, a_inv, b, b_inv)
    torch.cuda.current_stream().wait_stream(stream)
    out.zero_()
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.allclose(out, 2 * once, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe_name", ["tensorwise", "delayed"])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_gpu_fp8_linear_adds_its_weight_gradient_in_the_gemm(
    cuda_device, monkeypatch, recipe_name, grad_dtype
) -> None:
    """main_grad after two backward steps: the same as the separate add leaves it (the same
    operands; only the GEMM's kernel differs), and the separate add never ran."""

    def run(separate: bool) -> torch.Tensor:
        if separate:
            monkeypatch.setenv("MEGATRON_ROCM_KERNELS", "reference:fp8_accumulate")
        else:
            monkeypatch.delenv("MEGATRON_ROCM_KERNELS", raising=False)
        torch.manual_seed(3)
        w = torch.nn.Parameter(torch.randn(256, 512, device=cuda_device, dtype=torch.bfloat16))
        w.main_grad = torch.zeros(256, 512, device=cuda_device, dtype=grad_dtype)
        delayed = None
        if recipe_name == "delayed":
            delayed = backend_fp8.DelayedScaling(
                *(fp8.AmaxHistory(16, most_recent=False) for _ in range(3))
            )
        recipe = backend_fp8.Fp8Recipe(formats=fp8.formats("hybrid"), delayed=delayed)
        calls = []
        original = fp8_accumulate.accumulate

        def counted(*args):  # noqa: ANN002, ANN202
            done = original(*args)
            calls.append(done)
            return done

        monkeypatch.setattr(backend_fp8, "accumulate", counted)
        for _ in range(2):
            x = torch.randn(1000, 512, device=cuda_device, dtype=torch.bfloat16)
            y = backend_fp8.fp8_linear(x, w, True, recipe)
            y.backward(torch.randn_like(y))
        assert calls == [not separate] * 2
        return w.main_grad.clone()

    fused, separate = run(False), run(True)
    err = (fused.float() - separate.float()).abs().max().item()
    assert err <= (1e-5 if grad_dtype == torch.float32 else 1e-2) * separate.abs().max().item()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or bool(torch.version.hip), reason="cuBLASLt")
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("m", "n", "k"), [(64, 96, 1008), (1536, 4096, 8192), (4096, 1024, 208)])
def test_gpu_accumulate_with_block_scales(cuda_device, out_dtype, m, n, k) -> None:
    """1 x 128 scales on both sides (block scaling's weight gradient; K the tokens, not always a
    multiple of 128): against torch's block-scaled GEMM plus the add and against float64 math
    on the dequantized operands, each K block scaled apart."""
    a, a_inv, b, b_inv = _block_case(m, n, k, cuda_device, seed=2)
    start = torch.randn(m, n, device=cuda_device).to(out_dtype)
    want = start.clone()
    want.add_(torch._scaled_mm(a, b, scale_a=a_inv.t(), scale_b=b_inv, out_dtype=torch.float32))
    a_scales = a_inv.double().repeat_interleave(128, 0)[:k].t()  # [m, k]
    b_scales = b_inv.double().repeat_interleave(128, 0)[:k]  # [k, n]
    exact = start.double() + (a.double() * a_scales) @ (b.double() * b_scales)
    got = start.clone()
    assert fp8_accumulate.accumulate(got, a, a_inv, b, b_inv, blocks=True) is True
    assert fp8_accumulate.served(got.device, a.dtype, b.dtype, out_dtype, blocks=True)
    scale = exact.abs().max().item()
    bound = (1e-5 if out_dtype == torch.float32 else 8e-3) * scale
    assert (got.float() - want.float()).abs().max().item() <= bound
    exact_bound = (5e-4 if out_dtype == torch.float32 else 1.6e-2) * scale
    assert (got.double() - exact).abs().max().item() <= exact_bound


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or bool(torch.version.hip), reason="cuBLASLt")
@pytest.mark.parametrize("k", [96, 1024])
def test_gpu_block_scaled_accumulate_replays_in_a_cuda_graph(cuda_device, k) -> None:
    """K of one partial block and of eight: the scales as the caller makes them inside the
    capture (from the graph's pool; a view where ``contiguous`` copies nothing)."""
    a, a_inv, b, b_inv = _block_case(256, 512, k, cuda_device, seed=3)
    out = torch.zeros(256, 512, device=cuda_device)
    assert fp8_accumulate.accumulate(out, a, a_inv, b, b_inv, blocks=True)  # the first use
    once = out.clone()
    rows_of_a, rows_of_b = a_inv.t().contiguous(), b_inv.t().contiguous()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph):
        taken = fp8_accumulate.accumulate(
            out, a, rows_of_a.t().contiguous(), b, rows_of_b.t().contiguous(), blocks=True
        )
    torch.cuda.current_stream().wait_stream(stream)
    assert taken
    out.zero_()
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.allclose(out, 2 * once, rtol=1e-5, atol=1e-5 * once.abs().max().item())
