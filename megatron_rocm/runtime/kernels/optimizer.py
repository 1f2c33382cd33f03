"""``FusedAdam`` with Apex/TE keyword names, backed by torch's own fused Adam.

Without Apex or TE upstream falls back to ``torch.optim.AdamW`` with default settings, i.e.
the for-loop/foreach implementation and always decoupled weight decay. torch ships a fused
multi-tensor Adam for CUDA and ROCm (``fused=True``); this class selects it and translates the
Apex/TE constructor so Megatron's ``Adam(**kwargs)`` call works unchanged:

* ``adam_w_mode=True`` is AdamW (decoupled decay), ``False`` is Adam with L2 decay — Apex's
  meaning, mapped to torch's ``decoupled_weight_decay``;
* ``set_grad_none`` becomes the default of ``zero_grad``;
* ``lr=None`` is accepted, as Apex and TE accept it: Megatron's ``OptimizerConfig.lr`` defaults
  to None and its scheduler writes each group's ``lr`` (from ``max_lr``/``min_lr``) before the
  first step; a checkpoint load may build the optimizer without one. torch's constructor
  compares ``0.0 <= lr``, so the group's ``lr`` stays None until set, and a step taken while
  it is None is refused with a message instead of a ``TypeError`` deep in torch;
* ``capturable``, ``amsgrad`` pass through; ``fused``/``foreach`` requests are overridden by
  the device policy (fused on GPU, foreach on CPU). A capturable GPU group's ``lr`` is kept
  in a device tensor from construction (and after a checkpoint load, which may bring it as a
  CPU tensor), as TE's capturable FusedAdam keeps it: a CUDA graph of the step
  (``--optimizer-cuda-graph``) reads the tensor, which Megatron's scheduler then updates in
  place (``fill_``); a Python float would be frozen into the graph at its capture-time value.
  Every other group's ``lr`` is a number (a loaded tensor one becomes one);
* features torch's Adam cannot reproduce raise ``NotImplementedError`` instead of silently
  changing the math: ``bias_correction=False``, TE's precision-aware options
  (``master_weights``, ``use_decoupled_grad``, non-fp32 state dtypes).

State follows torch (a per-parameter ``step`` tensor) but is kept the way Apex and TE keep
theirs, which Megatron relies on:

* every parameter gets its state at the first step, gradient or not, in parameter order (TE
  creates state before it looks at the gradient), and every step counts for every parameter
  (Apex and TE count steps per group). Megatron-FSDP leaves ``grad`` None where a rank's shard
  of a parameter is empty; with torch's lazy state the ranks then held different state keys,
  and the ``fsdp_dtensor`` save, which runs collectives key by key, hung (2×H200). Equal
  per-parameter steps on every rank also keep a deduplicated checkpoint's ``step`` right.
* Megatron's ``init_state_fn`` only creates ``exp_avg``/``exp_avg_sq`` (Apex keeps ``step`` in
  the param group), so a missing per-parameter ``step`` is filled from ``group["step"]``, else
  from the group's other parameters, else 0.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

import torch

_FP32_ONLY = ("exp_avg_dtype", "exp_avg_sq_dtype", "master_weight_dtype")
# Accepted with no effect: they select Apex/TE kernel variants or precision tricks that only
# matter together with options refused above.
_NO_EFFECT = ("fused", "foreach", "store_param_remainders", "grad_scaler", "loss_scale")


def _is_gpu(param: torch.Tensor) -> bool:
    return param.device.type == "cuda"


class FusedAdam(torch.optim.AdamW):
    """Adam/AdamW with Apex's constructor; ``torch.optim.Adam(fused=True)`` on GPU.

    It is a ``torch.optim.AdamW`` subclass because Megatron's DistributedOptimizer (core_v0.12
    to 0.14, without Apex/TE) asserts ``isinstance(optimizer, torch.optim.AdamW)``; the Adam
    constructor is called directly so ``adam_w_mode=False`` still gives L2 (coupled) decay.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | None = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adam_w_mode: bool = True,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        set_grad_none: bool = True,
        capturable: bool = False,
        master_weights: bool = False,
        use_decoupled_grad: bool = False,
        **ignored: Any,
    ) -> None:
        if not bias_correction:
            raise NotImplementedError("FusedAdam(bias_correction=False) is not supported")
        if master_weights or use_decoupled_grad:
            raise NotImplementedError(
                "TE's precision-aware options (master_weights, use_decoupled_grad) are not "
                "supported; turn off --use-precision-aware-optimizer"
            )
        for name in _FP32_ONLY:
            dtype = ignored.pop(name, None)
            if dtype not in (None, torch.float32):
                raise NotImplementedError(f"FusedAdam({name}={dtype}): only fp32 state")
        unknown = sorted(set(ignored) - set(_NO_EFFECT))
        if unknown:
            raise TypeError(f"FusedAdam got unexpected keyword arguments {unknown}")
        if "decoupled_weight_decay" not in inspect.signature(torch.optim.Adam).parameters:
            raise RuntimeError("FusedAdam needs torch >= 2.6 (Adam(decoupled_weight_decay=...))")
        params = list(params)
        tensors = [p for g in params for p in (g["params"] if isinstance(g, dict) else [g])]
        on_gpu = bool(tensors) and all(_is_gpu(p) for p in tensors)
        # One group per dict (or one for bare tensors); those without their own 'lr' take
        # the default, which torch validates as a number.
        own_lr = ["lr" in g for g in params if isinstance(g, dict)]
        torch.optim.Adam.__init__(
            self,
            params,
            lr=0.0 if lr is None else lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            capturable=capturable,
            fused=on_gpu or None,
            foreach=None if on_gpu else True,
            decoupled_weight_decay=adam_w_mode,
        )
        self.adam_w_mode = adam_w_mode
        self.set_grad_none = set_grad_none
        if lr is None:
            self.defaults["lr"] = None
            for group, own in zip(self.param_groups, own_lr or [False]):
                if not own:
                    group["lr"] = None
        self._place_lr()  # before any capture: no allocation inside a graph

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # A checkpoint's lr may be a tensor (saved by a capturable run, loaded to the CPU)
        super().load_state_dict(state_dict)
        self._place_lr()

    def __setstate__(self, state: dict[str, Any]) -> None:
        # AdamW's __setstate__ forces decoupled decay on load; keep what adam_w_mode chose.
        torch.optim.Adam.__setstate__(self, state)

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        super().zero_grad(self.set_grad_none if set_to_none is None else set_to_none)

    def _place_lr(self) -> None:
        """Each group's ``lr`` where its step reads it: for a capturable GPU group a 0-d fp32
        tensor on the parameters' device (a number, or a tensor elsewhere, e.g. a checkpoint's
        loaded to the CPU, is moved there once; the scheduler then fills it in place), for any
        other group a number (torch's foreach step refuses a tensor lr without capturable)."""
        for group in self.param_groups:
            params, lr = group["params"], group["lr"]
            if lr is None or not params:
                continue
            if group.get("capturable") and _is_gpu(params[0]):
                device = params[0].device
                if not (isinstance(lr, torch.Tensor) and lr.device == device):
                    group["lr"] = torch.tensor(float(lr), dtype=torch.float32, device=device)
            elif isinstance(lr, torch.Tensor):
                group["lr"] = float(lr)

    def _complete_state(self) -> list[torch.Tensor]:
        """Give every parameter a full state, in parameter order; return the steps of the
        parameters without a gradient (torch's step skips them, Apex's and TE's count them)."""
        idle_steps = []
        for group in self.param_groups:
            on_device = group.get("fused") or group.get("capturable")
            moments = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group["amsgrad"] else ())
            group_step: float | None = None
            for param in group["params"]:
                state = self.state[param]  # creates the entry: the same key order on every rank
                if "step" not in state:
                    if group_step is None:
                        group_step = _group_step(group, self.state)
                    device = param.device if on_device else "cpu"
                    state["step"] = torch.tensor(group_step, dtype=torch.float32, device=device)
                for name in moments:
                    if name not in state:
                        state[name] = torch.zeros_like(param, memory_format=torch.preserve_format)
                if param.grad is None:
                    idle_steps.append(state["step"])
        return idle_steps

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        unset = [i for i, g in enumerate(self.param_groups) if g["lr"] is None]
        if unset:
            raise ValueError(
                f"FusedAdam.step(): param group(s) {unset} have lr=None; set each group's 'lr' "
                "(Megatron's OptimizerParamScheduler does) before the first step"
            )
        self._place_lr()  # lr=None at construction: placed at the first step
        idle_steps = self._complete_state()
        loss = super().step(closure)
        for count in idle_steps:
            count += 1
        return loss


def _group_step(group: dict[str, Any], state: Any) -> float:
    """The step a parameter joining ``group`` starts from: Apex's group step (a checkpoint may
    hold None), else the step its neighbours reached, else 0."""
    if group.get("step") is not None:
        return float(group["step"])
    steps = [float(state[p]["step"]) for p in group["params"] if "step" in state.get(p, {})]
    return max(steps, default=0.0)


def adam_reference_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: int,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    adam_w_mode: bool,
) -> None:
    """One textbook Adam(W) update in place (Apex's FusedAdam math), the parity oracle."""
    beta1, beta2 = betas
    if adam_w_mode:
        param.mul_(1 - lr * weight_decay)
    else:
        grad = grad + weight_decay * param
    exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    m_hat = exp_avg / (1 - beta1**step)
    v_hat = exp_avg_sq / (1 - beta2**step)
    param.sub_(lr * m_hat / (v_hat.sqrt() + eps))
