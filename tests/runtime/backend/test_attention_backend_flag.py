"""``--attention-backend`` picks the native kernels of the same family on every attention path."""

from __future__ import annotations

import contextlib
import enum
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from te_attention_oracle import attention_reference_te  # noqa: E402

from megatron_rocm.runtime.backend import attention_backend_flag as attention_backend  # noqa: E402
from megatron_rocm.runtime.backend.cp import dispatch as context_parallel  # noqa: E402
from megatron_rocm.runtime.backend.cp.block_attention import pick_kernel  # noqa: E402
from megatron_rocm.runtime.backend.dot_product_attention import TEDotProductAttention  # noqa: E402
from megatron_rocm.runtime.backend.packed.thd_attention import last_implementation  # noqa: E402

pytestmark = pytest.mark.torch


class AttnBackend(enum.Enum):  # the shape of upstream's enum: the flag's value is its name
    flash = 1
    fused = 2
    unfused = 3
    local = 4
    auto = 5


@pytest.fixture(autouse=True)
def no_kernel_env(monkeypatch):
    for env in attention_backend._KERNEL_ENVS:
        monkeypatch.delenv(env, raising=False)


def attention(backend: AttnBackend | None, cp: int = 1) -> TEDotProductAttention:
    config = SimpleNamespace(
        kv_channels=16, attention_dropout=0.0, window_size=None, softmax_type="vanilla",
        num_attention_heads=4, tensor_model_parallel_size=1, context_parallel_size=cp,
        attention_backend=backend,
    )  # fmt: skip
    groups = SimpleNamespace(cp=object() if cp > 1 else None, tp=None)
    return TEDotProductAttention(
        config, layer_number=1, attn_mask_type="causal", attention_type="self",
        pg_collection=groups,
    )  # fmt: skip


def qkv(s: int = 12, b: int = 2) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(s, b, 4, 16, generator=g) for _ in range(3))


@pytest.mark.parametrize(
    ("backend", "sdpa", "blocks", "packed"),
    [
        (AttnBackend.flash, "flash", ("flash",), "flash"),
        (AttnBackend.fused, "cudnn,efficient", ("cudnn", "efficient"), "sdpa_loop"),
        (AttnBackend.unfused, "math", ("math",), "sdpa_loop"),
    ],
)
def test_each_backend_names_its_kernels(backend, sdpa, blocks, packed):
    choice = attention_backend.resolve(SimpleNamespace(attention_backend=backend))
    assert (choice.sdpa, choice.cp_blocks, choice.packed) == (sdpa, blocks, packed)
    assert attention_backend.resolve(SimpleNamespace(attention_backend=backend.name)) == choice


@pytest.mark.parametrize("config", [SimpleNamespace(), SimpleNamespace(attention_backend=None),
                                    SimpleNamespace(attention_backend=AttnBackend.auto)])  # fmt: skip
def test_auto_or_no_field_leaves_the_choice_to_each_path(config):
    assert attention_backend.resolve(config) is None


def test_local_is_not_a_kernel_of_the_te_spec():
    with pytest.raises(ValueError, match="--attention-backend local is not a kernel"):
        attention(AttnBackend.local)


@pytest.mark.parametrize("env", ["MEGATRON_ROCM_CP_KERNEL", "MEGATRON_ROCM_PACKED_ATTENTION"])
def test_a_kernel_variable_at_auto_chooses_nothing(monkeypatch, env):
    monkeypatch.setenv(env, "auto")
    kernels = attention(AttnBackend.unfused).kernels  # the flag's choice stands
    assert (kernels.sdpa, kernels.cp_blocks, kernels.packed) == ("math", ("math",), "sdpa_loop")


@pytest.mark.parametrize("env", ["MEGATRON_ROCM_SDPA_BACKENDS", "MEGATRON_ROCM_CP_KERNEL",
                                 "MEGATRON_ROCM_PACKED_ATTENTION"])  # fmt: skip
def test_the_flag_and_a_kernel_variable_together_are_refused(monkeypatch, env):
    monkeypatch.setenv(env, "math")
    with pytest.raises(ValueError, match=f"--attention-backend unfused and {env} both choose"):
        attention(AttnBackend.unfused)
    assert attention(AttnBackend.auto).kernels is None  # the variable alone stays usable


def _sdpa_enabled() -> dict[str, bool]:
    cuda = torch.backends.cuda
    return {
        "flash": cuda.flash_sdp_enabled(),
        "efficient": cuda.mem_efficient_sdp_enabled(),
        "cudnn": cuda.cudnn_sdp_enabled(),
        "math": cuda.math_sdp_enabled(),
    }


def record_sdpa(monkeypatch) -> list[set[str]]:
    """The SDPA kernels enabled at each call of torch's SDPA itself (which then runs)."""
    from megatron_rocm.runtime.backend import te_sdpa as sdpa

    seen: list[set[str]] = []
    real = sdpa.F.scaled_dot_product_attention

    def recording(*args, **kwargs):
        seen.append({name for name, on in _sdpa_enabled().items() if on})
        return real(*args, **kwargs)

    monkeypatch.setattr(sdpa.F, "scaled_dot_product_attention", recording)
    return seen


