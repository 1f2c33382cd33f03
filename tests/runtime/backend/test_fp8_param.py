"""``--fp8-param-gather`` without TE (``backend.fp8_param``): the FP8 weight's contract with
upstream's DDP, distributed optimizer and checkpoints, and its bytes against the quantize a run
without the flag makes of the all-gathered bf16 weight (``kernels.fp8``, itself checked against
float64 in test_fp8.py)."""

from __future__ import annotations

import io

import pytest

torch = pytest.importorskip("torch")

from triton_interpreter import TRITON_DEVICE, triton_test  # noqa: E402
from two_gloo_ranks import join, two_ranks  # noqa: E402

from megatron_rocm.runtime.backend import fp8 as backend_fp8  # noqa: E402
from megatron_rocm.runtime.backend import fp8_param  # noqa: E402
from megatron_rocm.runtime.kernels import fp8  # noqa: E402

TRITON_SKIPS_ALLOWED = False  # under the interpreter every Triton case runs
OUT, IN = 32, 64
FORMATS = fp8.formats("hybrid", arch="cpu")


def _recipe(delayed: bool) -> backend_fp8.Fp8Recipe:
    histories = backend_fp8.DelayedScaling(
        *(fp8.AmaxHistory(8, most_recent=False) for _ in range(3))
    )
    return backend_fp8.Fp8Recipe(formats=FORMATS, delayed=histories if delayed else None)


def _linear(seed: int = 0, delayed: bool = False) -> tuple[torch.nn.Linear, torch.Tensor]:
    """A bf16 linear with an FP8 weight, and the weight it was built with."""
    torch.manual_seed(seed)
    linear = torch.nn.Linear(IN, OUT, bias=False).to(torch.bfloat16)
    built = linear.weight.detach().clone()
    linear.weight.allreduce = True  # an attribute upstream sets, which must survive
    fp8_param.convert_weight(linear, _recipe(delayed))
    return linear, built


def _bytes(x_fp8: torch.Tensor) -> torch.Tensor:
    return x_fp8.view(torch.uint8)


def test_the_weight_is_a_parameter_that_reports_bf16_and_holds_the_quantized_bytes() -> None:
    linear, built = _linear()
    p = linear.weight
    assert isinstance(p, torch.nn.Parameter) and isinstance(p, fp8_param.Fp8Param)
    assert (p.dtype, tuple(p.shape), p.requires_grad) == (torch.bfloat16, (OUT, IN), True)
    assert p.type() == "torch.BFloat16Tensor" and p.allreduce is True
    want, inverse = fp8.quantize(built, FORMATS.forward)
    assert torch.equal(p._fp8.data, _bytes(want)) and torch.equal(p._fp8.scale_inv, inverse)
    assert torch.equal(p.get_high_precision_init_val(), built)  # the optimizer's fp32 start
    p.clear_high_precision_init_val()
    assert not hasattr(p, "get_high_precision_init_val")  # upstream asks hasattr, as of TE's


