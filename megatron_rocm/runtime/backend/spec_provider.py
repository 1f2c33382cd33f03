"""The TE spec provider on the native backend: upstream's ``TESpecProvider``, two answers fixed.

Upstream's ``TESpecProvider`` (``extensions/transformer_engine_spec_provider.py``, 0.13+)
returns the TE wrapper classes it imported from ``extensions/transformer_engine.py``; with the
``te-spec-backend`` patch those names are already the native modules. Two of its answers are
version checks against the installed TE, which without TE reads 0.0.0 (or None, which makes
the check itself raise, on 0.13-0.16), and would route around the native modules:

* ``layer_norm(for_qk=True)`` returns Apex's ``FusedLayerNorm`` below TE 1.9 (the QK norm then
  needs Apex): here it is ``TENorm``;
* ``grouped_mlp_modules(False)`` returns the *local* linears below TE 1.7: here the experts
  are ``SequentialMLP`` over the native TE column/row linears, as with TE.

Everything else is inherited, so each tag keeps its own provider API (methods and return
shapes drift: ``(module, submodules)`` tuples up to 0.16, ``ExpertsBuilder`` partials later).
The patch replaces the module's ``TESpecProvider`` name with
``native_spec_provider(TESpecProvider)``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any

from megatron_rocm.runtime.backend import te_names


def _sequential_experts(provider: Any, returns_tuple: bool) -> Any:
    """``SequentialMLP`` over the native TE linears, in the running tag's spec format."""
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP

    fields = {f.name for f in dataclasses.fields(MLPSubmodules)}
    kwargs: dict[str, Any] = {
        "linear_fc1": te_names.TEColumnParallelLinear,
        "linear_fc2": te_names.TERowParallelLinear,
    }
    if "activation_func" in fields and hasattr(provider, "activation_func"):
        kwargs["activation_func"] = provider.activation_func()
    submodules = MLPSubmodules(**kwargs)
    if returns_tuple:
        return SequentialMLP, submodules
    return functools.partial(SequentialMLP, submodules=submodules)


@functools.cache
def native_spec_provider(upstream: type) -> type:
    """A subclass of the running tree's ``TESpecProvider`` that keeps to the native modules."""
    legacy_api = (
        "moe_use_legacy_grouped_gemm" in inspect.signature(upstream.grouped_mlp_modules).parameters
    )

    class NativeSpecProvider(upstream):  # type: ignore[misc, valid-type]
        """``TESpecProvider`` on megatron-rocm's native backend (TransformerEngine absent)."""

        def layer_norm(self, rms_norm: bool = False, for_qk: bool = False, **kwargs: Any) -> Any:
            if for_qk:
                return te_names.TENorm
            return super().layer_norm(rms_norm=rms_norm, for_qk=for_qk, **kwargs)

        def grouped_mlp_modules(self, moe_use_grouped_gemm: bool, *args: Any, **kwargs: Any) -> Any:
            if moe_use_grouped_gemm and te_names.TEColumnParallelGroupedLinear is not None:
                return super().grouped_mlp_modules(moe_use_grouped_gemm, *args, **kwargs)
            return _sequential_experts(self, returns_tuple=legacy_api)

    NativeSpecProvider.__qualname__ = "NativeSpecProvider"
    return NativeSpecProvider
