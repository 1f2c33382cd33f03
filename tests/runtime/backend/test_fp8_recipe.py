"""Which native linears train in FP8: the recipe from the config, the layers kept in bf16."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from megatron_rocm.runtime.backend import fp8  # noqa: E402

pytestmark = pytest.mark.torch
WEIGHT = torch.empty(64, 32)


def config(**kw):  # noqa: ANN003, ANN201
    base = dict(fp8="hybrid", fp8_recipe="tensorwise", num_layers=4, fp8_margin=0,
                fp8_wgrad=True, first_last_layers_bf16=False)  # fmt: skip
    return SimpleNamespace(**{**base, **kw})


def test_recipe_from_the_config() -> None:
    recipe = fp8.module_recipe("X", config(fp8="e4m3", fp8_margin=1, fp8_wgrad=False), WEIGHT)
    assert recipe.formats.backward == torch.float8_e4m3fn
    assert recipe.margin == 1 and recipe.wgrad_in_fp8 is False
    assert fp8.module_recipe("X", config(fp8=None), WEIGHT) is None


def test_an_enum_recipe_is_read_by_value() -> None:
    tensorwise = SimpleNamespace(value="tensorwise")
    assert fp8.module_recipe("X", config(fp8_recipe=tensorwise), WEIGHT) is not None


def test_delayed_scaling_gives_each_linear_its_own_histories() -> None:
    cfg = config(fp8_recipe="delayed", fp8_amax_history_len=1024, fp8_amax_compute_algo="max")
    one, two = (fp8.module_recipe("X", cfg, WEIGHT) for _ in range(2))
    assert one.history("input") is not two.history("input")
    for name in ("input", "weight", "grad_output"):
        history = one.history(name)
        assert (history.length, history.most_recent) == (1024, False)
    assert fp8.module_recipe("X", config(), WEIGHT).history("input") is None  # tensorwise
    upstream_default = config(fp8_recipe="delayed", fp8_amax_history_len=1,
                              fp8_amax_compute_algo="most_recent")  # fmt: skip
    assert fp8.module_recipe("X", upstream_default, WEIGHT).history("weight").most_recent


@pytest.mark.parametrize("recipe", ["mxfp8", "custom"])
def test_other_recipes_are_refused_when_the_module_is_built(recipe) -> None:
    with pytest.raises(ValueError, match=f"{recipe} needs TransformerEngine") as info:
        fp8.module_recipe("TELinear", config(fp8_recipe=recipe), WEIGHT)
    assert "\n" not in str(info.value)


def test_gemm_sizes_are_checked_when_the_module_is_built() -> None:
    with pytest.raises(ValueError, match="divisible by 16"):
        fp8.module_recipe("X", config(), torch.empty(64, 24))


@pytest.mark.parametrize(("layer", "bf16"), [(0, True), (1, False), (2, True), (3, True)])
def test_first_last_layers_are_built_bf16(layer, bf16) -> None:
    cfg = config(first_last_layers_bf16=True, num_layers_at_start_in_bf16=1,
                 num_layers_at_end_in_bf16=2)  # fmt: skip
    with fp8.layer_context(cfg, layer, is_init=True):
        assert (fp8.module_recipe("X", cfg, WEIGHT) is None) is bf16
    assert fp8.module_recipe("X", cfg, WEIGHT) is not None  # outside a layer: the config's


def test_forward_contexts_and_bf16_runs_change_nothing() -> None:
    cfg = config(first_last_layers_bf16=True, num_layers_at_start_in_bf16=1,
                 num_layers_at_end_in_bf16=0)  # fmt: skip
    with fp8.layer_context(cfg, 0, is_init=False):  # the forward's: modules decided already
        assert fp8.module_recipe("X", cfg, WEIGHT) is not None
    with fp8.layer_context(config(fp8=None), 0, is_init=True):
        assert fp8.module_recipe("X", cfg, WEIGHT) is not None


def _linear(**kw):  # noqa: ANN003, ANN201 - what parallel_forward reads of a Megatron linear
    weight = torch.nn.Parameter(torch.randn(32, 16))
    base = dict(weight=weight, output_size=32, input_size=16, sequence_parallel=False,
                gtp_remat_size=1, config=SimpleNamespace(cpu_offloading=False),
                gradient_accumulation_fusion=False, skip_bias_add=False, bias=None,
                fp8_recipe=fp8.module_recipe("X", config(), weight))  # fmt: skip
    return SimpleNamespace(**{**base, **kw})


def test_parallel_forward_runs_the_fp8_gemm_and_the_bias() -> None:
    bias = torch.nn.Parameter(torch.randn(32))
    x = torch.randn(4, 16)
    linear = _linear(bias=bias)
    out, out_bias = fp8.parallel_forward(linear, x, "column")
    want = fp8.fp8_linear(x, linear.weight, False, linear.fp8_recipe) + bias
    assert out_bias is None and torch.equal(out, want)
    out, out_bias = fp8.parallel_forward(_linear(bias=bias, skip_bias_add=True), x, "row")
    assert out_bias is bias


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"gtp_remat_size": 2}, "GTP"),
        ({"config": SimpleNamespace(cpu_offloading=True)}, "CPU offloading"),
        ({"gradient_accumulation_fusion": True}, "no main_grad"),
    ],
)
def test_parallel_forward_refuses_more_than_a_gemm(change, named) -> None:
    with pytest.raises(ValueError, match=named) as info:
        fp8.parallel_forward(_linear(**change), torch.randn(4, 16), "column")
    assert "\n" not in str(info.value)


def _weight_quantizes(monkeypatch) -> list[int]:  # noqa: ANN001
    """Counts the quantizes of a [32, 16] weight (the inputs are [4, 16])."""
    calls: list[int] = []
    for name in ("quantize", "quantize_transposed"):
        real = getattr(fp8, name)

        def spy(x, *a, real=real, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
            if tuple(x.shape) == (32, 16):
                calls.append(1)
            return real(x, *a, **kw)

        monkeypatch.setattr(fp8, name, spy)
    return calls


def test_later_micro_batches_reuse_the_first_ones_fp8_weight(monkeypatch) -> None:
    """TE's parameter cache, as Megatron's schedules drive it (``is_first_microbatch``)."""
    calls = _weight_quantizes(monkeypatch)
    linear = _linear(is_first_microbatch=True)
    x = torch.randn(4, 16, requires_grad=True)
    first, _ = fp8.parallel_forward(linear, x, "column")
    again, _ = fp8.parallel_forward(linear, x, "column")  # a later micro-batch of the step
    assert len(calls) == 1 and torch.equal(first, again)
    again.sum().backward()  # the cached transpose serves the input gradient
    assert x.grad is not None
    with torch.no_grad():
        linear.weight.mul_(2)  # the optimizer's step
    linear.is_first_microbatch = True  # the next step's first micro-batch
    doubled, _ = fp8.parallel_forward(linear, x, "column")
    assert len(calls) == 2 and torch.allclose(doubled, 2 * first, rtol=0.13)


def test_the_cache_is_off_with_disable_parameter_transpose_cache(monkeypatch) -> None:
    calls = _weight_quantizes(monkeypatch)
    config = SimpleNamespace(cpu_offloading=False, disable_parameter_transpose_cache=True)
    linear = _linear(is_first_microbatch=True, config=config)
    for _ in range(3):
        fp8.parallel_forward(linear, torch.randn(4, 16), "column")
    assert len(calls) == 3 and linear.fp8_recipe.weight_cache.quantized is None


def test_a_moved_weight_or_a_missing_transpose_is_quantized_again(monkeypatch) -> None:
    calls = _weight_quantizes(monkeypatch)
    linear = _linear(is_first_microbatch=True)
    with torch.no_grad():
        fp8.parallel_forward(linear, torch.randn(4, 16), "column")  # evaluation: no transpose kept
    fp8.parallel_forward(linear, torch.randn(4, 16, requires_grad=True), "column")  # needs it
    linear.weight.data = linear.weight.data.clone()  # new storage
    fp8.parallel_forward(linear, torch.randn(4, 16), "column")
    assert len(calls) == 3


def test_fp8_interval_is_ignored_with_a_warning_as_te_does() -> None:
    cfg = config(fp8_recipe="delayed", fp8_amax_history_len=4, fp8_amax_compute_algo="max",
                 fp8_interval=2)  # fmt: skip
    with pytest.warns(UserWarning, match="--fp8-interval is deprecated and ignored"):
        assert fp8.module_recipe("X", cfg, WEIGHT).history("input").length == 4
