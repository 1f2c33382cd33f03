"""The FP8 kernels (``fp8_triton``: amax and scale, cast with and without the transpose) and the
linears' operands they write.

The oracle is torch's own arithmetic and FP8 conversion (``Tensor.to``) on the kernel's device,
not our code: the cast must give its bytes for every FP8 value, every midpoint between two of
them (ties to even), their fp32 neighbours, NaN, signed zeros and values under the smallest
subnormal, in all four formats; the scale kernels torch's scale and inverse, bit for bit, for
every kind of amax (zero, subnormal, tiny enough to overflow the scale, huge, inf, NaN).
The ``triton`` cases run the kernel (on a GPU, or under the interpreter in a child pytest on a
CPU box: ``test_triton_interpreter_runs.py``); the others run torch's path.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from triton_interpreter import INTERPRETER, TRITON_DEVICE, triton_test

from megatron_rocm.runtime.backend import fp8 as backend_fp8
from megatron_rocm.runtime.kernels import fp8

TRITON_SKIPS_ALLOWED = False  # under the interpreter every Triton case runs

FORMATS = [torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz]
DEVICE = TRITON_DEVICE or "cpu"


def _every_value_and_tie(dtype: torch.dtype) -> torch.Tensor:
    """Each finite FP8 value, each midpoint of two, their fp32 neighbours, and specials."""
    fp8_max = torch.finfo(dtype).max
    codes = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    codes = codes[torch.isfinite(codes)]
    mids = ((codes[:, None] + codes[None, :]) / 2).flatten()
    nan, inf = float("nan"), float("inf")
    specials = [nan, -nan, -0.0, 0.0, 1e-30, -1e-30, 1e-45, -1e-45, fp8_max, -fp8_max]
    base = torch.cat([codes, mids, torch.tensor(specials)])
    up, down = (torch.nextafter(base, torch.tensor(v)) for v in (inf, -inf))
    beyond = torch.tensor([inf, -inf, 2 * fp8_max, -1e30])  # saturate at the clamp
    return torch.cat([base, up, down, beyond])


def _spy(monkeypatch: pytest.MonkeyPatch) -> list[tuple[tuple[int, int], bool]]:
    """Records each cast launch that returned (its input's shape, whether it transposed): a
    case that ran torch's path instead, or fell back to it after the launch raised, cannot
    pass."""
    from megatron_rocm.runtime.kernels import fp8_triton

    calls: list[tuple[tuple[int, int], bool]] = []
    real = fp8_triton.cast_transpose

    def spy(x, *args):  # noqa: ANN001, ANN202
        done = real(x, *args)
        calls.append((tuple(x.shape), args[-1] is not None))
        return done

    monkeypatch.setattr(fp8_triton, "cast_transpose", spy)
    return calls


# the hardware cast runs only compiled on an NVIDIA GPU: elsewhere a "hardware" case would run
# the encode a second time (and this file allows no skip)
HARDWARE_CASES = [True, False] if TRITON_DEVICE == "cuda" and not INTERPRETER else [False]


@triton_test
@pytest.mark.parametrize(
    "hardware_cast", HARDWARE_CASES, ids=lambda h: "hardware" if h else "encode"
)
@pytest.mark.parametrize("dtype", FORMATS, ids=lambda d: str(d).removeprefix("torch.float8_"))
def test_every_value_and_tie_is_torchs_byte(monkeypatch, dtype: torch.dtype, hardware_cast) -> None:
    from megatron_rocm.runtime.kernels import fp8_triton

    monkeypatch.setattr(fp8_triton, "HARDWARE_CAST", hardware_cast)
    kind = fp8_triton.cast_kind(dtype, torch.device(DEVICE))
    fp8_gpu = (
        DEVICE == "cuda"
        and torch.version.hip is None
        and not INTERPRETER
        and torch.cuda.get_device_capability() >= (8, 9)
    )
    # the case checks the path it names: the hardware conversion on an NVIDIA GPU with FP8
    # for the OCP formats, the integer encode everywhere else
    assert (kind != 0) == (hardware_cast and fp8_gpu and dtype in fp8_triton.HARDWARE_FORMATS)
    values = _every_value_and_tie(dtype)
    cols = 64
    rows = -(-values.numel() // cols)
    x = torch.zeros(rows * cols)
    x[: values.numel()] = values
    x = x.view(rows, cols)
    fp8_max = float(torch.finfo(dtype).max)
    one = torch.ones((), device=DEVICE)
    # torch's quantize arithmetic on the kernel's device: a NaN's sign after the multiply by
    # the scale is the device's (a GPU returns its canonical NaN, x86 keeps the sign)
    want = (x.to(DEVICE) * one).clamp(-fp8_max, fp8_max).to(dtype).view(torch.uint8).cpu()
    y, yt = fp8_triton.cast_transpose(x.to(DEVICE), one, dtype, fp8_max, rows + 5)
    wrong = (y.cpu().view(torch.uint8) != want).nonzero()
    assert wrong.numel() == 0, [(x[i, j].item(), want[i, j].item()) for i, j in wrong[:5].tolist()]
    assert torch.equal(yt.cpu()[:, :rows].view(torch.uint8), want.t())
    assert not yt.cpu()[:, rows:].view(torch.uint8).any()  # the padding columns are zero


@pytest.mark.parametrize("hip", [None, "6.4"], ids=["cuda", "rocm"])
def test_the_hardware_cast_is_chosen_on_nvidia_gpus_with_fp8_for_ocp_formats_only(
    monkeypatch, request, hip
) -> None:
    pytest.importorskip("triton")
    from megatron_rocm.runtime.kernels import fp8_triton

    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    # cuda:0 an H100/H200, cuda:1 an A10/A100-class GPU (no FP8 cvt), cuda:2 an L40 (8.9)
    capability = {0: (9, 0), 1: (8, 6), 2: (8, 9)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d: capability[d.index])
    fp8_triton.has_fp8_conversion.cache_clear()  # asked once per device: not a real GPU's
    request.addfinalizer(fp8_triton.has_fp8_conversion.cache_clear)
    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    want = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}
    for dtype in FORMATS:
        assert fp8_triton.cast_kind(dtype, cpu) == 0
        assert fp8_triton.cast_kind(dtype, gpu) == (0 if hip else want.get(dtype, 0)), dtype
    assert fp8_triton.cast_kind(torch.float8_e4m3fn, torch.device("cuda", 1)) == 0
    assert fp8_triton.cast_kind(torch.float8_e4m3fn, torch.device("cuda", 2)) == (0 if hip else 1)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the interpreter runs no PTX
    assert fp8_triton.cast_kind(torch.float8_e4m3fn, gpu) == 0
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setattr(fp8_triton, "HARDWARE_CAST", False)
    assert fp8_triton.cast_kind(torch.float8_e4m3fn, gpu) == 0


@pytest.mark.skipif(INTERPRETER, reason="TRITON_INTERPRET=1 replaces the compiled kernel")
@pytest.mark.parametrize("source", ["*bf16", "*fp32"])
@pytest.mark.parametrize(("cast", "ptx"), [(1, "e4m3x2"), (2, "e5m2x2")], ids=["e4m3fn", "e5m2"])
def test_the_hardware_cast_compiles_for_h100_as_inline_ptx(source: str, cast: int, ptx: str):
    """The hardware cast compiles for sm_90 on the CPU (Triton ships ptxas) as the inline
    ``cvt`` pairs, not Triton's own FP8 cast, whose transposed store is wrong on an H200."""
    triton = pytest.importorskip("triton")
    if importlib.util.find_spec("triton.backends.nvidia") is None:
        pytest.skip("this Triton build has no NVIDIA backend")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from megatron_rocm.runtime.kernels import fp8_triton

    if not triton.__version__.startswith(("3.4", "3.5", "3.6")):
        pytest.skip("ASTSource's signature format is only known for Triton 3.4-3.6")
    fn = fp8_triton._cast_transpose
    pointers = {"x": source, "scale": "*fp32", "y": "*u8", "yt": "*u8", "amax_out": "*i32"}
    tile = fp8_triton.cast_tile(cast)
    constants = dict(MANTISSA=3, BIAS=7, FNUZ=False, BLOCK_R=tile.rows, BLOCK_C=tile.cols,
                     WIDE=False, TRANSPOSE=True, RECORD=True, CAST=cast)  # fmt: skip
    scalars = {"fp8_max": "fp32"}
    signature = {
        n: pointers.get(n) or scalars.get(n) or ("constexpr" if n in constants else "i32")
        for n in fn.arg_names
    }
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in pointers}
    kernel = triton.compile(
        ASTSource(fn, signature, constants, attrs),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": tile.warps},
    )
    assert f"cvt.rn.satfinite.{ptx}.f32" in kernel.asm["ptx"]
    assert "tt.fp_to_fp" not in kernel.asm["ttgir"]