def test_the_weight_keeps_its_place_among_the_parameters() -> None:
    """DDP lays its buffers out, and a checkpoint's dp_zero optimizer state is split, in the
    module's parameter order."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(IN, OUT).to(torch.bfloat16)
    fp8_param.convert_weight(linear, _recipe(False))
    assert [name for name, _ in linear.named_parameters()] == ["weight", "bias"]


def test_a_slice_dequantizes_only_its_part() -> None:
    """The distributed optimizer keeps ``param.detach().view(-1)[a:b]`` for the whole run."""
    linear, _ = _linear()
    p = linear.weight
    flat = p.detach().view(-1)
    assert (
        isinstance(flat, fp8_param.Fp8Param) and flat._fp8.data.data_ptr() == p._fp8.data.data_ptr()
    )
    part = flat[100:110]
    assert type(part) is torch.Tensor and part.untyped_storage().nbytes() == 10 * 2
    assert torch.equal(part, p.dequantize().view(-1)[100:110])


def test_every_alias_shares_the_state_and_other_ops_see_the_dequantized_weight() -> None:
    linear, _ = _linear()
    p = linear.weight
    assert p.data._fp8 is p._fp8 and p.detach()._fp8 is p._fp8
    expanded = p.expand_as(p)  # DDP's hook: the AccumulateGrad node of the parameter itself
    assert type(expanded) is torch.Tensor
    assert expanded.grad_fn.next_functions[0][0].variable is p
    assert torch.equal(p.float(), p.dequantize().float())  # the bf16 weight, upcast
    assert torch.equal(p.dequantize(), fp8.dequantize(p._fp8.fp8(), p._fp8.scale_inv).bfloat16())
    assert linear.to(torch.bfloat16).weight is p  # Float16Module's conversion keeps it


def test_copy_quantizes_and_other_writes_are_refused() -> None:
    linear, _ = _linear()
    p = linear.weight
    source = torch.randn(OUT, IN, dtype=torch.bfloat16)
    with torch.no_grad():
        p.copy_(source)  # a checkpoint's load
        with pytest.raises(RuntimeError, match="changes only through copy_"):
            p.add_(1.0)
        with pytest.raises(RuntimeError, match="changes only through copy_"):
            torch.add(source, 1.0, out=p)
    want, inverse = fp8.quantize(source, FORMATS.forward)
    assert torch.equal(p._fp8.data, _bytes(want)) and torch.equal(p._fp8.scale_inv, inverse)


def test_a_saved_state_dict_holds_the_dequantized_weight() -> None:
    linear, _ = _linear()
    buffer = io.BytesIO()
    torch.save(linear.state_dict(), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer)["weight"]
    assert type(loaded) is torch.Tensor and torch.equal(loaded, linear.weight.dequantize())


def test_the_bytes_move_into_ddp_buffer_and_the_transpose_follows() -> None:
    linear, _ = _linear()
    p = linear.weight
    old = p._fp8.transposed().clone()
    buffer = torch.zeros(OUT * IN + 128, dtype=torch.uint8)
    view = buffer[64 : 64 + OUT * IN].view(OUT, IN)
    before = p._fp8.data.clone()
    fp8_param.replace_raw_data(p, view)
    assert p._fp8.data.data_ptr() == view.data_ptr() and torch.equal(view, before)
    view.zero_()  # what an all-gather writes
    fp8_param.post_all_gather([p])
    assert not torch.equal(_bytes(p._fp8.transposed()), _bytes(old))
    assert torch.equal(_bytes(p._fp8.transposed()), view.t())
    with pytest.raises(ValueError, match="uint8"):
        fp8_param.replace_raw_data(p, torch.zeros(OUT, IN))


@pytest.mark.parametrize("wgrad_fusion", [True, False])
def test_the_linear_reads_the_bytes_and_matches_the_quantizing_linear(wgrad_fusion) -> None:
    """Tensorwise: the stored bytes are what the linear quantizes from the bf16 weight, so
    output, input gradient and weight gradient are bit for bit the run without the flag's."""
    linear, _ = _linear()
    p = linear.weight
    plain = torch.nn.Parameter(p.dequantize())  # its quantize gives the same bytes back
    assert torch.equal(fp8.quantize(plain, FORMATS.forward)[0].view(torch.uint8), p._fp8.data)
    x = torch.randn(2, 16, IN, dtype=torch.bfloat16)
    results = []
    for weight in (p, plain):
        if wgrad_fusion:
            weight.main_grad = torch.zeros(OUT, IN)
        xi = x.clone().requires_grad_()
        out = backend_fp8.fp8_linear(xi, weight, wgrad_fusion, _recipe(False))
        out.float().square().sum().backward()
        wgrad = weight.main_grad if wgrad_fusion else weight.grad
        results.append((out, xi.grad, wgrad))
    for got, want in zip(*results):
        assert torch.equal(got, want)


