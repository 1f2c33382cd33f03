"""FusedAdam: Apex/TE constructor, AdamW vs L2 Adam math, Megatron's state conventions."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")

from megatron_rocm.runtime.kernels.optimizer import FusedAdam, adam_reference_step  # noqa: E402

HYPER = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


def _params(device: str | torch.device = "cpu") -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    return [
        torch.nn.Parameter(torch.randn(shape, device=device, dtype=torch.float64))
        for shape in ((7,), (3, 5), (1,))
    ]


def _run_and_compare(
    optimizer: FusedAdam, params: list[torch.nn.Parameter], adam_w_mode: bool, steps: int = 4
) -> None:
    ref = [p.detach().clone() for p in params]
    exp_avg = [torch.zeros_like(p) for p in ref]
    exp_avg_sq = [torch.zeros_like(p) for p in ref]
    for step in range(1, steps + 1):
        grads = [torch.randn_like(p) for p in params]
        for param, grad in zip(params, grads):
            param.grad = grad.clone()
        optimizer.step()
        for i, grad in enumerate(grads):
            adam_reference_step(
                ref[i], grad, exp_avg[i], exp_avg_sq[i], step, adam_w_mode=adam_w_mode, **HYPER
            )
    for param, expected in zip(params, ref):
        torch.testing.assert_close(param.detach(), expected, atol=1e-10, rtol=1e-9)


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_step_parity(adam_w_mode: bool) -> None:
    params = _params()
    optimizer = FusedAdam(params, adam_w_mode=adam_w_mode, **HYPER)
    _run_and_compare(optimizer, params, adam_w_mode)


def test_modes_differ() -> None:
    """Guards the mapping itself: with decay on, AdamW and L2-Adam must not coincide."""
    results = []
    for mode in (True, False):
        params = _params()
        optimizer = FusedAdam(params, adam_w_mode=mode, **HYPER)
        for param in params:
            param.grad = torch.ones_like(param)
        optimizer.step()
        results.append(torch.cat([p.detach().flatten() for p in params]))
    assert not torch.allclose(results[0], results[1])


def test_megatron_kwargs_are_accepted() -> None:
    """The kwargs core/optimizer/__init__.py passes at 0.12 .. main, incl. HybridDeviceOptimizer."""
    params = _params()
    groups = [{"params": params[:2], "wd_mult": 1.0}, {"params": params[2:], "wd_mult": 0.0}]
    optimizer = FusedAdam(
        params=groups,
        lr=1e-3,
        weight_decay=0.01,
        betas=(0.9, 0.999),
        eps=1e-8,
        capturable=False,
        adam_w_mode=True,
        bias_correction=True,
        fused=True,
        exp_avg_dtype=torch.float32,
        exp_avg_sq_dtype=torch.float32,
        store_param_remainders=False,
    )
    assert isinstance(optimizer, torch.optim.Adam)
    assert optimizer.param_groups[1]["wd_mult"] == 0.0
    group = optimizer.param_groups[0]
    assert group["foreach"] is True and not group["fused"]  # CPU policy
    assert group["decoupled_weight_decay"] is True


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"master_weights": True}, NotImplementedError),
        ({"use_decoupled_grad": True}, NotImplementedError),
        ({"exp_avg_dtype": torch.bfloat16}, NotImplementedError),
        ({"bias_correction": False}, NotImplementedError),
        ({"not_an_apex_option": 1}, TypeError),
    ],
)
def test_refuses_what_it_cannot_honour(kwargs: dict, error: type[Exception]) -> None:
    with pytest.raises(error):
        FusedAdam(_params(), **kwargs)


@pytest.mark.parametrize("set_grad_none", [True, False])
def test_set_grad_none(set_grad_none: bool) -> None:
    params = _params()
    optimizer = FusedAdam(params, set_grad_none=set_grad_none)
    for param in params:
        param.grad = torch.ones_like(param)
    optimizer.zero_grad()
    for param in params:
        if set_grad_none:
            assert param.grad is None
        else:
            assert param.grad is not None and torch.count_nonzero(param.grad) == 0


def test_state_from_megatron_init_state_fn() -> None:
    """Megatron's init_state_fn creates exp_avg/exp_avg_sq only and keeps the step in the
    group (Apex convention); the next step must continue from that step."""
    params = _params()
    optimizer = FusedAdam(params, adam_w_mode=True, **HYPER)
    exp_avg = [torch.rand_like(p) for p in params]
    exp_avg_sq = [torch.rand_like(p) for p in params]
    for group in optimizer.param_groups:
        group["step"] = 3
    for param, m, v in zip(params, exp_avg, exp_avg_sq):
        optimizer.state[param]["exp_avg"] = m.clone()
        optimizer.state[param]["exp_avg_sq"] = v.clone()
    ref = [p.detach().clone() for p in params]
    grads = [torch.randn_like(p) for p in params]
    for param, grad in zip(params, grads):
        param.grad = grad.clone()
    optimizer.step()
    for i, grad in enumerate(grads):
        adam_reference_step(ref[i], grad, exp_avg[i], exp_avg_sq[i], 4, adam_w_mode=True, **HYPER)
        torch.testing.assert_close(params[i].detach(), ref[i])


@pytest.mark.parametrize("with_grad", [(1,), (0, 2), ()])
def test_every_parameter_gets_state_in_order_and_every_step_counts(with_grad: tuple) -> None:
    """Apex's and TE's convention, which Megatron-FSDP's fsdp_dtensor save needs: a rank whose
    shard of a parameter is empty gets no gradient for it, yet must hold the same state keys,
    in the same order, with the same step as the rank that updates it."""
    params = _params()
    optimizer = FusedAdam(params, **HYPER)
    before = [p.detach().clone() for p in params]
    for _ in range(2):
        for i, param in enumerate(params):
            param.grad = torch.randn_like(param) if i in with_grad else None
        optimizer.step()
    assert list(optimizer.state) == params
    for i, param in enumerate(params):
        state = optimizer.state[param]
        assert float(state["step"]) == 2.0
        if i not in with_grad:  # untouched, as torch's Adam leaves a parameter without grad
            torch.testing.assert_close(param.detach(), before[i], atol=0, rtol=0)
            assert not state["exp_avg"].any() and not state["exp_avg_sq"].any()


def test_a_parameter_first_updated_late_uses_the_groups_step() -> None:
    """Bias correction from the step count of the group (Apex/TE), not from the parameter's
    first gradient (what torch's lazy state would give)."""
    params = _params()
    optimizer = FusedAdam(params, adam_w_mode=True, **HYPER)
    for _ in range(2):
        params[0].grad, params[1].grad, params[2].grad = torch.randn_like(params[0]), None, None
        optimizer.step()
    ref = params[1].detach().clone()
    grad = torch.randn_like(ref)
    params[1].grad = grad.clone()
    optimizer.step()
    zeros = [torch.zeros_like(ref), torch.zeros_like(ref)]
    adam_reference_step(ref, grad, *zeros, 3, adam_w_mode=True, **HYPER)
    torch.testing.assert_close(params[1].detach(), ref)


def test_a_checkpoint_without_step_joins_its_neighbours() -> None:
    """A parameter whose state lacks ``step`` (Megatron's init_state_fn) next to ones that
    have it starts from their step."""
    params = _params()
    optimizer = FusedAdam(params, **HYPER)
    for param in params:
        param.grad = torch.ones_like(param)
    optimizer.step()
    del optimizer.state[params[2]]["step"]
    optimizer.step()
    assert [float(optimizer.state[p]["step"]) for p in params] == [2.0, 2.0, 2.0]


def test_state_dict_round_trip() -> None:
    params = _params()
    optimizer = FusedAdam(params, **HYPER)
    for param in params:
        param.grad = torch.ones_like(param)
    optimizer.step()
    clone_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    clone = FusedAdam(clone_params, **HYPER)
    # deepcopy: torch's load_state_dict keeps same-device tensors, i.e. shares the moments.
    clone.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    for opt, ps in ((optimizer, params), (clone, clone_params)):
        for param in ps:
            param.grad = torch.full_like(param, 0.5)
        opt.step()
    for a, b in zip(params, clone_params):
        torch.testing.assert_close(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_gpu_uses_fused_kernel(cuda_device: torch.device, adam_w_mode: bool) -> None:
    params = [torch.nn.Parameter(p.detach().float()) for p in _params(cuda_device)]
    optimizer = FusedAdam(params, adam_w_mode=adam_w_mode, **HYPER)
    assert optimizer.param_groups[0]["fused"] is True
    ref = [p.detach().clone() for p in params]
    m = [torch.zeros_like(p) for p in ref]
    v = [torch.zeros_like(p) for p in ref]
    for step in range(1, 4):
        grads = [torch.randn_like(p) for p in params]
        for param, grad in zip(params, grads):
            param.grad = grad.clone()
        optimizer.step()
        for i, grad in enumerate(grads):
            adam_reference_step(ref[i], grad, m[i], v[i], step, adam_w_mode=adam_w_mode, **HYPER)
    for param, expected in zip(params, ref):
        torch.testing.assert_close(param.detach(), expected, atol=1e-5, rtol=1e-5)


def test_fused_adam_is_an_adamw_for_megatrons_distributed_optimizer():
    """core_v0.12-0.14 DistributedOptimizer asserts isinstance(optimizer, torch.optim.AdamW)."""
    from megatron_rocm.runtime.kernels.optimizer import FusedAdam

    p = torch.nn.Parameter(torch.randn(4))
    opt = FusedAdam([p], lr=0.1, weight_decay=0.5, adam_w_mode=False)
    assert isinstance(opt, torch.optim.AdamW)
    opt.load_state_dict(opt.state_dict())
    assert opt.param_groups[0]["decoupled_weight_decay"] is False


def test_lr_none_is_accepted_as_apex_and_te_accept_it() -> None:
    """Megatron's OptimizerConfig.lr defaults to None (the scheduler sets each group's lr);
    upstream's dist_checkpointing tests build the optimizer so and load a checkpoint into it.
    torch's constructor raised "'<=' not supported between instances of 'float' and
    'NoneType'" there; TE's and Apex's FusedAdam keep the None."""
    params = _params()
    groups = [{"params": params[:2], "max_lr": None}, {"params": params[2:], "lr": 0.5}]
    optimizer = FusedAdam(groups, lr=None, weight_decay=0.01)
    assert [g["lr"] for g in optimizer.param_groups] == [None, 0.5]
    assert FusedAdam(_params(), lr=None).param_groups[0]["lr"] is None
    # a checkpoint's param groups (what load_checkpoint hands over) bring their lr along
    source = FusedAdam(_params(), **HYPER)
    target = FusedAdam(_params(), lr=None)
    target.load_state_dict(copy.deepcopy(source.state_dict()))
    assert target.param_groups[0]["lr"] == HYPER["lr"]


def test_a_step_with_lr_none_names_the_group() -> None:
    params = _params()
    optimizer = FusedAdam(params, lr=None)
    for param in params:
        param.grad = torch.ones_like(param)
    before = [p.detach().clone() for p in params]
    with pytest.raises(ValueError, match=r"group\(s\) \[0\] have lr=None"):
        optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(params, before))
    optimizer.param_groups[0]["lr"] = HYPER["lr"]  # what the scheduler does
    optimizer.step()
    assert not torch.equal(params[0], before[0])


def _scheduler_sets_lr(optimizer: FusedAdam, lr: float) -> None:
    """What Megatron's OptimizerParamScheduler.step does to each group (0.17+)."""
    for group in optimizer.param_groups:
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr


@pytest.mark.gpu
def test_a_captured_step_follows_the_lr_schedule(cuda_device: torch.device) -> None:
    """--optimizer-cuda-graph: upstream captures optimizer.step() once and replays it; the
    scheduler's later learning rates must reach the replays (a float lr is frozen at capture)."""
    hyper = {k: v for k, v in HYPER.items() if k != "lr"}
    params = [torch.nn.Parameter(p.detach().float()) for p in _params(cuda_device)]
    optimizer = FusedAdam(params, lr=HYPER["lr"], capturable=True, **hyper)
    ref = [p.detach().clone() for p in params]
    m = [torch.zeros_like(p) for p in ref]
    v = [torch.zeros_like(p) for p in ref]
    for p in params:
        p.grad = torch.zeros_like(p)
    graph = None
    for step in range(1, 7):
        lr = 1e-2 / step  # a schedule that moves every step
        _scheduler_sets_lr(optimizer, lr)
        grads = [torch.randn_like(p) for p in params]
        for param, grad in zip(params, grads):
            param.grad.copy_(grad)
        if step < 3:
            optimizer.step()  # upstream's warm-up steps run eagerly
        else:
            if graph is None:
                graph = torch.cuda.CUDAGraph()
                torch.cuda.synchronize()
                with torch.cuda.graph(graph):
                    optimizer.step()
            graph.replay()
        for i, grad in enumerate(grads):
            adam_reference_step(ref[i], grad, m[i], v[i], step, lr=lr, **hyper, adam_w_mode=True)
    assert isinstance(optimizer.param_groups[0]["lr"], torch.Tensor)
    for param, expected in zip(params, ref):
        torch.testing.assert_close(param.detach(), expected, atol=1e-5, rtol=1e-5)


def test_a_tensor_lr_from_a_checkpoint_becomes_a_number_where_the_step_wants_one() -> None:
    """A capturable run saves its lr as a tensor; loaded into a CPU (foreach) optimizer, which
    refuses a tensor lr without capturable, it must be a number again."""
    params = [torch.nn.Parameter(p.detach().float()) for p in _params()]
    saved = FusedAdam(params, **HYPER).state_dict()
    saved["param_groups"][0]["lr"] = torch.tensor(0.25)
    optimizer = FusedAdam(params, **HYPER)
    optimizer.load_state_dict(saved)
    assert optimizer.param_groups[0]["lr"] == 0.25
    assert not isinstance(optimizer.param_groups[0]["lr"], torch.Tensor)
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer.step()


@pytest.mark.gpu
def test_a_resumed_capturable_optimizer_keeps_its_lr_on_the_device(
    cuda_device: torch.device, tmp_path
) -> None:
    """A checkpoint loads with map_location="cpu" (Megatron's): the lr it brings is a CPU
    tensor, which the fused step would read once on the host and a capture would freeze."""
    hyper = {k: v for k, v in HYPER.items() if k != "lr"}
    params = [torch.nn.Parameter(p.detach().float()) for p in _params(cuda_device)]
    first = FusedAdam(params, lr=HYPER["lr"], capturable=True, **hyper)
    assert first.param_groups[0]["lr"].device == cuda_device  # placed at construction
    for p in params:
        p.grad = torch.ones_like(p)
    first.step()
    torch.save(first.state_dict(), tmp_path / "opt.pt")
    resumed = FusedAdam(params, lr=HYPER["lr"], capturable=True, **hyper)
    resumed.load_state_dict(torch.load(tmp_path / "opt.pt", map_location="cpu"))
    lr = resumed.param_groups[0]["lr"]
    assert isinstance(lr, torch.Tensor) and lr.device == cuda_device
    assert float(lr) == torch.tensor(HYPER["lr"], dtype=torch.float32).item()  # fp32 on the GPU