def _amaxes() -> list[torch.Tensor]:
    """Tensors whose amax is each kind the scale treats apart, and 64 across fp32's range."""
    big = torch.finfo(torch.float32).max
    kinds = [0.0, 1e-45, 1e-40, 1e-38, 1e-37, 2.0**-126, 1.0, 3.0, 448.0, 1e30, big,
             float("inf"), float("nan")]  # fmt: skip
    torch.manual_seed(11)
    spread = (torch.rand(64) * 250 - 125).exp2() * (1 + torch.rand(64))
    tensors = []
    for a in [*kinds, *spread.tolist()]:
        x = torch.randn(3, 16) * 1e-3 * (a if 0 < a < float("inf") else 1.0)
        x[1, 5] = -a  # the amax, negative: |x| is what counts
        tensors.append(x)
    tensors.append(torch.zeros(2, 16))
    return tensors


@triton_test
@pytest.mark.parametrize("margin", [0, 1, 3, 128])  # 2^128 overflows fp32: scale 0, as torch
def test_the_scale_kernels_give_torchs_scale_and_inverse_bitwise(margin: int) -> None:
    from megatron_rocm.runtime.kernels import fp8_triton

    for dtype in FORMATS:
        fp8_max = float(torch.finfo(dtype).max)
        for x in _amaxes():
            xd = x.to(DEVICE)
            want = fp8._scale(fp8._amax(xd), fp8_max, margin)
            scale, inverse = fp8_triton.scales(xd, fp8_max, 2.0**margin)
            assert torch.equal(scale.cpu().view(torch.int32), want.cpu().view(torch.int32)), x
            want_inv = want.reciprocal().cpu().view(torch.int32)
            assert torch.equal(inverse.cpu().view(torch.int32), want_inv)