@pytest.mark.parametrize(
    ("backend", "enabled"),
    [(AttnBackend.unfused, {"math"}), (AttnBackend.fused, {"cudnn", "efficient"}),
     (AttnBackend.flash, {"flash"})],
)  # fmt: skip
def test_dense_attention_runs_sdpa_on_the_named_kernels_only(monkeypatch, backend, enabled):
    seen = record_sdpa(monkeypatch)
    before = _sdpa_enabled()
    q, k, v = qkv()
    if backend is AttnBackend.unfused:  # the CPU can run math: check the result as well
        out = attention(backend)(q, k, v, attention_mask=None)
        ref = attention_reference_te(q, k, v, mask_type="causal")
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    else:  # whether a CPU build runs these kernels is torch's business: what SDPA saw counts
        with contextlib.suppress(RuntimeError):
            attention(backend)(q, k, v, attention_mask=None)
    assert seen == [enabled]
    assert _sdpa_enabled() == before  # restored afterwards


def test_auto_leaves_sdpa_free_to_choose(monkeypatch):
    seen = record_sdpa(monkeypatch)
    before = {name for name, on in _sdpa_enabled().items() if on}
    attention(AttnBackend.auto)(*qkv(), attention_mask=None)
    assert seen == [before]


def test_context_parallel_blocks_follow_the_flag(monkeypatch):
    asked = []
    monkeypatch.setattr(
        context_parallel,
        "context_parallel_attention",
        lambda *a, **kw: asked.append(kw["kernel_order"]) or torch.zeros(1),
    )
    attention(AttnBackend.fused, cp=2)(*qkv(), attention_mask=None)
    attention(AttnBackend.auto, cp=2)(*qkv(), attention_mask=None)
    assert asked == [("cudnn", "efficient"), None]


def test_block_kernel_order_takes_the_first_that_runs_or_says_why_none_does():
    q, k, v = (x.permute(1, 2, 0, 3) for x in qkv())
    assert pick_kernel(q, k, v, 0.0, ("math",)).name == "math"
    with pytest.raises(ValueError, match="no kernel that --attention-backend names runs"):
        pick_kernel(q, k, v, 0.0, ("cudnn", "efficient"))


def _packed_params() -> SimpleNamespace:
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    return SimpleNamespace(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=7, max_seqlen_kv=7
    )


def test_packed_sequences_follow_the_flag(monkeypatch):
    seen = record_sdpa(monkeypatch)
    q, k, v = (x[:, 0] for x in qkv())  # [t, heads, dim]
    attention(AttnBackend.unfused)(q, k, v, attention_mask=None, packed_seq_params=_packed_params())
    assert last_implementation() == "sdpa_loop"
    assert seen and all(kernels == {"math"} for kernels in seen)  # one SDPA per document
    with pytest.raises(RuntimeError, match="packed attention 'flash' was requested but"):
        attention(AttnBackend.flash)(
            q, k, v, attention_mask=None, packed_seq_params=_packed_params()
        )


@pytest.mark.parametrize(("mask_type", "masked"), [("causal", False), ("padding", True)])
def test_flash_takes_no_mask_tensor_so_masked_attention_runs_efficient(
    monkeypatch, mask_type, masked
):
    """TE's flash attention unpads a padding mask itself; SDPA's flash kernel cannot take one,
    so that attention moves to the memory-efficient kernel and says so."""
    from megatron_rocm.runtime.backend import te_sdpa as sdpa

    seen = []
    monkeypatch.setattr(
        sdpa.F,
        "scaled_dot_product_attention",
        lambda *a, **kw: (seen.append(_sdpa_enabled()), torch.zeros(2, 4, 12, 16))[1],
    )
    logged: list[str] = []
    monkeypatch.setattr(sdpa, "log_fallback_once", lambda key, message: logged.append(message))
    q, k, v = qkv()
    mask = torch.zeros(2, 1, 12, 12, dtype=torch.bool) if masked else None
    sdpa.sdpa_sbhd(q, k, v, mask_type=mask_type, attention_mask=mask, kernels="flash")
    on = {name for name, enabled in seen[0].items() if enabled}
    assert on == ({"efficient"} if masked else {"flash"})
    assert len(logged) == int(masked)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", [AttnBackend.flash, AttnBackend.fused, AttnBackend.unfused])
@pytest.mark.parametrize("masked", [False, True])
def test_gpu_each_backend_matches_the_reference(backend, masked):
    """On the GPU's own kernels, forward and backward, with and without a padding mask."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA/ROCm GPU")
    g = torch.Generator().manual_seed(1)
    q, k, v = (
        torch.randn(256, 2, 4, 64, generator=g).cuda().bfloat16().requires_grad_() for _ in range(3)
    )
    module = attention(backend)
    module.k_channels = module.v_channels = 64
    module.softmax_scale = 64**-0.5
    mask = None
    if masked:
        mask = torch.zeros(2, 1, 1, 256, dtype=torch.bool, device="cuda")
        mask[1, ..., 200:] = True  # the second sample's last keys are padding
        module.attn_mask_type = "padding_causal"
    out = module(q, k, v, attention_mask=mask)
    mask_type = "padding_causal" if masked else "causal"
    leaves = [x.detach().float().requires_grad_() for x in (q, k, v)]
    ref = attention_reference_te(*leaves, mask_type=mask_type, attention_mask=mask)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(ref, leaves, grad.float())
    for mine, theirs in zip(got, want, strict=True):
        torch.testing.assert_close(mine.float(), theirs, atol=5e-2, rtol=5e-2)
