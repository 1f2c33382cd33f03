"""The tensor-parallel communication upstream's column and row linears put around their GEMM,
for the native FP8 GEMM (``backend.fp8.parallel_forward``) to sit inside.

Upstream's ``ColumnParallelLinear.forward`` and ``RowParallelLinear.forward`` communicate in
bf16 around ``linear_with_grad_accumulation_and_async_allreduce``; the same exchanges, from
upstream's ``tensor_parallel.mappings`` of the running tree, wrap the FP8 GEMM here:

* column: with sequence parallelism the input is all-gathered over the sequence (its
  gradient reduce-scattered back); without it the input gradient is all-reduced; an expert
  linear whose dispatcher does the communication (``explicit_expert_comm``) and one built
  with ``disable_grad_reduce`` exchange nothing;
* row: the partial outputs are reduce-scattered over the sequence with sequence parallelism,
  all-reduced without it; nothing for an expert linear.

Every rank of a column linear therefore quantizes the same whole input (one amax), as TE's
FP8 linears do by reducing the amax of their gathered input over the group. Upstream's
overlap of the input gradient's all-reduce with the weight-gradient GEMM is not kept.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from megatron.core.tensor_parallel import mappings


def column_input(linear: Any, x: torch.Tensor) -> torch.Tensor:
    """What a column-parallel ``linear``'s GEMM reads: ``x`` gathered over the sequence
    (sequence parallelism), or ``x`` whose gradient is all-reduced over TP."""
    if linear.explicit_expert_comm:
        return x
    if linear.sequence_parallel:
        return _in_group(mappings.gather_from_sequence_parallel_region, linear, x)
    if getattr(linear, "allreduce_dgrad", False):
        return _in_group(mappings.copy_to_tensor_model_parallel_region, linear, x)
    return x  # one TP rank, or disable_grad_reduce


def row_output(linear: Any, partial: torch.Tensor) -> torch.Tensor:
    """A row-parallel ``linear``'s output from its rank's partial sum: reduce-scattered over
    the sequence (sequence parallelism) or all-reduced over TP."""
    if linear.explicit_expert_comm:
        return partial
    if linear.sequence_parallel:
        return _in_group(mappings.reduce_scatter_to_sequence_parallel_region, linear, partial)
    return _in_group(mappings.reduce_from_tensor_model_parallel_region, linear, partial)


def _in_group(exchange: Callable, linear: Any, x: torch.Tensor) -> torch.Tensor:
    """``exchange(x)`` over the linear's TP group (core 0.13 and later keep it on the linear
    and take ``group=``; earlier trees use the global TP group)."""
    group = getattr(linear, "tp_group", None)
    return exchange(x) if group is None else exchange(x, group=group)
