"""The native TE grouped linears under upstream's own ``TEGroupedMLP``, per megatron-core release.

The driver test (``upstream``) extracts ``megatron/core`` from each release's PyPI sdist and runs
this module again in a child pytest with it importable; there every other test runs on the CPU
in a one-process gloo world (two processes for the expert-parallel test):

* upstream's ``TEGroupedMLP`` on our classes computes exactly what upstream's ``SequentialMLP``
  (one local linear per expert) computes from the same weights, forward and backward, and
  writes the same checkpoint layout (upstream says the two are interchangeable);
* the wrappers' contract: parameter names and attributes, keywords, refusals, biases,
  gradient-accumulation fusion, and the checkpoint forms TE accepts on load.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import os
import socket
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.torch
# One release per era of the wrappers (process groups, checkpoint layout, parameter attributes).
RELEASES = ["0.12.3", "0.14.0", "0.16.1", "0.17.1", "0.19.2"]
HIDDEN, FFN, EXPERTS = 32, 24, 4
SPLITS = [3, 0, 6, 2]  # uneven, one expert without tokens
MEGATRON_HERE = importlib.util.find_spec("megatron") is not None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def mc():  # noqa: ANN201 - the megatron.core package
    core = pytest.importorskip("megatron.core", reason="runs in the per-release child pytest")
    if getattr(core, "__file__", None) is None:  # a namespace package: some folder, not a tree
        pytest.skip("runs in the per-release child pytest (no real megatron.core here)")
    return core


@pytest.fixture(scope="module")
def world(mc):  # noqa: ANN001, ANN201
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1
    )
    ps.initialize_model_parallel(1, 1)
    yield ps
    ps.destroy_model_parallel()
    dist.destroy_process_group()


def version() -> tuple[int, int]:
    from megatron_rocm.runtime.backend._grouped_compat import megatron_version

    return megatron_version()


def make_config(**overrides):  # noqa: ANN003, ANN201
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    kw = dict(
        num_layers=1,
        hidden_size=HIDDEN,
        num_attention_heads=4,
        num_moe_experts=EXPERTS,
        moe_ffn_hidden_size=FFN,
        use_cpu_initialization=True,
        add_bias_linear=False,
        bias_activation_fusion=False,
        gradient_accumulation_fusion=False,
    )
    kw.update(overrides)
    return TransformerConfig(**{k: v for k, v in kw.items() if k in fields})


def groups_kwarg(cls: type) -> dict:
    """The process-group argument the tag's MoE modules take (none, model_comm_pgs, pg_collection)."""
    import megatron.core.process_groups_config as pgc

    params = inspect.signature(cls.__init__).parameters
    klass = getattr(pgc, "ProcessGroupCollection", None) or pgc.ModelCommProcessGroups
    for name in ("pg_collection", "model_comm_pgs"):
        if name in params:
            return {name: klass.use_mpu_process_groups()}
    return {}