@triton_test
def test_the_amax_of_many_programs_finds_the_largest_anywhere(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Small blocks and few programs, so each program loops over several blocks and the
    finalize reduces several partials; the amax placed first, last, in a partial block."""
    from megatron_rocm.runtime.kernels import fp8_triton

    monkeypatch.setattr(fp8_triton, "AMAX_BLOCK", 64)
    monkeypatch.setattr(fp8_triton, "AMAX_PROGRAMS", 8)
    n = 5000  # 79 blocks: 8 programs of 10 blocks, the last one partly past n
    assert fp8_triton.amax_programs(n) == (8, 10)
    for where in (0, 2500, 4999, 4991):
        x = torch.rand(n) * 2 - 1
        x[where] = -7.5
        scale, _ = fp8_triton.scales(x.to(DEVICE), 448.0, 1.0)
        assert torch.equal(scale.cpu(), fp8._scale(fp8._amax(x), 448.0, 0))


@triton_test
def test_the_amax_with_int64_offsets_is_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    """``_partial_amax``'s WIDE branch (offsets past int32), forced on a small tensor."""
    from megatron_rocm.runtime.kernels import fp8_triton

    x = (torch.rand(9000) * 2 - 1).to(DEVICE)
    x[8999] = 3.0
    narrow = fp8_triton.scales(x, 448.0, 1.0)
    monkeypatch.setattr(fp8_triton, "amax_needs_int64", lambda n: True)
    wide = fp8_triton.scales(x, 448.0, 1.0)
    assert [t.item() for t in narrow] == [t.item() for t in wide]
    assert torch.equal(wide[0].cpu(), fp8._scale(torch.tensor(3.0), 448.0, 0))


def test_amax_offsets_widen_exactly_where_int32_ends() -> None:
    pytest.importorskip("triton")
    from megatron_rocm.runtime.kernels import fp8_triton

    def reach(n: int) -> int:  # one past the largest offset any program computes
        programs, per_program = fp8_triton.amax_programs(n)
        return programs * per_program * fp8_triton.AMAX_BLOCK

    for n in (1, 4096, 2**31 - 4096, 2**31 - 1, 2**31, 2**31 + 1, 3 * 2**31):
        assert fp8_triton.amax_needs_int64(n) == (reach(n) > 2**31 - 1), n


@triton_test
def test_quantize_on_the_kernels_is_the_eager_quantize_for_every_operand_kind() -> None:
    """Weights (``Parameter``), activations and gradients, 1- to 3-D, transposed views, every
    format and input dtype, margins: the bytes and the inverse scale bit for bit."""
    torch.manual_seed(5)
    shapes = [(16,), (7,), (3, 5), (64, 48), (2, 10, 64), (33, 17), (5, 3, 7)]
    checked = 0
    for source in (torch.bfloat16, torch.float16, torch.float32):
        for shape in shapes:
            x = (torch.randn(*shape) * 3).to(source)
            kinds = [x, torch.nn.Parameter(x.clone()), x.clone().requires_grad_()]
            kinds += [x.t()] if x.dim() == 2 else []
            for operand in kinds:
                for dtype, margin in zip(FORMATS, (0, 1, 0, 2), strict=True):
                    want = fp8.quantize(operand.detach(), dtype, margin, triton=False)
                    got = fp8.quantize(operand.to(DEVICE), dtype, margin, triton=True)
                    assert got[0].shape == operand.shape and got[0].dtype == dtype
                    assert not got[0].requires_grad and not got[1].requires_grad
                    assert torch.equal(got[0].cpu().view(torch.uint8), want[0].view(torch.uint8))
                    assert torch.equal(got[1].cpu(), want[1])
                    # its own allocation: cuBLASLt refuses a scale at a 4-byte offset
                    assert got[1].storage_offset() == 0 and got[1].data_ptr() % 16 == 0
                    checked += 1
    assert checked == 3 * (7 * 3 + 3) * 4  # sources x (operand kinds) x formats


@triton_test
@pytest.mark.parametrize("source", [torch.bfloat16, torch.float16, torch.float32])
# 200 columns: a partial second tile on the widest tile (128) too
@pytest.mark.parametrize(
    ("rows", "cols", "margin"), [(70, 48, 0), (33, 80, 1), (128, 16, 0), (70, 200, 0)]
)
def test_quantize_transposed_is_quantize_and_its_padded_transpose(
    monkeypatch: pytest.MonkeyPatch, source: torch.dtype, rows: int, cols: int, margin: int
) -> None:
    calls = _spy(monkeypatch)
    torch.manual_seed(rows)
    x = (torch.randn(rows, cols) * 3).to(source)
    for dtype in FORMATS:
        want, want_inv = fp8.quantize(x, dtype, margin, triton=False)
        got, got_t, inv = fp8.quantize_transposed(x.to(DEVICE), dtype, margin)
        padded = -(-rows // 16) * 16
        assert got_t.shape == (cols, padded) and got_t.is_contiguous()
        assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8))
        assert torch.equal(got_t.cpu()[:, :rows].view(torch.uint8), want.t().view(torch.uint8))
        assert not got_t.cpu()[:, rows:].view(torch.uint8).any()
        assert torch.equal(inv.cpu(), want_inv)
    assert calls == [((rows, cols), True)] * len(FORMATS)


