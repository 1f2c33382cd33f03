"""The TE spec provider on the native backend: upstream's ``TESpecProvider``, two answers fixed.

Upstream's ``TESpecProvider`` (``extensions/transformer_engine_spec_provider.py``, 0.13+)
returns the TE wrapper classes it imported from ``extensions/transformer_engine.py``; with the
``te-spec-backend`` patch those names are already the native modules. Two of its answers are
version checks against the installed TE, which reads 0.0.0 without TE, and would route around
the native modules:

* ``layer_norm(for_qk=True)`` returns Apex's ``FusedLayerNorm`` below TE 1.9 (the QK norm then
  needs Apex): here it is ``TENorm``;
* ``grouped_mlp_modules(False)`` returns the *local* linears below TE 1.7, with a warning:
  here the experts' linears are the native TE ones.

Everything else is inherited, so each tag keeps its own provider API (the methods and return
shapes drift: tuples up to 0.16, ``ExpertsBuilder`` partials later). The patch replaces the
module's ``TESpecProvider`` name with ``native_spec_provider(TESpecProvider)``.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any

from megatron_rocm.runtime.backend import te_names


def _with_native_linears(spec: Any) -> Any:
    """The experts spec ``spec`` with the local column/row linears swapped for the TE ones."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    swap = {
        ColumnParallelLinear: te_names.TEColumnParallelLinear,
        RowParallelLinear: te_names.TERowParallelLinear,
    }

    def fix(submodules: Any) -> Any:
        if submodules is None or not dataclasses.is_dataclass(submodules):
            return submodules
        changes = {
            f.name: swap[getattr(submodules, f.name)]
            for f in dataclasses.fields(submodules)
            if getattr(submodules, f.name, None) in swap
        }
        return dataclasses.replace(submodules, **changes) if changes else submodules

    if isinstance(spec, tuple):  # (module, submodules), up to 0.16
        module, submodules = spec
        return module, fix(submodules)
    if isinstance(spec, functools.partial):  # ExpertsBuilder, 0.17+
        keywords = dict(spec.keywords)
        if "submodules" in keywords:
            keywords["submodules"] = fix(keywords["submodules"])
        return functools.partial(spec.func, *spec.args, **keywords)
    return spec


@functools.cache
def native_spec_provider(upstream: type) -> type:
    """A subclass of the running tree's ``TESpecProvider`` that keeps to the native modules."""

    class NativeSpecProvider(upstream):  # type: ignore[misc, valid-type]
        """``TESpecProvider`` on megatron-rocm's native backend (TransformerEngine absent)."""

        def layer_norm(self, rms_norm: bool = False, for_qk: bool = False, **kwargs: Any) -> Any:
            if for_qk:
                return te_names.TENorm
            return super().layer_norm(rms_norm=rms_norm, for_qk=for_qk, **kwargs)

        def grouped_mlp_modules(self, moe_use_grouped_gemm: bool, *args: Any, **kwargs: Any) -> Any:
            with warnings.catch_warnings():
                # "Only transformer-engine>=1.7.0 supports MoE experts": about TE, not us.
                warnings.simplefilter("ignore")
                spec = super().grouped_mlp_modules(moe_use_grouped_gemm, *args, **kwargs)
            return _with_native_linears(spec)

    NativeSpecProvider.__qualname__ = "NativeSpecProvider"
    return NativeSpecProvider