def build_pair(config, num_local: int = EXPERTS):  # noqa: ANN001, ANN201
    """Upstream's TEGroupedMLP on our classes, and SequentialMLP on the local linears, with
    the same weights."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe import experts

    from megatron_rocm.runtime.backend.grouped_linear import (
        TEColumnParallelGroupedLinear,
        TERowParallelGroupedLinear,
    )

    grouped_sub = getattr(experts, "GroupedMLPSubmodules", MLPSubmodules)
    grouped = experts.TEGroupedMLP(
        num_local,
        config,
        grouped_sub(
            linear_fc1=TEColumnParallelGroupedLinear, linear_fc2=TERowParallelGroupedLinear
        ),
        **groups_kwarg(experts.TEGroupedMLP),
    )
    sequential = experts.SequentialMLP(
        num_local,
        config,
        MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
        **groups_kwarg(experts.SequentialMLP),
    )
    with torch.no_grad():
        for i, expert in enumerate(sequential.local_experts):
            expert.linear_fc1.weight.copy_(getattr(grouped.linear_fc1, f"weight{i}"))
            expert.linear_fc2.weight.copy_(getattr(grouped.linear_fc2, f"weight{i}"))
    return grouped, sequential


def run_experts(module, x: torch.Tensor, splits: list[int], probs: torch.Tensor):  # noqa: ANN001, ANN201
    from megatron.core.transformer.moe import experts

    args = [torch.tensor(splits)]
    if "permuted_probs" in inspect.signature(experts.TEGroupedMLP.forward).parameters:
        args.append(probs)
    out, bias = module(x, *args)
    assert bias is None
    return out


@pytest.mark.parametrize("impl", ["loop", "torch"])
@pytest.mark.parametrize("glu", [False, True], ids=["gelu", "swiglu"])
def test_grouped_mlp_computes_what_sequential_mlp_computes(world, monkeypatch, impl, glu) -> None:
    if impl == "torch" and not hasattr(torch, "_grouped_mm"):
        pytest.skip("no torch._grouped_mm")
    monkeypatch.setenv("MEGATRON_ROCM_GROUPED_GEMM", impl)
    act = torch.nn.functional.silu if glu else torch.nn.functional.gelu
    grouped, sequential = build_pair(make_config(gated_linear_unit=glu, activation_func=act))
    torch.manual_seed(1)
    x = torch.randn(sum(SPLITS), HIDDEN)
    probs = torch.rand(sum(SPLITS))
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    out = run_experts(grouped, xa, SPLITS, probs)
    ref = run_experts(sequential, xb, SPLITS, probs)
    grad = torch.randn_like(ref)
    out.backward(grad)
    ref.backward(grad)
    exact = impl == "loop"  # the same per-expert torch.mm calls: bit for bit
    check = torch.equal if exact else (lambda a, b: torch.allclose(a, b, atol=1e-5, rtol=1e-5))
    assert check(out, ref) and check(xa.grad, xb.grad)
    for i, expert in enumerate(sequential.local_experts):
        assert check(getattr(grouped.linear_fc1, f"weight{i}").grad, expert.linear_fc1.weight.grad)
        assert check(getattr(grouped.linear_fc2, f"weight{i}").grad, expert.linear_fc2.weight.grad)
    assert not grouped.linear_fc1.weight1.grad.any()  # expert 1 had no tokens


def _layout(sharded: dict) -> set:
    return {
        (v.key, tuple(getattr(v, "global_shape", ())), tuple(getattr(v, "global_offset", ())))
        for v in sharded.values()
    }


def _sharded(module, world) -> dict:  # noqa: ANN001
    metadata = {"dp_cp_group": world.get_data_parallel_group(with_context_parallel=True)}
    if "metadata" in inspect.signature(module.sharded_state_dict).parameters:
        return module.sharded_state_dict(prefix="mlp.", metadata=metadata)
    return module.sharded_state_dict(prefix="mlp.")


@pytest.mark.parametrize("glu", [False, True], ids=["gelu", "swiglu"])
def test_checkpoint_layout_is_sequential_mlps(world, glu) -> None:
    """Upstream: "The sharded state dict is interchangable with SequentialMLP's"."""
    grouped, sequential = build_pair(make_config(gated_linear_unit=glu))
    grouped_sd, sequential_sd = _sharded(grouped, world), _sharded(sequential, world)
    assert _layout(grouped_sd) == _layout(sequential_sd)
    assert "mlp.linear_fc1.weight0" in grouped_sd  # state-dict keys: TE names
    assert "mlp.linear_fc2._extra_state3" in grouped_sd


def test_parameters_are_named_allocated_and_marked_like_te(world) -> None:
    grouped, _ = build_pair(make_config())
    fc1, fc2 = grouped.linear_fc1, grouped.linear_fc2
    assert [n for n, _ in fc1.named_parameters()] == [f"weight{i}" for i in range(EXPERTS)]
    assert fc1.bias0.numel() == 0  # TE keeps an empty tensor per expert without bias
    # equally spaced views of one buffer: torch._grouped_mm reads them without a copy
    step = fc1.weight1.data_ptr() - fc1.weight0.data_ptr()
    assert step == fc1.weight0.numel() * fc1.weight0.element_size()
    assert fc1.weight3.data_ptr() - fc1.weight0.data_ptr() == 3 * step
    for module, dim in ((fc1, 0), (fc2, 1)):
        for p in module.parameters():
            assert p.allreduce is True  # EP=1: the dense data-parallel group reduces them
            assert p.tensor_model_parallel is True and p.partition_dim == dim
            assert p.partition_stride == 1


def test_biases_and_skip_bias_add(world) -> None:
    from megatron_rocm.runtime.backend.grouped_linear import (
        TEColumnParallelGroupedLinear,
        TERowParallelGroupedLinear,
    )
    from megatron_rocm.runtime.kernels.grouped_gemm import grouped_linear_reference

    config, init = make_config(), torch.nn.init.xavier_normal_
    common = dict(config=config, init_method=init, bias=True, is_expert=True)
    fc1 = TEColumnParallelGroupedLinear(EXPERTS, HIDDEN, FFN, skip_bias_add=False, **common)
    fc2 = TERowParallelGroupedLinear(EXPERTS, FFN, HIDDEN, skip_bias_add=True, **common)
    assert [n for n, _ in fc1.named_parameters()][:3] == ["weight0", "bias0", "weight1"]
    assert fc1.bias0.tensor_model_parallel is True and fc1.bias0.partition_dim == 0
    assert not getattr(fc2.bias0, "tensor_model_parallel", False)
    with torch.no_grad():
        for i in range(EXPERTS):
            getattr(fc1, f"bias{i}").normal_()
    x = torch.randn(sum(SPLITS), HIDDEN, requires_grad=True)
    h, none = fc1(x, SPLITS)
    assert none is None
    weights = [getattr(fc1, f"weight{i}") for i in range(EXPERTS)]
    biases = [getattr(fc1, f"bias{i}") for i in range(EXPERTS)]
    assert torch.allclose(h, grouped_linear_reference(x, weights, SPLITS, biases), atol=1e-5)
    out, returned = fc2(h, SPLITS)
    assert isinstance(returned, list) and len(returned) == EXPERTS
    assert returned[0] is not None and returned[0].shape == (HIDDEN,)
    rows = torch.cat([o + b for o, b in zip(out.split(SPLITS), returned)])
    rows.sum().backward()
    assert fc2.bias0.grad is not None and torch.allclose(fc2.bias0.grad, torch.full((HIDDEN,), 3.0))
    assert not fc1.bias1.grad.any()  # no tokens for expert 1


def test_gradient_accumulation_fusion_fills_main_grad(world) -> None:
    from megatron_rocm.runtime.backend.grouped_linear import TEColumnParallelGroupedLinear

    config = make_config(gradient_accumulation_fusion=True)
    fc1 = TEColumnParallelGroupedLinear(
        EXPERTS, HIDDEN, FFN, config=config, init_method=torch.nn.init.xavier_normal_,
        bias=False, skip_bias_add=False, is_expert=True,
    )  # fmt: skip
    for p in fc1.parameters():
        p.main_grad = torch.zeros_like(p, dtype=torch.float32)
        p.grad_added_to_main_grad = False
    x = torch.randn(sum(SPLITS), HIDDEN)
    out, _ = fc1(x, SPLITS)
    grad = torch.randn_like(out)
    out.backward(grad)
    for i, (xs, gs) in enumerate(zip(x.split(SPLITS), grad.split(SPLITS))):
        weight = getattr(fc1, f"weight{i}")
        assert weight.grad_added_to_main_grad
        assert torch.allclose(weight.main_grad, gs.t() @ xs, atol=1e-5)


def test_constructor_takes_every_tags_keywords_and_names_a_wrong_one(world) -> None:
    from megatron_rocm.runtime.backend.grouped_linear import TERowParallelGroupedLinear

    config = make_config()
    args = dict(config=config, init_method=torch.nn.init.zeros_, bias=False, skip_bias_add=True)
    extra = {"name": "decoder.layers.0.mlp.experts.linear_fc2", "tp_comm_buffer_name": "fc2"}
    if version() >= (0, 16):
        from megatron.core.process_groups_config import ProcessGroupCollection

        extra["pg_collection"] = ProcessGroupCollection.use_mpu_process_groups()
    else:
        extra["tp_group"] = None
    layer = TERowParallelGroupedLinear(2, FFN, HIDDEN, is_expert=True, **args, **extra)
    assert layer.in_features == FFN and layer.out_features == HIDDEN
    with pytest.raises(ValueError, match="symmetric_ar_type"):
        TERowParallelGroupedLinear(2, FFN, HIDDEN, is_expert=True, symmetric_ar_type="x", **args)


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("fp4", "e2m1", "FP4"),
        ("delay_wgrad_compute", True, "delayed wgrad"),
        ("moe_use_grouped_tensor", True, "GroupedTensor"),
        ("moe_single_grouped_weight", True, "moe_single_grouped_weight"),
        ("use_te_activation_func", True, "activation ops"),
    ],
)
def test_te_only_features_are_refused_in_one_line(world, field, value, match) -> None:
    from megatron_rocm.runtime.backend.grouped_linear import TEColumnParallelGroupedLinear

    config = make_config()
    setattr(config, field, value)
    with pytest.raises(ValueError, match=f"{match}.*needs TransformerEngine") as info:
        TEColumnParallelGroupedLinear(
            2, HIDDEN, FFN, config=config, init_method=torch.nn.init.zeros_, bias=False,
            skip_bias_add=False, is_expert=True,
        )  # fmt: skip
    assert "\n" not in str(info.value)


def _fp8_experts(recipe: str = "tensorwise", **fields):  # noqa: ANN003, ANN202
    """An FP8 column grouped linear (48 outputs: FP8 GEMMs want multiples of 16). FP8 is set
    after the config is built: this child's tree is unpatched, and upstream's config asks for
    TE's version when FP8 meets MoE (the ``fp8-without-te`` patch lets it through)."""
    from megatron_rocm.runtime.backend.grouped_linear import TEColumnParallelGroupedLinear

    config = make_config(bf16=True, params_dtype=torch.bfloat16)
    for name, value in {"fp8": "hybrid", "fp8_recipe": recipe, **fields}.items():
        setattr(config, name, value)
    return TEColumnParallelGroupedLinear(
        EXPERTS, HIDDEN, 48, config=config, init_method=torch.nn.init.xavier_normal_,
        bias=False, skip_bias_add=False, is_expert=True,
    )  # fmt: skip