@triton_test
def test_int64_offsets_give_the_same_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel's WIDE branch (offsets past int32), forced on a small tensor."""
    from megatron_rocm.runtime.kernels import fp8_triton

    x = torch.randn(40, 48) * 4
    narrow = fp8_triton.cast_transpose(
        x.to(DEVICE), torch.ones((), device=DEVICE), FORMATS[0], 448.0, 48
    )
    monkeypatch.setattr(fp8_triton, "needs_int64", lambda *a: True)
    wide = fp8_triton.cast_transpose(
        x.to(DEVICE), torch.ones((), device=DEVICE), FORMATS[0], 448.0, 48
    )
    for a, b in zip(narrow, wide, strict=True):
        assert torch.equal(a.cpu().view(torch.uint8), b.cpu().view(torch.uint8))


def _spy_on(monkeypatch: pytest.MonkeyPatch, name: str) -> list[tuple[int, ...]]:
    """The input shapes of the ``fp8_triton.<name>`` launches that returned."""
    from megatron_rocm.runtime.kernels import fp8_triton

    calls: list[tuple[int, ...]] = []
    real = getattr(fp8_triton, name)

    def spy(x, *args):  # noqa: ANN001, ANN202
        done = real(x, *args)
        calls.append(tuple(x.shape))
        return done

    monkeypatch.setattr(fp8_triton, name, spy)
    return calls


