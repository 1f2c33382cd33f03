"""FusedNorm / build_norm: parity with unfused fp32 math and Megatron's parameter conventions.

``triton`` tests run the Triton kernels through ``FusedNorm`` on a GPU, or on the CPU under the
Triton interpreter (``test_triton_interpreter_runs.py`` runs them in a child pytest), and check
that the kernels really ran; the others run torch's kernels on the CPU.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from triton_interpreter import TRITON_DEVICE, quick_few, triton_test  # noqa: E402

from megatron_rocm.runtime.kernels import norm as norm_module  # noqa: E402
from megatron_rocm.runtime.kernels.norm import FusedNorm, build_norm, norm_reference  # noqa: E402

TRITON_SKIPS_ALLOWED = False  # under the interpreter every Triton case runs

TOLERANCES = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}
NORMS = ("LayerNorm", "RMSNorm")
DEVICE = TRITON_DEVICE or "cpu"


def _config(**overrides: object) -> SimpleNamespace:
    """The attributes build_norm reads, with the defaults they have at core_v0.12 .. main."""
    fields = {
        "normalization": "LayerNorm",
        "layernorm_zero_centered_gamma": False,
        "sequence_parallel": False,
        "params_dtype": torch.float32,
        "use_cpu_initialization": True,
        "init_model_with_meta_device": False,
        "persist_layer_norm": True,
        "memory_efficient_layer_norm": False,
    }
    fields.update(overrides)
    return SimpleNamespace(**fields)


def _randomise(norm: FusedNorm) -> None:
    with torch.no_grad():
        for param in norm.parameters():
            param.copy_(torch.randn_like(param) * 0.5)


@pytest.mark.parametrize("normalization", NORMS)
@pytest.mark.parametrize("dtype", list(TOLERANCES))
@pytest.mark.parametrize("shape", [(3, 7), (5, 2, 64), (1, 33)])
@pytest.mark.parametrize("zero_centered", [False, True])
def test_forward_backward_parity(
    normalization: str, dtype: torch.dtype, shape: tuple[int, ...], zero_centered: bool
) -> None:
    torch.manual_seed(0)
    hidden = shape[-1]
    norm = FusedNorm(
        hidden,
        eps=1e-5,
        normalization=normalization,
        zero_centered_gamma=zero_centered,
        params_dtype=dtype,
    )
    _randomise(norm)
    x = (torch.randn(shape) * 3 + 1).to(dtype).requires_grad_()
    _compare_with_reference(norm, x, zero_centered)


def test_fp32_input_with_bf16_params_upcasts() -> None:
    """fp32 residual stream with bf16 params: computed in fp32, output fp32."""
    norm = FusedNorm(16, normalization="RMSNorm", params_dtype=torch.bfloat16)
    _randomise(norm)
    x = torch.randn(4, 16)
    expected = norm_reference(x, norm.weight.float(), None, norm.eps, "RMSNorm")
    torch.testing.assert_close(norm(x), expected)


def test_zero_centered_gamma_initialises_to_identity() -> None:
    norm = FusedNorm(8, zero_centered_gamma=True)
    assert torch.count_nonzero(norm.weight) == 0 and torch.count_nonzero(norm.bias) == 0
    x = torch.randn(2, 8)
    torch.testing.assert_close(norm(x), torch.nn.functional.layer_norm(x, (8,)))
    plain = FusedNorm(8)
    assert torch.all(plain.weight == 1)


@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("normalization", NORMS)
def test_sequence_parallel_flag_on_every_param(sequence_parallel: bool, normalization: str) -> None:
    norm = FusedNorm(8, normalization=normalization, sequence_parallel=sequence_parallel)
    names = [name for name, _ in norm.named_parameters()]
    assert names == (["weight", "bias"] if normalization == "LayerNorm" else ["weight"])
    for param in norm.parameters():
        assert param.sequence_parallel is sequence_parallel


def test_rejects_unknown_normalization() -> None:
    with pytest.raises(ValueError, match="L2Norm"):
        FusedNorm(8, normalization="L2Norm")


def test_build_norm_reads_config() -> None:
    config = _config(
        normalization="RMSNorm",
        layernorm_zero_centered_gamma=True,
        sequence_parallel=True,
        params_dtype=torch.bfloat16,
    )
    norm = build_norm(config, 24, eps=1e-6)
    assert isinstance(norm, FusedNorm)
    assert (norm.normalization, norm.hidden_size, norm.eps) == ("RMSNorm", 24, 1e-6)
    assert norm.zero_centered_gamma and norm.weight.sequence_parallel
    assert norm.weight.dtype == torch.bfloat16 and norm.weight.device.type == "cpu"
    assert norm.returns_residual is False


def test_build_norm_accepts_wrapped_torch_norm_arguments() -> None:
    """A patch returns build_norm(...) from WrappedTorchNorm.__new__ with all its arguments;
    the flags WrappedTorchNorm asserts off (persist, memory-efficient) are accepted."""
    config = _config(persist_layer_norm=True, memory_efficient_layer_norm=True)
    norm = build_norm(
        config, 8, 1e-5, persist_layer_norm=True, zero_centered_gamma=True, normalization="RMSNorm"
    )
    # Like upstream, the config decides, not the unused arguments.
    assert norm.normalization == "LayerNorm" and not norm.zero_centered_gamma


def test_build_norm_meta_device() -> None:
    config = _config(use_cpu_initialization=False, init_model_with_meta_device=True)
    norm = build_norm(config, 8)
    assert norm.weight.device.type == "meta"


def test_state_dict_matches_torch_layernorm() -> None:
    ours = FusedNorm(8)
    theirs = torch.nn.LayerNorm(8)
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    theirs.load_state_dict(ours.state_dict())


@pytest.mark.gpu
@pytest.mark.parametrize("normalization", NORMS)
def test_gpu_parity(
    cuda_device: torch.device, kernel_calls: dict[str, int], normalization: str
) -> None:
    """The Triton kernel on the GPU (``kernel_calls`` names both norms, so it takes this
    2M-element call below the default routing's threshold, and counts that it did)."""
    torch.manual_seed(0)
    norm = FusedNorm(
        4096, normalization=normalization, params_dtype=torch.bfloat16, device=cuda_device
    )
    _randomise(norm)
    x = torch.randn(512, 4096, device=cuda_device, dtype=torch.bfloat16)
    ref = norm_reference(x, norm.weight, norm.bias, norm.eps, normalization)
    torch.testing.assert_close(norm(x), ref, atol=5e-2, rtol=2e-2)
    assert kernel_calls["forward"] == 1


def _compare_with_reference(norm: FusedNorm, x: torch.Tensor, zero_centered: bool = False) -> None:
    """Forward, dx, dw (and db) of ``norm`` against fp32 autograd of the unfused math."""
    out = norm(x)
    assert out.dtype == x.dtype and out.shape == x.shape
    xr = x.detach().float().requires_grad_()
    wr = norm.weight.detach().float().requires_grad_()
    br = None if norm.bias is None else norm.bias.detach().float().requires_grad_()
    ref = norm_reference(xr, wr + 1 if zero_centered else wr, br, norm.eps, norm.normalization)
    tol = TOLERANCES[x.dtype]
    torch.testing.assert_close(out.float(), ref, atol=tol * 4, rtol=tol)
    grad = torch.randn(x.shape, device=x.device)
    out.backward(grad.to(x.dtype))
    ref.backward(grad)
    torch.testing.assert_close(x.grad.float(), xr.grad, atol=tol * 8, rtol=tol * 4)
    scale = wr.grad.abs().max().item() + 1
    torch.testing.assert_close(norm.weight.grad.float(), wr.grad, atol=tol * 4 * scale, rtol=tol)
    if br is not None:
        torch.testing.assert_close(norm.bias.grad.float(), br.grad, atol=tol * 4 * scale, rtol=tol)


@pytest.fixture
def kernel_calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts the Triton launches, so a test cannot pass on torch's kernels by accident; the
    kernel serves both norms here (by default only ``norm.TRITON_NORMS``)."""
    from megatron_rocm.runtime.kernels import norm_triton as _norm_triton

    monkeypatch.setenv(norm_module.TRITON_NORMS_ENV, ",".join(NORMS))

    calls = {"forward": 0, "backward": 0}
    for name, key in (("norm_forward", "forward"), ("norm_backward", "backward")):
        original = getattr(_norm_triton, name)

        def counted(*args, _original=original, _key=key, **kwargs):  # noqa: ANN002, ANN003, ANN202
            calls[_key] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(_norm_triton, name, counted)
    return calls


@triton_test
@pytest.mark.parametrize("normalization", NORMS)
@pytest.mark.parametrize("dtype", quick_few(list(TOLERANCES)))
@pytest.mark.parametrize("shape", quick_few([(3, 7), (37, 2, 64), (1, 33), (6, 1000)], keep=2))
@pytest.mark.parametrize("zero_centered", [False, True])
def test_triton_parity(
    kernel_calls: dict[str, int],
    normalization: str,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    zero_centered: bool,
) -> None:
    torch.manual_seed(0)
    norm = FusedNorm(
        shape[-1],
        normalization=normalization,
        zero_centered_gamma=zero_centered,
        params_dtype=dtype,
        device=DEVICE,
    )
    _randomise(norm)
    x = (torch.randn(shape, device=DEVICE) * 3 + 1).to(dtype).requires_grad_()
    _compare_with_reference(norm, x, zero_centered)
    assert kernel_calls == {"forward": 1, "backward": 1}


@triton_test
@pytest.mark.parametrize(
    ("normalization", "rows", "launches"),
    [("RMSNorm", 4, 1), ("RMSNorm", 3, 0), ("LayerNorm", 4, 0), ("LayerNorm", 8, 0)],
)
def test_default_routing_sends_large_rmsnorm_calls_to_triton(
    monkeypatch: pytest.MonkeyPatch, normalization: str, rows: int, launches: int
) -> None:
    """Production routing: RMSNorm calls of ``TRITON_NORM_MIN_ELEMENTS`` or more on the Triton
    kernel, smaller ones (where the host's cost per call outweighs the GPU's saving) and
    LayerNorm on torch's. The threshold is lowered to 4 rows of 64 so the interpreter can run it."""
    from megatron_rocm.runtime.kernels import norm_triton as _norm_triton

    monkeypatch.delenv(norm_module.TRITON_NORMS_ENV, raising=False)
    monkeypatch.setattr(norm_module, "TRITON_NORM_MIN_ELEMENTS", 4 * 64)
    calls = []
    original = _norm_triton.norm_forward
    monkeypatch.setattr(_norm_triton, "norm_forward", lambda *a: calls.append(1) or original(*a))
    norm = FusedNorm(64, normalization=normalization, device=DEVICE)
    norm(torch.randn(rows, 64, device=DEVICE))
    assert len(calls) == launches


@pytest.mark.parametrize(
    ("setting", "normalization", "elements", "served"),
    [
        (None, "RMSNorm", 1 << 24, True),
        (None, "RMSNorm", (1 << 24) - 1, False),
        (None, "LayerNorm", 1 << 30, False),
        ("RMSNorm", "RMSNorm", 1, True),
        ("LayerNorm", "LayerNorm", 1, True),
        ("LayerNorm", "RMSNorm", 1 << 30, False),
    ],
)
def test_triton_serves_by_size_unless_the_norms_are_named(
    monkeypatch: pytest.MonkeyPatch,
    setting: str | None,
    normalization: str,
    elements: int,
    served: bool,
) -> None:
    """Unset, the default norms go to Triton from ``TRITON_NORM_MIN_ELEMENTS`` (2**24) up; a
    ``MEGATRON_ROCM_TRITON_NORMS`` setting routes the norms it names at every size, and only
    those."""
    if setting is None:
        monkeypatch.delenv(norm_module.TRITON_NORMS_ENV, raising=False)
    else:
        monkeypatch.setenv(norm_module.TRITON_NORMS_ENV, setting)
    assert norm_module.TRITON_NORM_MIN_ELEMENTS == 1 << 24
    assert norm_module.triton_serves(normalization, elements) is served


@triton_test
@pytest.mark.parametrize(
    ("setting", "kernels", "launches"),
    [
        ("LayerNorm", "auto", {"LayerNorm": 1, "RMSNorm": 0}),
        ("RMSNorm,LayerNorm", "auto", dict.fromkeys(NORMS, 1)),
        ("RMSNorm,LayerNorm", "reference:norm", dict.fromkeys(NORMS, 0)),
    ],
)
def test_triton_norms_setting_routes_the_named_norms(
    monkeypatch: pytest.MonkeyPatch, setting: str, kernels: str, launches: dict[str, int]
) -> None:
    """``MEGATRON_ROCM_TRITON_NORMS`` replaces the default routing, for A/B runs in a model;
    ``MEGATRON_ROCM_KERNELS=reference:norm`` still puts every norm on torch's path."""
    from megatron_rocm.runtime.kernels import norm_triton as _norm_triton

    monkeypatch.setenv(norm_module.TRITON_NORMS_ENV, setting)
    monkeypatch.setenv("MEGATRON_ROCM_KERNELS", kernels)
    calls: list[str] = []
    original = _norm_triton.norm_forward
    for normalization in NORMS:
        monkeypatch.setattr(
            _norm_triton,
            "norm_forward",
            lambda *a, _n=normalization: calls.append(_n) or original(*a),
        )
        FusedNorm(64, normalization=normalization, device=DEVICE)(torch.randn(4, 64, device=DEVICE))
    assert {n: calls.count(n) for n in NORMS} == launches


@pytest.mark.parametrize(
    ("setting", "served"),
    [
        (None, ("RMSNorm",)),
        ("", ("RMSNorm",)),
        ("LayerNorm", ("LayerNorm",)),
        (" RMSNorm , LayerNorm ", ("RMSNorm", "LayerNorm")),
    ],
)
def test_triton_norms_setting_parses(
    monkeypatch: pytest.MonkeyPatch, setting: str | None, served: tuple[str, ...]
) -> None:
    if setting is None:
        monkeypatch.delenv(norm_module.TRITON_NORMS_ENV, raising=False)
    else:
        monkeypatch.setenv(norm_module.TRITON_NORMS_ENV, setting)
    assert norm_module.triton_norms() == served


@pytest.mark.parametrize("setting", ["LayerNrom", ",", "RMSNorm,ScaleNorm"])
def test_triton_norms_setting_typo_raises(monkeypatch: pytest.MonkeyPatch, setting: str) -> None:
    monkeypatch.setenv(norm_module.TRITON_NORMS_ENV, setting)
    with pytest.raises(
        ValueError, match="MEGATRON_ROCM_TRITON_NORMS=.*subset of LayerNorm, RMSNorm"
    ):
        norm_module.triton_norms()
    with pytest.raises(ValueError, match="MEGATRON_ROCM_TRITON_NORMS"):
        FusedNorm(8, normalization="RMSNorm")(torch.randn(2, 8))


@pytest.mark.parametrize(
    ("setting", "forced"),
    [
        ("auto", {None: False, "norm": False, "rope": False}),
        ("reference", {None: True, "norm": True, "rope": True}),
        ("reference:norm", {None: False, "norm": True, "rope": False}),
        ("reference: norm , rope", {None: False, "norm": True, "rope": True}),
    ],
)
def test_kernels_setting_selects_the_reference_per_kernel(
    monkeypatch: pytest.MonkeyPatch, setting: str, forced: dict[str | None, bool]
) -> None:
    from megatron_rocm.runtime.kernels import launch as _runtime

    monkeypatch.setenv("MEGATRON_ROCM_KERNELS", setting)
    assert {k: _runtime.reference_forced(k) for k in forced} == forced
    monkeypatch.setattr(_runtime, "triton_available", lambda: True)
    monkeypatch.setattr(_runtime, "interpreting", lambda: True)
    x = torch.empty(1)
    assert _runtime.use_triton(x, kernel="norm") is not forced["norm"]


@pytest.mark.parametrize("setting", ["refrence", "reference:", "reference:nrom", "torch:norm"])
def test_kernels_setting_typo_raises(monkeypatch: pytest.MonkeyPatch, setting: str) -> None:
    from megatron_rocm.runtime.kernels import launch as _runtime

    monkeypatch.setenv("MEGATRON_ROCM_KERNELS", setting)
    with pytest.raises(ValueError, match="MEGATRON_ROCM_KERNELS=.*expected 'auto'"):
        _runtime.reference_forced("norm")


@triton_test
def test_triton_non_contiguous_input(kernel_calls: dict[str, int]) -> None:
    """A transposed view (rows not contiguous) is normalised like its contiguous copy."""
    torch.manual_seed(1)
    norm = FusedNorm(48, normalization="RMSNorm", device=DEVICE)
    _randomise(norm)
    x = torch.randn(48, 10, device=DEVICE).t().requires_grad_()
    _compare_with_reference(norm, x)
    assert kernel_calls == {"forward": 1, "backward": 1}


@triton_test
@pytest.mark.parametrize("programs", quick_few([1, 3, 7, 64], keep=2))
@pytest.mark.parametrize("normalization", NORMS)
def test_triton_backward_splits_rows_over_programs(programs: int, normalization: str) -> None:
    """The row ranges of the backward's programs tile the rows exactly once, whatever the
    split (rows not divisible by programs; more programs than rows)."""
    from megatron_rocm.runtime.kernels import norm_triton as _norm_triton

    torch.manual_seed(2)
    rows, columns = 29, 40
    x = torch.randn(rows, columns, device=DEVICE)
    dy = torch.randn(rows, columns, device=DEVICE)
    w = torch.randn(columns, device=DEVICE)
    b = torch.randn(columns, device=DEVICE)
    is_rms = normalization == "RMSNorm"
    _, mean, rstd = _norm_triton.norm_forward(x, w, None if is_rms else b, 1e-5, is_rms)
    dx, dw, db = _norm_triton.norm_backward(dy, x, w, mean, rstd, not is_rms, is_rms, programs)
    xr, wr, br = (t.clone().requires_grad_() for t in (x, w, b))
    ref = norm_reference(xr, wr, None if is_rms else br, 1e-5, normalization)
    ref.backward(dy)
    torch.testing.assert_close(dx, xr.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dw, wr.grad, atol=1e-4, rtol=1e-5)
    if not is_rms:
        torch.testing.assert_close(db, br.grad, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize(
    ("x_dtype", "w_dtype", "columns", "reason"),
    [
        (torch.bfloat16, torch.bfloat16, 64, None),
        (torch.bfloat16, torch.float32, 64, "params in torch.float32 with input in torch.bfloat16"),
        (torch.float64, torch.float64, 64, "input dtype torch.float64"),
        (torch.float32, torch.float32, 65536, "rows of 65536 > 32768 columns"),
    ],
)
def test_triton_refuses_what_it_cannot_compute(
    x_dtype: torch.dtype, w_dtype: torch.dtype, columns: int, reason: str | None
) -> None:
    pytest.importorskip("triton")
    x = torch.empty(2, columns, dtype=x_dtype)
    assert norm_module._triton_unsupported(x, torch.empty(columns, dtype=w_dtype), None) == reason


def test_rocm_rows_past_8192_columns_take_torch(simulate_rocm: None) -> None:
    """On 64-wide waves the backward spills to scratch from 16384 columns (AMD compile gate)."""
    pytest.importorskip("triton")
    w = torch.empty(16384, dtype=torch.bfloat16)
    x = torch.empty(2, 16384, dtype=torch.bfloat16)
    assert norm_module._triton_unsupported(x, w, None) == "rows of 16384 > 8192 columns"
    assert norm_module._triton_unsupported(x[:, :8192], w[:8192], None) is None


def test_unsupported_mix_falls_back_to_torch_with_the_reason_logged(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Where Triton would run but cannot take the tensors, torch's kernel computes the same
    result and the reason is logged (once)."""
    pytest.importorskip("triton")
    monkeypatch.setattr(norm_module, "use_triton", lambda *tensors, kernel=None: True)
    monkeypatch.setattr("megatron_rocm.runtime.kernels.launch._logged", set())
    monkeypatch.setenv(norm_module.TRITON_NORMS_ENV, "RMSNorm")  # at this small size too
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    gamma = torch.randn(16, dtype=torch.float32)
    with caplog.at_level("WARNING", logger="megatron_rocm.runtime.kernels"):
        out = norm_module.apply_norm(x, gamma, None, 1e-5, "RMSNorm")
        norm_module.apply_norm(x, gamma, None, 1e-5, "RMSNorm")
    expected = torch.nn.functional.rms_norm(x, (16,), gamma, 1e-5)
    torch.testing.assert_close(out, expected)
    messages = [r.getMessage() for r in caplog.records]
    assert messages == [
        "megatron-rocm: RMSNorm on torch's kernels: params in torch.float32 with input in "
        "torch.bfloat16"
    ]