def _shard_rank(rank: int, port: int, results) -> None:  # noqa: ANN001 - a spawned process
    """Both ranks hold the same fp32 mains, each quantizes its half into its bytes; the two
    halves put together, against ``fp8.quantize`` of the whole bf16 weight: tensorwise at one
    step, delayed over four (the first quantize current scaling, then the history's)."""
    import torch.distributed as dist

    join(rank, port)
    split = 1000  # not a row boundary
    out = {}
    for delayed in (False, True):
        linear, built = _linear(delayed=delayed)
        p = linear.weight
        reference = fp8.AmaxHistory(8, most_recent=False)
        fp8.quantize(built, FORMATS.forward, history=reference)  # the first step's weight
        same = []
        for step in range(1, 4 if delayed else 2):
            main = torch.randn(OUT * IN, generator=torch.Generator().manual_seed(step)) * step
            shard = main[:split] if rank == 0 else main[split:]
            start = 0 if rank == 0 else split
            fp8_param.quantize_param_shard([p], [shard], [start], dist.group.WORLD)
            gathered = [torch.zeros(OUT * IN, dtype=torch.uint8) for _ in range(2)]
            dist.all_gather(gathered, p._fp8.data.view(-1).clone())
            whole = torch.cat([gathered[0][:split], gathered[1][split:]])
            weight = main.to(torch.bfloat16).view(OUT, IN)
            if delayed:
                want, inverse = fp8.quantize(weight, FORMATS.forward, history=reference)
            else:
                want, inverse = fp8.quantize(weight, FORMATS.forward)
            same.append(
                torch.equal(whole, _bytes(want).view(-1)) and torch.equal(p._fp8.scale_inv, inverse)
            )
        out["delayed" if delayed else "tensorwise"] = same
    # three weights in one call, as the optimizer makes it: the second held by rank 0 alone
    # (rank 1 passes None), each with a scale of its own; both recipes (delayed over two steps)
    for delayed in (False, True):
        built_params = [_linear(seed=seed, delayed=delayed) for seed in (1, 2, 3)]
        params = [linear.weight for linear, _ in built_params]
        references = [fp8.AmaxHistory(8, most_recent=False) if delayed else None for _ in params]
        for (_, built), reference in zip(built_params, references):
            if reference is not None:
                fp8.quantize(built, FORMATS.forward, history=reference)
        same = []
        for step in range(1, 3 if delayed else 2):
            mains = [
                torch.randn(OUT * IN, generator=torch.Generator().manual_seed(9 + i + 10 * step))
                * 4**i
                for i in range(3)
            ]
            if rank == 0:
                shards, starts = [mains[0][:split], mains[1], mains[2][:10]], [0, 0, 0]
            else:
                shards, starts = [mains[0][split:], None, mains[2][10:]], [split, 0, 10]
            fp8_param.quantize_param_shard(params, shards, starts, dist.group.WORLD)
            for p, main, shard, start, ref in zip(params, mains, shards, starts, references):
                weight = main.to(torch.bfloat16).view(OUT, IN)
                want, inverse = fp8.quantize(weight, FORMATS.forward, history=ref)
                n = 0 if shard is None else shard.numel()
                mine = p._fp8.data.view(-1)[start : start + n]
                same.append(
                    torch.equal(mine, _bytes(want).view(-1)[start : start + n])
                    and torch.equal(p._fp8.scale_inv, inverse)
                )
        out["many delayed" if delayed else "many"] = same
    # a NaN in rank 1's shard: both ranks scale by 1, as the whole weight's NaN amax does
    linear, _ = _linear()
    p = linear.weight
    main = torch.randn(OUT * IN)
    main[1500] = float("nan")
    shard, start = (main[:split], 0) if rank == 0 else (main[split:], split)
    fp8_param.quantize_param_shard([p], [shard], [start], dist.group.WORLD)
    want, inverse = fp8.quantize(main.to(torch.bfloat16).view(OUT, IN), FORMATS.forward)
    mine = p._fp8.data.view(-1)[start : start + shard.numel()]
    out["nan"] = [
        torch.equal(mine, _bytes(want).view(-1)[start : start + shard.numel()])
        and torch.equal(p._fp8.scale_inv, inverse)
        and inverse.item() == 1.0
    ]
    results.put((rank, out))
    dist.destroy_process_group()


@pytest.mark.slow
def test_shards_quantized_on_two_ranks_are_the_whole_weights_quantize() -> None:
    got = two_ranks(_shard_rank)
    want = {
        "tensorwise": [True], "delayed": [True, True, True], "many": [True] * 3,
        "many delayed": [True] * 6, "nan": [True]
    }  # fmt: skip
    assert got == [(0, want), (1, want)]