@triton_test
@pytest.mark.parametrize("wide", [False, True], ids=["int32", "int64"])
@pytest.mark.parametrize(
    "hardware_cast", HARDWARE_CASES, ids=lambda h: "hardware" if h else "encode"
)
@pytest.mark.parametrize("dtype", FORMATS, ids=lambda d: str(d).removeprefix("torch.float8_"))
def test_the_flat_cast_into_a_buffer_is_torchs_bytes(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, hardware_cast: bool, wide: bool
) -> None:
    """``cast_into`` (``--fp8-param-gather``'s shard cast): every value and tie, scaled, in
    bf16 and fp32, written at an odd offset of a byte buffer whose other bytes stay as they
    were; a length that is no multiple of the kernel's block."""
    from megatron_rocm.runtime.kernels import fp8_triton

    monkeypatch.setattr(fp8_triton, "HARDWARE_CAST", hardware_cast)
    if wide:
        monkeypatch.setattr(fp8_triton, "flat_needs_int64", lambda n: True)
    calls = _spy_on(monkeypatch, "cast_flat")
    fp8_max = torch.finfo(dtype).max
    for source in (torch.bfloat16, torch.float32):
        x = _every_value_and_tie(dtype).to(source)
        for scale_value in (1.0, 0.375, 3.0):
            scale = torch.tensor(scale_value, device=DEVICE)
            # torch's arithmetic on the kernel's device: a NaN's sign is the device's
            want = (x.to(DEVICE).float() * scale).clamp(-fp8_max, fp8_max).to(dtype).cpu()
            want = want.view(torch.uint8)
            buffer = torch.full((x.numel() + 12,), 0xA5, dtype=torch.uint8, device=DEVICE)
            amax = torch.zeros(3, device=DEVICE)  # delayed scaling's record, in the middle one
            fp8.cast_into(x.to(DEVICE), scale, buffer[7 : 7 + x.numel()], dtype, amax[1])
            got = buffer.cpu()
            assert torch.equal(got[7 : 7 + x.numel()], want)
            assert (got[:7] == 0xA5).all() and (got[7 + x.numel() :] == 0xA5).all()
            # the largest |x| with NaN left out (inf kept), its neighbours untouched
            magnitudes = x.float().abs()
            largest = magnitudes[~magnitudes.isnan()].max()
            assert torch.equal(
                amax.cpu(), torch.stack([torch.tensor(0.0), largest, torch.tensor(0.0)])
            )
            # only raised: a larger amax already there stays
            finite = x[torch.isfinite(x.float())]
            amax[1] = 1e38
            fp8.cast_into(finite.to(DEVICE), scale, buffer[: finite.numel()], dtype, amax[1])
            assert amax[1].item() == torch.tensor(1e38).item()
    assert len(calls) == 2 * 3 * 2 and x.numel() % fp8_triton.FLAT_BLOCK


