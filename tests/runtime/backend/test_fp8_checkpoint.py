"""Delayed scaling's amax histories in checkpoints (``backend.fp8_checkpoint``).

The oracle is the run that never stopped: a linear trained some steps, its state dict saved
and loaded into a fresh one, must then compute what the original computes, bit for bit
(output, input and weight gradients), where a fresh start would scale its first quantizes by
their own amax. TE's reader of ``_extra_state`` is ``pickle.loads`` of the bytes.
"""

from __future__ import annotations

import io
import pickle

import pytest

torch = pytest.importorskip("torch")

from megatron_rocm.runtime.backend import fp8 as backend_fp8  # noqa: E402
from megatron_rocm.runtime.backend import fp8_checkpoint, fp8_param  # noqa: E402
from megatron_rocm.runtime.backend._extra_state import NoFp8ExtraState  # noqa: E402
from megatron_rocm.runtime.kernels import fp8  # noqa: E402

pytestmark = pytest.mark.torch
OUT, IN, TOKENS = 32, 64, 48
FORMATS = fp8.formats("hybrid", arch="cpu")
# input magnitudes a step: the history's largest amax (max over 16) stays above the last
# steps' own, so a delayed scale differs from the current one
STEPS = [8.0, 1.0, 0.5, 2.0]


class _Linear(fp8_checkpoint.DelayedScalingCheckpoint, NoFp8ExtraState):
    """A native linear's FP8 path and checkpoint contract, without Megatron's parallel parts."""

    def __init__(self, weight: torch.Tensor, delayed: bool = True, length: int = 16) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight.clone())
        self.fp8_recipe = _recipe(delayed, length)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return backend_fp8.fp8_linear(x, self.weight, False, self.fp8_recipe)


def _recipe(delayed: bool, length: int = 16) -> backend_fp8.Fp8Recipe:
    histories = backend_fp8.DelayedScaling(
        *(fp8.AmaxHistory(length, most_recent=False) for _ in range(3))
    )
    return backend_fp8.Fp8Recipe(formats=FORMATS, delayed=histories if delayed else None)


def _weight(seed: int = 0) -> torch.Tensor:
    return (torch.randn(OUT, IN, generator=torch.Generator().manual_seed(seed)) * 0.1).bfloat16()


def _step(linear: _Linear, magnitude: float, seed: int) -> tuple[torch.Tensor, ...]:
    """One forward and backward; the output and both gradients."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(TOKENS, IN, generator=gen) * magnitude).bfloat16().requires_grad_()
    dy = (torch.randn(TOKENS, OUT, generator=gen) * magnitude).bfloat16()
    linear.weight.grad = None
    y = linear(x)
    y.backward(dy)
    return y.detach(), x.grad, linear.weight.grad


def _trained(steps: list[float] = STEPS, **kw) -> _Linear:  # noqa: ANN003
    linear = _Linear(_weight(), **kw)
    for i, magnitude in enumerate(steps):
        _step(linear, magnitude, seed=i)
    return linear


def _saved(module: torch.nn.Module) -> dict:
    buffer = io.BytesIO()
    torch.save(module.state_dict(), buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _same(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> bool:
    return all(torch.equal(u, v) for u, v in zip(a, b, strict=True))


def test_a_resumed_linear_computes_what_the_uninterrupted_one_does() -> None:
    straight = _trained()
    resumed = _Linear(_weight(seed=1))
    resumed.load_state_dict(_saved(straight))
    for name in ("input", "weight", "grad_output"):
        a, b = straight.fp8_recipe.history(name), resumed.fp8_recipe.history(name)
        assert b.started and torch.equal(a.history, b.history) and torch.equal(a.pos, b.pos)
        assert torch.equal(a.current, b.current) and torch.equal(a.scale, b.scale)
    for i in range(3):
        assert _same(_step(straight, 0.25, seed=10 + i), _step(resumed, 0.25, seed=10 + i))


def test_without_the_histories_the_next_step_differs() -> None:
    """The case above is not vacuous: a fresh start (the state TE leaves for a checkpoint
    without FP8 state) computes something else."""
    straight = _trained()
    fresh = _Linear(_weight(seed=1))
    state = _saved(straight)
    state["_extra_state"] = torch.empty(0, dtype=torch.uint8)
    fresh.load_state_dict(state)
    assert not fresh.fp8_recipe.history("input").started
    assert not _same(_step(straight, 0.25, seed=10), _step(fresh, 0.25, seed=10))


def test_te_reads_the_value_as_no_fp8_state() -> None:
    """TE's ``set_extra_state`` unpickles the bytes and returns on None."""
    state = _trained().state_dict()["_extra_state"]
    assert state.dtype == torch.uint8 and state.numel() > 100
    assert pickle.loads(state.numpy().tobytes()) is None