def _shard_steps(
    monkeypatch: pytest.MonkeyPatch, delayed: bool, device: str
) -> tuple[list[list[torch.Tensor]], dict[str, int]]:
    """Three optimizer steps of ``quantize_param_shard`` on one rank (no group) over four
    weights in one call: a whole shard, one from an offset (the bytes before it stay as
    built), none (None), one with a NaN and an inf. Per step, every weight's bytes, scale
    inverse, transpose and (delayed) history state, on the CPU; and the Triton launches made
    (counted after they return: a launch that raised is not counted)."""
    from megatron_rocm.runtime.kernels import fp8_triton

    launches = {"cast_flat": 0, "transpose_bytes": 0}
    for name in launches:
        real = getattr(fp8_triton, name)

        def counted(*args, _real=real, _name=name):  # noqa: ANN002, ANN202
            done = _real(*args)
            launches[_name] += 1
            return done

        monkeypatch.setattr(fp8_triton, name, counted)
    params = []
    for seed in range(4):
        torch.manual_seed(seed)
        linear = torch.nn.Linear(IN, OUT, bias=False, device=device, dtype=torch.bfloat16)
        fp8_param.convert_weight(linear, _recipe(delayed))
        params.append(linear.weight)
    steps = [[p._fp8.data.cpu().clone() for p in params]]  # as built
    for step in range(1, 4):
        gen = torch.Generator().manual_seed(step)
        mains = [(torch.randn(OUT * IN, generator=gen) * step).to(device) for _ in range(4)]
        mains[3][7] = float("nan")
        mains[3][900] = float("inf")
        shards = [mains[0], mains[1][1000:], None, mains[3]]
        fp8_param.quantize_param_shard(params, shards, [0, 1000, 0, 0], None)
        state = []
        for p in params:
            fp8 = p._fp8
            state += [fp8.data, fp8.scale_inv, fp8.transposed().view(torch.uint8)]
            if delayed:
                state += [fp8.history.history, fp8.history.current, fp8.history.pos]
                state += [fp8.history.scale]
        steps.append([t.detach().cpu().clone() for t in state])
    return steps, launches


@triton_test
@pytest.mark.parametrize("delayed", [False, True], ids=["tensorwise", "delayed"])
def test_the_shard_casts_on_the_kernels_are_torchs_path_bit_for_bit(monkeypatch, delayed) -> None:
    """The optimizer's casts on the kernels (``cast_into``, delayed scaling's amax taken in the
    cast and its history's Triton update, the byte transpose) against torch's path
    (``MEGATRON_ROCM_KERNELS=reference:fp8``): every byte, scale, transpose and history entry
    of three steps."""
    monkeypatch.delenv("MEGATRON_ROCM_KERNELS", raising=False)
    kernels, made = _shard_steps(monkeypatch, delayed, TRITON_DEVICE)
    monkeypatch.setenv("MEGATRON_ROCM_KERNELS", "reference:fp8")
    torch_path, none = _shard_steps(monkeypatch, delayed, TRITON_DEVICE)
    assert made == {"cast_flat": 3 * 3, "transpose_bytes": 4 * 3}
    assert none == {"cast_flat": 0, "transpose_bytes": 0}
    for got_step, want_step in zip(kernels, torch_path, strict=True):
        for got, want in zip(got_step, want_step, strict=True):
            assert got.dtype == want.dtype and torch.equal(got, want)
    per_weight = 7 if delayed else 3
    built, first, second = kernels[0], kernels[1], kernels[2]
    assert not torch.equal(first[0], second[0])  # the steps did write new bytes
    # the offset shard left the bytes before it as built, and the None weight all of its own
    assert torch.equal(first[per_weight].view(-1)[:1000], built[1].view(-1)[:1000])
    assert torch.equal(second[2 * per_weight], built[2])


