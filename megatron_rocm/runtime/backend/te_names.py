"""The names the ``te-spec-backend`` patch binds in ``megatron/core/extensions/transformer_engine.py``.

``from megatron_rocm.runtime.backend.te_names import *`` runs at the end of upstream's TE
extension module when ``import transformer_engine`` failed, so every
``from megatron.core.extensions.transformer_engine import TELinear`` (specs, models, upstream's
own tests) gets the native module. Only names listed in ``__all__`` are rebound: everything
else in that module keeps its no-TE meaning (``HAVE_TE`` False, TE-only helpers unusable), so
code paths that really need TE still take their TE-less branch.
"""

from __future__ import annotations

from megatron_rocm.runtime.backend.dot_product_attention import TEDotProductAttention
from megatron_rocm.runtime.backend.fp8_padding import Fp8Padding, Fp8Unpadding
from megatron_rocm.runtime.backend.grouped_linear import (
    TEColumnParallelGroupedLinear,
    TEGroupedLinear,
    TERowParallelGroupedLinear,
)
from megatron_rocm.runtime.backend.layernorm_linear import (
    TELayerNormColumnParallelLinear,
    split_te_layernorm_column_parallel_linear,
)
from megatron_rocm.runtime.backend.linear import (
    TEColumnParallelLinear,
    TELinear,
    TERowParallelLinear,
)
from megatron_rocm.runtime.backend.norm import TENorm

__all__ = [
    "Fp8Padding",
    "Fp8Unpadding",
    "TEColumnParallelGroupedLinear",
    "TEColumnParallelLinear",
    "TEDotProductAttention",
    "TEGroupedLinear",
    "TELayerNormColumnParallelLinear",
    "TELinear",
    "TENorm",
    "TERowParallelGroupedLinear",
    "TERowParallelLinear",
    "split_te_layernorm_column_parallel_linear",
]
