"""TENorm without TransformerEngine: LayerNorm or RMSNorm picked from the config.

Like TE's ``TENorm``, a factory (``__new__``) returning a norm module: here
``kernels.norm.FusedNorm`` (torch's fused LayerNorm/RMSNorm kernels, zero-centred gamma,
sequence parallelism), with TE's parameter names (``weight``, ``bias``). The residual-fused
RMSNorm of main (``--fused-residual-rmsnorm``) is a TE kernel; it is rejected at argument
validation (``backend.options``) rather than silently run unfused.
"""

from __future__ import annotations

from typing import Any

from megatron_rocm.runtime.kernels.norm import FusedNorm, build_norm


class TENorm:
    """``TENorm(config, hidden_size, eps=1e-5, has_residual=False)`` -> a ``FusedNorm``."""

    def __new__(  # noqa: D102 - documented on the class
        cls, config: Any, hidden_size: int, eps: float = 1e-5, has_residual: bool = False
    ) -> FusedNorm:
        if getattr(config, "fused_residual_rmsnorm", False) and has_residual:
            raise ValueError(
                "TENorm: fused_residual_rmsnorm needs TransformerEngine's fused kernel; "
                "remove --fused-residual-rmsnorm"
            )
        if config.normalization not in ("LayerNorm", "RMSNorm"):
            raise ValueError(f"TENorm: only LayerNorm and RMSNorm, got {config.normalization!r}")
        norm = build_norm(config, hidden_size, eps)
        norm.returns_residual = False
        return norm