@triton_test
@pytest.mark.parametrize("wide", [False, True], ids=["int32", "int64"])
@pytest.mark.parametrize(("rows", "cols"), [(70, 48), (33, 80), (1, 1), (128, 16), (70, 200)])
def test_the_byte_transpose_is_torchs_transpose(
    monkeypatch: pytest.MonkeyPatch, rows: int, cols: int, wide: bool
) -> None:
    """``transpose_fp8`` (an FP8 weight's copy for the input gradient, rebuilt after
    ``--fp8-param-gather``'s all-gather): every byte where torch's transpose puts it."""
    from megatron_rocm.runtime.kernels import fp8_triton

    if wide:
        monkeypatch.setattr(fp8_triton, "needs_int64", lambda *a: True)
    calls = _spy_on(monkeypatch, "transpose_bytes")
    torch.manual_seed(rows * cols)
    x = torch.randint(0, 256, (rows, cols), dtype=torch.uint8).view(torch.float8_e4m3fn)
    got = fp8.transpose_fp8(x.to(DEVICE))
    assert got.dtype == x.dtype and got.shape == (cols, rows) and got.is_contiguous()
    assert torch.equal(got.cpu().view(torch.uint8), x.view(torch.uint8).t().contiguous())
    assert calls == [(rows, cols)]