def test_upstreams_drop_of_redundant_extra_state_keeps_the_value() -> None:
    """``--ckpt-drop-redundant-extra-state`` keeps a value whose raw bytes name one of TE's
    delayed-scaling keys (``amax_history_fwd``, ``scale_fwd``, ``scale_bwd``)."""
    raw = _trained().state_dict()["_extra_state"].numpy().tobytes()
    assert b"amax_history_fwd" in raw


def test_a_fresh_delayed_linear_saves_a_payload_and_current_scaling_none() -> None:
    """Upstream's ``--ckpt-drop-redundant-extra-state`` asks the loading (fresh) model's
    values which entries to read: a delayed linear's must name the marker before its first
    quantize too. Current scaling has no state: the module's value without FP8."""
    fresh = _Linear(_weight()).state_dict()["_extra_state"]
    assert b"amax_history_fwd" in fresh.numpy().tobytes()
    assert pickle.loads(fresh.numpy().tobytes()) is None
    restored = _Linear(_weight())
    restored.set_extra_state(fresh)
    assert not restored.fp8_recipe.history("input").started  # nothing had started
    tensorwise = _trained(delayed=False).state_dict()["_extra_state"]
    assert tensorwise.dtype == torch.uint8 and tensorwise.numel() == 0


@pytest.mark.parametrize(
    "state",
    [
        None,
        torch.empty(0, dtype=torch.uint8),
        torch.frombuffer(
            bytearray(pickle.dumps({"recipe": "TE's", "scale_fwd": 1.0})), dtype=torch.uint8
        ),
        io.BytesIO(b"TE 1.x"),
    ],
    ids=["none", "empty", "te-payload", "bytesio"],
)
def test_other_values_leave_the_histories_to_start_again(state) -> None:  # noqa: ANN001
    linear = _Linear(_weight())
    linear.set_extra_state(state)
    assert not any(linear.fp8_recipe.history(n).started for n in ("input", "weight"))


def test_a_run_without_delayed_scaling_loads_saved_histories_and_ignores_them() -> None:
    """A tensorwise run resumed from a delayed-scaling checkpoint computes what a tensorwise
    linear given the same weight computes."""
    state = _saved(_trained())
    loaded, plain = _Linear(_weight(seed=1), delayed=False), _Linear(_weight(seed=1), delayed=False)
    loaded.load_state_dict(state)
    plain.load_state_dict({"weight": state["weight"]}, strict=False)
    assert _same(_step(loaded, 0.25, seed=10), _step(plain, 0.25, seed=10))