def _fp8_round_trip(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` quantized by its own amax and back, in float64 (current scaling's rule)."""
    t = t.double()
    fp8_max = torch.finfo(dtype).max
    scale = fp8_max / t.abs().max()
    return (t * scale).clamp(-fp8_max, fp8_max).to(dtype).double() / scale


def test_fp8_experts_scale_each_expert_by_its_own_amax(world) -> None:
    """``--fp8-recipe tensorwise``: each expert's input, weight and output gradient is
    quantized by its own amax. Expert 3's rows are 2^-14 of the others': under one scale for
    all rows they would fall into E4M3's subnormals and lose most of their bits."""
    if version() < (0, 13):
        with pytest.raises(ValueError, match="core 0.12 needs TransformerEngine"):
            _fp8_experts()
        return
    fc1 = _fp8_experts()
    assert fc1.fp8_recipe is not None and fc1.fp8_recipe.delayed is None  # current scaling
    gen = torch.Generator().manual_seed(3)
    scale = torch.cat([torch.full((m, 1), 2.0**-14 if i == 3 else 1.0)
                       for i, m in enumerate(SPLITS)])  # fmt: skip
    x = (torch.randn(sum(SPLITS), HIDDEN, generator=gen) * scale).bfloat16().requires_grad_()
    out, _ = fc1(x, SPLITS)
    dy = (torch.randn(out.shape, generator=gen) * scale).bfloat16()
    out.backward(dy)
    rows = zip(x.detach().split(SPLITS), dy.split(SPLITS), out.detach().split(SPLITS))
    for i, (xi, dyi, outi) in enumerate(rows):
        weight = getattr(fc1, f"weight{i}")
        if xi.shape[0] == 0:
            assert not weight.grad.any()  # no tokens: a zero gradient, not none
            continue
        e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
        xq, wq, dyq = (_fp8_round_trip(xi, e4m3), _fp8_round_trip(weight.detach(), e4m3),
                       _fp8_round_trip(dyi, e5m2))  # fmt: skip
        for got, want in ((outi, xq @ wq.T), (x.grad.split(SPLITS)[i], dyq @ wq),
                          (weight.grad, dyq.T @ xq)):  # fmt: skip
            rel = ((got.double() - want).norm() / want.norm()).item()
            assert rel < 5e-3, (i, rel)


def test_fp8_experts_with_wgrad_fusion_need_main_grad(world) -> None:
    """As the bf16 experts (and the dense FP8 linears): fusion without Megatron's ``main_grad``
    is an error, not a gradient left in ``.grad``; evaluation needs none."""
    if version() < (0, 13):
        with pytest.raises(ValueError, match="core 0.12 needs TransformerEngine"):
            _fp8_experts(gradient_accumulation_fusion=True)
        return
    fc1 = _fp8_experts(gradient_accumulation_fusion=True)
    x = torch.randn(sum(SPLITS), HIDDEN).bfloat16()
    with torch.no_grad():
        fc1(x, SPLITS)
    with pytest.raises(RuntimeError, match="gradient_accumulation_fusion needs weight.main_grad"):
        fc1(x, SPLITS)
    for i in range(EXPERTS):
        weight = getattr(fc1, f"weight{i}")
        weight.main_grad = torch.zeros(weight.shape, dtype=torch.float32)
    out, _ = fc1(x, SPLITS)
    out.float().sum().backward()
    assert fc1.weight0.main_grad.any() and not fc1.weight1.main_grad.any()  # expert 1: no rows


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"fp8_recipe": "delayed"}, "--fp8-recipe delayed for MoE experts"),
        ({"fp8_param": True}, "--fp8-param-gather for MoE experts"),
    ],
)
def test_what_the_fp8_experts_cannot_do_is_one_line(world, fields, match) -> None:
    if version() < (0, 13):
        match = "core 0.12"
    recipe = fields.pop("fp8_recipe", "tensorwise")
    with pytest.raises(ValueError, match=f"{match}.*needs TransformerEngine") as info:
        _fp8_experts(recipe, **fields)
    assert "\n" not in str(info.value)


def test_loads_the_checkpoint_forms_te_accepts(world) -> None:
    grouped, _ = build_pair(make_config())
    fc1 = grouped.linear_fc1
    state = {
        k: torch.randn_like(v) if k != "_extra_state" else v for k, v in fc1.state_dict().items()
    }
    dist_ckpt = dict(state, **{f"_extra_state{i}": None for i in range(1, EXPERTS)})
    fc1.load_state_dict(dist_ckpt, strict=True)
    assert torch.equal(fc1.weight2, state["weight2"])
    stacked = torch.stack([state[f"weight{i}"] for i in range(EXPERTS)]) * 2
    fc1.load_state_dict({"weight": stacked, "_extra_state": None}, strict=True)
    assert torch.equal(fc1.weight3, stacked[3])
    assert fc1.state_dict()["_extra_state"].numel() == 0  # TE's no-FP8 value, a tensor
    # loading copies into the shared buffer: the zero-copy view survives
    assert fc1.weight1.data_ptr() - fc1.weight0.data_ptr() == fc1.weight0.numel() * 4


def test_torch_path_reads_the_module_weights_as_one_view(world, monkeypatch) -> None:
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("no torch._grouped_mm")
    from megatron_rocm.runtime.kernels.grouped_gemm import last_run

    monkeypatch.setenv("MEGATRON_ROCM_GROUPED_GEMM", "torch")
    grouped, _ = build_pair(make_config())
    run_experts(grouped, torch.randn(sum(SPLITS), HIDDEN), SPLITS, torch.ones(sum(SPLITS)))
    assert last_run().implementation == "torch" and last_run().weights == "strided view"


# -- expert parallelism: two CPU processes ------------------------------------------------------


def _expert_parallel_worker(rank: int, port: int, results) -> None:  # noqa: ANN001
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    ps.initialize_model_parallel(1, 1, expert_model_parallel_size=2)
    try:
        torch.manual_seed(rank)
        config = make_config(num_moe_experts=2 * EXPERTS, expert_model_parallel_size=2)
        grouped, sequential = build_pair(config)
        x = torch.randn(sum(SPLITS), HIDDEN)
        probs = torch.ones(sum(SPLITS))
        same = torch.equal(
            run_experts(grouped, x, SPLITS, probs), run_experts(sequential, x, SPLITS, probs)
        )
        metadata = {"dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)}
        kw = {"metadata": metadata} if version() >= (0, 16) else {}
        sharded = grouped.linear_fc2.sharded_state_dict(prefix="fc2.", **kw)
        offsets = sorted(v.global_offset[0] for k, v in sharded.items() if "weight" in k)
        result = {
            "same_as_sequential": same,
            "allreduce": sorted({p.allreduce for p in grouped.parameters()}),
            "expert_offsets": offsets,
            "global_experts": sharded["fc2.weight0"].global_shape[0],
        }
        # expert tensor parallelism: each rank holds a TP shard of every expert
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(1, 1, expert_tensor_parallel_size=2)
        grouped, _ = build_pair(make_config(expert_tensor_parallel_size=2))
        fc1, fc2 = grouped.linear_fc1, grouped.linear_fc2
        result["etp_shapes"] = (tuple(fc1.weight0.shape), tuple(fc2.weight0.shape))
        result["etp_allreduce"] = sorted({p.allreduce for p in grouped.parameters()})
        result["etp_partition_dims"] = (fc1.weight0.partition_dim, fc2.weight0.partition_dim)
        result["etp_tensor_parallel"] = fc2.weight0.tensor_model_parallel
        results[rank] = result
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


def test_expert_parallel_layouts_over_two_processes(mc) -> None:
    """EP=2: each rank holds its half of the experts, reduced over the expert data-parallel
    group (``allreduce=False``), checkpointed at its global expert indices. Expert-TP=2: each
    rank holds half of every expert, with the attributes the tag's wrapper leaves."""
    import torch.multiprocessing as mp

    results = mp.Manager().dict()
    mp.spawn(_expert_parallel_worker, args=(_free_port(), results), nprocs=2, join=True)
    v = version()
    for rank in (0, 1):
        got = results[rank]
        assert got["same_as_sequential"]
        assert got["allreduce"] == [False]
        assert got["global_experts"] == 2 * EXPERTS
        assert got["expert_offsets"] == list(range(rank * EXPERTS, (rank + 1) * EXPERTS))
        assert got["etp_shapes"] == ((FFN // 2, HIDDEN), (HIDDEN, FFN // 2))
        # up to 0.18 only EP switched to the expert groups; 0.19 added expert-TP != TP
        assert got["etp_allreduce"] == ([False] if v >= (0, 19) else [True])
        # TE given no parallel mode marks dim 0; 0.17+ stamps the row-parallel dim back
        assert got["etp_partition_dims"] == ((0, 1) if v >= (0, 17) else (0, 0))
        assert got["etp_tensor_parallel"] is True


# -- the driver: one child pytest per release --------------------------------------------------


def _extract_core(sdist: Path, dest: Path) -> Path:
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if "/megatron/core/" in f"/{m.name}"]
        tar.extractall(dest, members=members, filter="data")
    (root,) = {Path(m.name).parts[0] for m in members}
    return dest / root


@pytest.mark.upstream
@pytest.mark.full
@pytest.mark.slow
@pytest.mark.skipif(MEGATRON_HERE, reason="megatron is importable: the tests above run here")
@pytest.mark.parametrize("release", RELEASES)
def test_release(release: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from cache_paths import DOWNLOAD_CACHE

    from megatron_rocm.patchtool import pypi

    monkeypatch.setenv("MEGATRON_ROCM_CACHE", str(DOWNLOAD_CACHE))
    root = _extract_core(pypi.fetch_sdist(release), tmp_path)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not upstream",
         str(Path(__file__))],
        env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    tail = "\n".join(proc.stdout.splitlines()[-25:])
    assert proc.returncode == 0, tail
    assert " passed" in tail and " failed" not in tail and "skipped" not in tail, tail