def test_failing_kernels_leave_the_optimizer_step_to_torch(monkeypatch, caplog) -> None:
    """Delayed scaling's history update, the shard cast and the transpose failing to launch (a
    GPU without code for them) cost speed, logged, never the step: the bytes, scale and
    history are torch's path's, and a kernel that failed is not tried again."""
    pytest.importorskip("triton")
    from megatron_rocm.runtime.kernels import fp8_triton, launch

    def run(broken: bool) -> list[torch.Tensor]:
        linear, _ = _linear(seed=4, delayed=True)
        p = linear.weight
        for step in (1, 2):
            main = torch.randn(OUT * IN, generator=torch.Generator().manual_seed(step))
            fp8_param.quantize_param_shard([p], [main], [0], None)
        h = p._fp8.history
        return [p._fp8.data, p._fp8.scale_inv, p._fp8.transposed().view(torch.uint8),
                h.history, h.pos, h.scale]  # fmt: skip

    want = run(broken=False)  # a CPU box without the interpreter: torch's path
    monkeypatch.setattr(fp8, "_eager_keys", set())
    monkeypatch.setattr(launch, "_logged", set())
    monkeypatch.setattr(fp8, "use_triton", lambda *a, **k: True)
    attempts: list[str] = []
    for name in ("delayed_update", "cast_flat", "transpose_bytes"):

        def broken(*args, _name=name):  # noqa: ANN002, ANN202
            attempts.append(_name)
            raise RuntimeError("no device code for this arch")

        monkeypatch.setattr(fp8_triton, name, broken)
    caplog.set_level("WARNING", logger="megatron_rocm.runtime.kernels")
    got = run(broken=True)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    # the update's failure puts the weight's quantize key on torch, so its cast is not tried;
    # nothing is tried again on the second step
    assert attempts == ["delayed_update", "transpose_bytes"]
    assert len(caplog.records) == 2


def test_bad_buffers_are_errors_not_kernel_failures(monkeypatch) -> None:
    """A wrong destination is the caller's error (ValueError), before any launch: it must not
    mark the kernels failed for the run. An empty shard casts nothing."""
    monkeypatch.setattr(fp8, "_eager_keys", set())
    x = torch.randn(10, dtype=torch.bfloat16)
    for out in (torch.zeros(9, dtype=torch.uint8), torch.zeros(10, dtype=torch.int8),
                torch.zeros(20, dtype=torch.uint8)[::2]):  # fmt: skip
        with pytest.raises(ValueError, match="cast_into: out must be 10 contiguous uint8"):
            fp8.cast_into(x, torch.ones(()), out, FORMATS.forward)
    for bad in (torch.zeros(6, dtype=torch.uint8), torch.zeros(2, 3, dtype=torch.bfloat16)):
        with pytest.raises(ValueError, match="transpose_fp8: expected a 2-D tensor"):
            fp8.transpose_fp8(bad)
    assert fp8._eager_keys == set()
    amax = torch.tensor(2.5)
    fp8.cast_into(torch.zeros(0), torch.ones(()), torch.zeros(0, dtype=torch.uint8),
                  FORMATS.forward, amax)  # fmt: skip
    assert amax.item() == 2.5


def test_install_binds_upstreams_hooks_and_leaves_te_tensors_to_te() -> None:
    """What the patch runs in ``fp8_utils``'s no-TE branch, on a namespace holding upstream's
    fallbacks: a version without ``post_all_gather_processing`` keeps its names as they are."""
    seen = []
    namespace = {
        "is_float8tensor": lambda t: t == "te-tensor",
        "dequantize_fp8_tensor": lambda t: ("te", t),
        "post_all_gather_processing": seen.append,
        "_modify_underlying_storage_impl": None,
        "_quantize_param_shard_impl": None,
    }
    fp8_param.install(namespace)
    linear, _ = _linear()
    p, other = linear.weight, torch.zeros(2)
    assert namespace["is_float8tensor"](p) and namespace["is_float8tensor"]("te-tensor")
    assert not namespace["is_float8tensor"](other)
    assert namespace["_modify_underlying_storage_impl"] is fp8_param.replace_raw_data
    assert namespace["_quantize_param_shard_impl"] is fp8_param.quantize_param_shard
    assert torch.equal(namespace["dequantize_fp8_tensor"](p), p.dequantize())
    assert namespace["dequantize_fp8_tensor"]("x") == ("te", "x")
    p._fp8.transposed()
    namespace["post_all_gather_processing"]([p, other])
    assert p._fp8.transpose is None and seen == [[other]]
    older = {"is_float8tensor": lambda t: False}  # 0.12: neither of the two later names
    fp8_param.install(older)
    assert set(older) == {
        "is_float8tensor",
        "_modify_underlying_storage_impl",
        "_quantize_param_shard_impl",
    }