@triton_test
def test_a_transposed_view_is_read_as_its_values(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _spy(monkeypatch)
    x = torch.randn(48, 32).t()  # [32, 48], not contiguous
    want, _ = fp8.quantize(x, torch.float8_e4m3fn, triton=False)
    got, got_t, _ = fp8.quantize_transposed(x.to(DEVICE), torch.float8_e4m3fn)
    assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(got_t.cpu().view(torch.uint8), want.t().contiguous().view(torch.uint8))
    assert calls == [((32, 48), True)]


@triton_test
@pytest.mark.parametrize("wgrad_in_fp8", [True, False])
def test_the_linear_on_the_kernel_is_the_linear_on_torch(
    monkeypatch: pytest.MonkeyPatch, wgrad_in_fp8: bool
) -> None:
    """Forward and both gradients of the FP8 linear, the kernel's operands against torch's
    (``MEGATRON_ROCM_KERNELS=reference:fp8``): the same bytes, so the same numbers."""
    recipe = backend_fp8.Fp8Recipe(formats=fp8.formats("hybrid"), wgrad_in_fp8=wgrad_in_fp8)
    torch.manual_seed(3)
    x = torch.randn(2, 21, 64, dtype=torch.bfloat16)  # 42 tokens: the padding path
    w = (torch.randn(48, 64) / 8).to(torch.bfloat16)
    dy = torch.randn(2, 21, 48, dtype=torch.bfloat16)

    def run() -> list[torch.Tensor]:
        xd, wd = (t.to(DEVICE, copy=True).requires_grad_() for t in (x, w))
        y = backend_fp8.fp8_linear(xd, wd, False, recipe)
        y.backward(dy.to(DEVICE))
        return [t.float().cpu() for t in (y, xd.grad, wd.grad)]

    calls = _spy(monkeypatch)
    ours = run()
    # x, W and dy, each with its transpose; or W's alone (x's and dy's are not needed)
    launches = [((42, 64), wgrad_in_fp8), ((48, 64), True), ((42, 48), wgrad_in_fp8)]
    assert calls == launches
    monkeypatch.setenv("MEGATRON_ROCM_KERNELS", "reference:fp8")
    torchs = run()
    assert calls == launches  # the reference path launched nothing
    for got, want in zip(ours, torchs, strict=True):
        assert torch.equal(got, want)


def test_torchs_path_pads_and_transposes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Off the kernel (``reference:fp8``): the same layouts from torch."""
    monkeypatch.setenv("MEGATRON_ROCM_KERNELS", "reference:fp8")
    x = torch.randn(20, 32, dtype=torch.bfloat16)
    got, got_t, inv = fp8.quantize_transposed(x, torch.float8_e5m2, 1)
    want, want_inv = fp8.quantize(x, torch.float8_e5m2, 1, triton=False)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert got_t.shape == (32, 32) and torch.equal(inv, want_inv)
    assert torch.equal(got_t[:, :20].view(torch.uint8), want.t().view(torch.uint8))
    assert not got_t[:, 20:].view(torch.uint8).any()


def _break(monkeypatch: pytest.MonkeyPatch, kernel: str, message: str) -> list:
    """``fp8_triton.<kernel>`` raising ``message`` on every call (a GPU without its code), the
    Triton path chosen as on a GPU, nothing failed or logged before; the calls' first
    arguments' shapes, as they are made."""
    pytest.importorskip("triton")
    from megatron_rocm.runtime.kernels import fp8_triton, launch

    monkeypatch.setattr(fp8, "_eager_keys", set())
    monkeypatch.setattr(launch, "_logged", set())
    monkeypatch.setattr(fp8, "use_triton", lambda *a, **k: True)
    attempts: list = []

    def broken(*args):  # noqa: ANN002, ANN202
        attempts.append(args[0].shape)
        raise RuntimeError(message)

    monkeypatch.setattr(fp8_triton, kernel, broken)
    return attempts


@pytest.mark.parametrize("kernel", ["scales", "cast_transpose"])
def test_a_kernel_that_fails_falls_back_to_torch_once(monkeypatch, caplog, kernel: str) -> None:
    """A kernel failure costs speed, logged once, never the training step; ``quantize``
    (no transpose) takes the same road."""
    from megatron_rocm.runtime.kernels import fp8_triton

    attempts = _break(monkeypatch, kernel, "no HIP device code for this arch\nsecond line")

    def eager_scales(x, fp8_max, margin_factor):  # noqa: ANN001, ANN202 - the kernels need a GPU
        scale = fp8._scale(fp8._amax(x), fp8_max, 0)
        return scale, scale.reciprocal()

    if kernel != "scales":
        monkeypatch.setattr(fp8_triton, "scales", eager_scales)
    caplog.set_level("WARNING", logger="megatron_rocm.runtime.kernels")
    x = torch.randn(20, 32, dtype=torch.bfloat16)
    want, want_inv = fp8.quantize(x, torch.float8_e4m3fn, triton=False)
    for _ in range(3):
        got, got_t, inv = fp8.quantize_transposed(x, torch.float8_e4m3fn)
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        assert torch.equal(got_t[:, :20].view(torch.uint8), want.t().view(torch.uint8))
        assert torch.equal(inv, want_inv)
        assert torch.equal(fp8.quantize(x, torch.float8_e4m3fn)[0].view(torch.uint8),
                           want.view(torch.uint8))  # fmt: skip
    assert len(attempts) == 1  # not retried every step
    (record,) = caplog.records
    assert "FP8 quantize (" in record.getMessage() and "no HIP device code" in record.getMessage()
    assert "second line" not in record.getMessage()


@pytest.mark.parametrize("kernel", ["cast_flat", "transpose_bytes"])
def test_the_param_gather_kernels_fall_back_to_torch_once(monkeypatch, caplog, kernel) -> None:
    """``cast_into`` and ``transpose_fp8`` (``--fp8-param-gather``): a kernel failure costs
    speed, logged once, never the bytes."""
    attempts = _break(monkeypatch, kernel, "no HIP device code for this arch")
    caplog.set_level("WARNING", logger="megatron_rocm.runtime.kernels")
    x = torch.randn(20, 32, dtype=torch.bfloat16) * 40
    want = x.float().clamp(-448, 448).to(torch.float8_e4m3fn)
    for _ in range(3):
        if kernel == "cast_flat":
            out = torch.zeros(x.numel(), dtype=torch.uint8)
            fp8.cast_into(x, torch.ones(()), out, torch.float8_e4m3fn)
            assert torch.equal(out, want.view(torch.uint8).view(-1))
        else:
            got = fp8.transpose_fp8(want)
            assert torch.equal(got.view(torch.uint8), want.t().contiguous().view(torch.uint8))
    assert len(attempts) == 1  # not retried every step
    (record,) = caplog.records
    what = "quantize (" if kernel == "cast_flat" else "byte transpose"
    assert what in record.getMessage() and "no HIP device code" in record.getMessage()


def test_offsets_widen_to_int64_past_int32() -> None:
    pytest.importorskip("triton")
    from megatron_rocm.runtime.kernels import fp8_triton

    assert not fp8_triton.needs_int64(32768, 14336, 32768)
    assert fp8_triton.needs_int64(2**17, 16384, 2**17)
    assert fp8_triton.needs_int64(2**31 // 4096 - 32, 4096, 2**31 // 4096 - 32)  # masked lanes
