"""``config.deterministic_mode`` on the native attention, as upstream's TE wrapper holds it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from megatron_rocm.runtime.backend.dot_product_attention import TEDotProductAttention  # noqa: E402
from megatron_rocm.runtime.kernels import launch as _runtime  # noqa: E402

pytestmark = pytest.mark.torch


def build(deterministic: bool) -> TEDotProductAttention:
    config = SimpleNamespace(
        kv_channels=16, attention_dropout=0.0, window_size=None, softmax_type="vanilla",
        num_attention_heads=4, tensor_model_parallel_size=1, context_parallel_size=1,
        deterministic_mode=deterministic,
    )  # fmt: skip
    return TEDotProductAttention(
        config, layer_number=1, attn_mask_type="causal", attention_type="self",
        pg_collection=SimpleNamespace(cp=None, tp=None),
    )  # fmt: skip


@pytest.fixture
def torch_flag():
    """Set torch's deterministic flag for one test, and put it back."""
    before = torch.are_deterministic_algorithms_enabled()
    yield torch.use_deterministic_algorithms
    torch.use_deterministic_algorithms(before)


@pytest.fixture
def logged(monkeypatch):
    lines: list[str] = []
    monkeypatch.setattr(_runtime, "log_fallback_once", lambda key, message: lines.append(message))
    return lines


def test_without_either_switch_it_raises_as_upstream_does(monkeypatch, torch_flag):
    monkeypatch.delenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", raising=False)
    torch_flag(False)
    with pytest.raises(RuntimeError, match="deterministic_mode is on, but neither"):
        build(deterministic=True)
    build(deterministic=False)  # nothing asked, nothing checked


def test_torchs_flag_is_what_makes_the_native_kernels_deterministic(
    monkeypatch, torch_flag, logged
):
    monkeypatch.delenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", raising=False)
    torch_flag(True)
    build(deterministic=True)
    assert logged == []


def test_tes_switch_alone_is_accepted_and_said(monkeypatch, torch_flag, logged):
    monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
    torch_flag(False)
    build(deterministic=True)
    assert len(logged) == 1 and "torch.use_deterministic_algorithms(True)" in logged[0]