def test_a_damaged_payload_is_one_clear_error() -> None:
    good = _trained().state_dict()["_extra_state"]
    damaged = good[: good.numel() // 2].clone()
    with pytest.raises(ValueError, match="FP8 amax histories in the checkpoint are unreadable"):
        _Linear(_weight()).set_extra_state(damaged)


@pytest.mark.parametrize(
    ("saved", "pos", "length", "want", "want_pos"),
    [
        ([5.0, 6.0, 3.0, 4.0], 2, 4, [5.0, 6.0, 3.0, 4.0], 2),  # same length: as saved
        ([5.0, 6.0, 3.0, 4.0], 2, 2, [5.0, 6.0], 0),  # shorter: the two newest, oldest first
        ([5.0, 6.0, 3.0, 4.0], 2, 6, [3.0, 4.0, 5.0, 6.0, 0.0, 0.0], 4),  # longer: all of them
        # not yet full: its empty entries are the oldest, and the next amax overwrites one
        ([1.0, 2.0, 0.0, 0.0], 2, 3, [0.0, 1.0, 2.0], 0),
    ],
)
def test_a_history_of_another_length_keeps_the_newest_amaxes(
    saved, pos, length, want, want_pos
) -> None:  # noqa: ANN001
    """``--fp8-amax-history-len`` changed between the runs; the ring's oldest entry is at
    ``pos`` (the next slot)."""
    ring, at = fp8_checkpoint._fit(torch.tensor(saved), pos, length)
    assert ring.tolist() == want and at == want_pos


def test_a_longer_history_after_the_resume_still_scales_by_the_saved_amaxes() -> None:
    straight = _trained()
    longer = _Linear(_weight(), length=64)
    longer.load_state_dict(_saved(straight))
    saved, history = straight.fp8_recipe.history("input"), longer.fp8_recipe.history("input")
    kept = history.history[history.history > 0]
    assert history.history.numel() == 64 and torch.equal(kept, saved.history[saved.history > 0])
    assert _same(_step(straight, 0.25, seed=10), _step(longer, 0.25, seed=10))


def test_the_restore_is_in_place_for_a_captured_graph() -> None:
    straight = _trained()
    resumed = _trained(steps=[1.0])
    tensors = resumed.fp8_recipe.history("input").history
    resumed.load_state_dict(_saved(straight))
    assert resumed.fp8_recipe.history("input").history is tensors


def _fp8_weight_resumed() -> tuple[_Linear, _Linear]:
    """A linear with an FP8 weight (``--fp8-param-gather``) whose bytes an optimizer step
    cast with its history's scale, which is above the new weight's own; and a fresh one that
    loaded its state dict (the weight dequantized)."""
    straight = _trained()
    fp8_param.convert_weight(straight, straight.fp8_recipe)
    _step(straight, 0.25, seed=20)
    with torch.no_grad():  # the distributed optimizer's shard cast: the whole weight here
        fp8_param.quantize_param_shard(
            [straight.weight], [_weight(seed=3).float() * 0.5], [0], None
        )
    resumed = _Linear(_weight(seed=1))
    fp8_param.convert_weight(resumed, resumed.fp8_recipe)
    resumed.load_state_dict(_saved(straight))
    return straight, resumed


def test_an_fp8_weight_loads_back_to_the_bytes_it_was_saved_with() -> None:
    """The load quantizes the dequantized weight with the restored history's scale."""
    straight, resumed = _fp8_weight_resumed()
    saved, loaded = straight.weight._fp8, resumed.weight._fp8
    assert torch.equal(loaded.data, saved.data) and torch.equal(loaded.scale_inv, saved.scale_inv)
    assert _same(_step(straight, 0.25, seed=21), _step(resumed, 0.25, seed=21))


def test_without_the_recast_an_fp8_weight_would_load_other_bytes(monkeypatch) -> None:  # noqa: ANN001
    """The case above is not vacuous: quantizing the loaded weight by its own amax (what the
    load does before the history arrives) gives another scale."""
    monkeypatch.setattr(fp8_checkpoint, "recast_loaded_weight", lambda *args: None)
    straight, resumed = _fp8_weight_resumed()
    assert not torch.equal(resumed.weight._fp8.scale_inv, straight.weight._fp8.scale_inv)


def test_an_fp8_weight_saved_before_its_first_optimizer_step_loads_back_to_its_bytes() -> None:
    """Saved right after it was built (or loaded): its bytes were cast by its own amax, and
    its history's scale is that scale, which the load's recast uses."""
    straight = _Linear(_weight())
    fp8_param.convert_weight(straight, straight.fp8_recipe)
    resumed = _Linear(_weight(seed=1))
    fp8_param.convert_weight(resumed, resumed.fp8_recipe)
    resumed.load_state_dict(_saved(straight))
    saved, loaded = straight.weight._fp8, resumed.weight._fp8
    assert torch.equal(loaded.data, saved.data) and torch.equal(loaded.scale_inv, saved.scale_inv)


def test_a_weight_of_another_shape_is_torchs_size_mismatch() -> None:
    straight = _trained()
    fp8_param.convert_weight(straight, straight.fp8_recipe)
    other = _Linear(_weight()[:, : IN // 2].contiguous())
    fp8_param.convert_weight(other, other.fp8_recipe)
    with pytest.raises(RuntimeError, match="size mismatch for weight"):
        other.load_state_dict(_saved(straight))
