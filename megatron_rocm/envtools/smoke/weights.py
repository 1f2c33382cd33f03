"""Move one model's weights into the same model under another parallel layout, in memory.

A parallel check must start from exactly the weights of the 1-GPU run it is compared with.
Megatron describes every local tensor by its place in the global one (``sharded_state_dict``:
key, global shape, offset, axes prepended for stacked layers or experts), which is what lets
its checkpoints reshard across TP/PP/EP. The same description is used here: the 1-GPU model's
shards are assembled into whole tensors (:func:`full_weights`), and any layout's model takes
its slices of them (:func:`load_full_weights`). Shard factories (the SwiGLU fc1 split, grouped
experts) are expanded with Megatron's own ``apply_factories``; their pieces are views of the
parameters, and :func:`load_full_weights` verifies that every parameter really changed hands.
"""

from __future__ import annotations

from typing import Any

import torch


def _sharded_tensors(model: Any) -> list[Any]:
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    state = model.sharded_state_dict()
    apply_factories(state)
    out = []
    for value in nested_values(state):
        if isinstance(value, ShardedTensor):
            if value.flattened_range is not None:
                raise ValueError(f"{value.key}: flattened shards are not supported here")
            out.append(value)
    return out


def _region(sh: Any) -> tuple[slice, ...]:
    sizes = (1,) * sh.prepend_axis_num + tuple(sh.local_shape)
    return tuple(slice(o, o + n) for o, n in zip(sh.global_offset, sizes))


def full_weights(model: Any) -> dict[str, torch.Tensor]:
    """Whole tensors (fp32, CPU) by checkpoint key, from a model that holds every shard."""
    full: dict[str, torch.Tensor] = {}
    covered: dict[str, int] = {}
    for sh in _sharded_tensors(model):
        whole = full.setdefault(sh.key, torch.zeros(sh.global_shape, dtype=torch.float32))
        region = _region(sh)
        part = sh.data.detach().float().cpu().reshape(whole[region].shape)
        whole[region] = part
        covered[sh.key] = covered.get(sh.key, 0) + part.numel()
    partial = [k for k, t in full.items() if covered[k] < t.numel()]
    if partial:
        raise ValueError(f"the reference model does not hold all of {partial[:3]}")
    return full


@torch.no_grad()
def load_full_weights(model: Any, full: dict[str, torch.Tensor]) -> int:
    """Copy this rank's slice of every tensor in ``full`` into ``model``; return the count.

    Raises when a key is missing or when a copied shard does not read back (a factory that
    built a copy instead of a view would silently leave the parameter untouched)."""
    count = 0
    for sh in _sharded_tensors(model):
        if sh.key not in full:
            raise KeyError(f"{sh.key} is not in the reference model (layouts differ)")
        sh.data.copy_(full[sh.key][_region(sh)].reshape(sh.data.shape))
        count += 1
    for sh in _sharded_tensors(model):  # read back through fresh views of the parameters
        want = full[sh.key][_region(sh)].reshape(sh.data.shape).to(sh.data.dtype)
        if not torch.equal(sh.data.detach().cpu(), want):
            raise RuntimeError(f"{sh.key}: the weights did not load into the parameter")
    return count
