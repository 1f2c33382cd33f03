"""What the TE grouped-linear wrappers do differently per Megatron tag, for :mod:`.grouped_linear`.

Kept apart from the module so the per-tag rules read as one list:

* process groups: parallel_state up to 0.15 (0.13-0.15 accept an explicit ``tp_group``),
  a ``ProcessGroupCollection`` from 0.16 (``expt_tp``, ``ep``, ``expt_dp``);
* parameter attributes: up to 0.18 what TE's ``GroupedLinear`` set for the mode it was given
  plus the wrapper's ``allreduce`` (and, 0.17-0.18, the original ``partition_dim``); from 0.19
  the wrapper's ``_set_expert_parameter_attributes`` rule;
* the ``sharded_state_dict`` layout (one entry per expert, on the expert axis; singleton local
  shards from 0.14; explicit TP/DP groups from 0.16) and the load-time key fixes.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch


@functools.cache
def megatron_version() -> tuple[int, int]:
    """(major, minor) of the running megatron-core (``0.17.0rc0`` counts as 0.17)."""
    from megatron.core import package_info

    return int(package_info.MAJOR), int(package_info.MINOR)


def group_size(group: Any) -> int:
    if group is None or not torch.distributed.is_initialized():
        return 1
    return torch.distributed.get_world_size(group=group)


def group_rank(group: Any) -> int:
    if group is None or not torch.distributed.is_initialized():
        return 0
    return torch.distributed.get_rank(group=group)


def resolve_groups(
    version: tuple[int, int], is_expert: bool, tp_group: Any, pg_collection: Any
) -> tuple[Any, Any]:
    """``(pg_collection or None, tensor-parallel group)`` as the tag's wrapper picks them."""
    from megatron.core import parallel_state as ps

    if version >= (0, 16):
        if pg_collection is None:
            from megatron.core.process_groups_config import ProcessGroupCollection

            pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        return pg_collection, pg_collection.expt_tp
    if tp_group is None:
        getter = (
            ps.get_expert_tensor_parallel_group if is_expert else ps.get_tensor_model_parallel_group
        )
        tp_group = getter(check_initialized=False)
    return None, tp_group


def expert_rng_tracker_name() -> str:
    from megatron.core.tensor_parallel.random import get_expert_parallel_rng_tracker_name

    return get_expert_parallel_rng_tracker_name()


def uses_expert_groups(version: tuple[int, int], config: Any, is_expert: bool) -> bool:
    """Whether gradients reduce over the expert data-parallel group (``allreduce=False``)."""
    if not is_expert:
        return False
    ep = config.expert_model_parallel_size > 1
    if version < (0, 19):
        return ep
    etp = (config.expert_tensor_parallel_size or config.tensor_model_parallel_size) != (
        config.tensor_model_parallel_size
    )
    gtp = version >= (0, 20) and getattr(config, "expert_gtp_weight_remat_size", None) != getattr(
        config, "gtp_weight_remat_size", None
    )
    return ep or etp or gtp


def _partition(param: torch.nn.Parameter, dim: int) -> None:
    param.tensor_model_parallel = True
    param.partition_dim = dim
    param.partition_stride = 1


def mark_parameters(
    module: Any,
    *,
    version: tuple[int, int],
    original_mode: str | None,
    is_expert: bool,
    use_expert_pgs: bool,
) -> None:
    """The attributes Megatron's DDP, optimizer and checkpoint resharding read."""
    te_mode = module.parallel_mode  # what TE itself was given (None with explicit comm)
    for name, param in module.named_parameters(recurse=False):
        param.allreduce = not use_expert_pgs
        is_weight = name.startswith("weight")
        if is_weight:  # TE's GroupedLinear.reset_parameters
            _partition(param, 1 if te_mode == "row" else 0)
        elif te_mode == "column":
            _partition(param, 0)
        elif te_mode == "row":
            param.sequence_parallel = module.sequence_parallel
        if version >= (0, 19):  # the wrapper's _set_expert_parameter_attributes
            partitioned = original_mode in ("column", "row") and (
                is_weight or original_mode == "column"
            )
            param.tensor_model_parallel = partitioned
            if partitioned:
                _partition(param, 1 if original_mode == "row" else 0)
        elif version >= (0, 17) and is_weight and module.explicit_expert_comm:
            if original_mode in ("column", "row"):
                param.partition_dim = 0 if original_mode == "column" else 1
                param.partition_stride = 1


def _split_grouped(tensor: torch.Tensor, n: int, key: str) -> list[torch.Tensor]:
    if tensor.ndim > 0 and tensor.shape[0] == n:
        return list(tensor.unbind(0))
    if tensor.ndim > 0 and tensor.shape[0] % n == 0:
        return list(torch.chunk(tensor, n, dim=0))
    raise RuntimeError(
        f"cannot split checkpoint tensor {key} of shape {tuple(tensor.shape)} in {n}"
    )


def load_pre_hook(module: Any, state_dict: dict, prefix: str, *_: Any) -> None:
    """Accept what TE's wrappers accept: per-expert ``_extra_state{i}`` entries from a
    distributed checkpoint (TE merges them into one; without FP8 there is nothing to merge),
    and a single grouped ``weight``/``bias`` tensor (TE >= 2.14 layout) split per expert."""
    n = module.num_gemms
    for i in range(1, n):
        state_dict.pop(f"{prefix}_extra_state{i}", None)
    for name in ("weight", "bias") if module.use_bias else ("weight",):
        key = f"{prefix}{name}"
        if key in state_dict and not any(f"{key}{i}" in state_dict for i in range(n)):
            for i, part in enumerate(_split_grouped(state_dict.pop(key), n, key)):
                state_dict[f"{key}{i}"] = part


def _expert_groups(module: Any) -> tuple[int, int, int, int]:
    """(EP size, EP rank, expert-DP rank for tensors, expert-DP rank for objects)."""
    pg = module._pg_collection
    if pg is None:
        from megatron.core import parallel_state as ps

        edp = ps.get_expert_data_parallel_rank()
        return (
            ps.get_expert_model_parallel_world_size(),
            ps.get_expert_model_parallel_rank(),
            edp,
            edp,
        )
    edp = group_rank(pg.expt_dp)
    edp_objects = group_rank(getattr(pg, "expt_dp_gtp_remat", None) or pg.expt_dp)
    return group_size(pg.ep), group_rank(pg.ep), edp, edp_objects


def sharded_state_dict_grouped(
    module: Any, tp_axis_map: dict, prefix: str, sharded_offsets: tuple, metadata: Any
) -> dict:
    """TE's ``_sharded_state_dict_grouped``: keys ``{prefix}weight{g}``, ``{prefix}bias{g}``,
    ``{prefix}_extra_state`` / ``_extra_state{g}``, each expert on the global expert axis, so
    the checkpoint is interchangeable with ``SequentialMLP``'s and TE's."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    singleton = megatron_version() >= (0, 14) and bool(
        (metadata or {}).get("singleton_local_shards", False)
    )
    full = module.state_dict(prefix="", keep_vars=True)
    ep_size, ep_rank, edp_rank, edp_object_rank = _expert_groups(module)
    n = module.num_gemms
    groups: dict[str, Any] = {}
    if "tp_group" in inspect.signature(make_sharded_tensors_for_checkpoint).parameters:
        groups = {"tp_group": module._tp_group, "dp_cp_group": (metadata or {})["dp_cp_group"]}
    ep_axis = len(sharded_offsets)
    sharded: dict[str, Any] = {}
    for g in range(n):
        expert = ep_rank * n + g
        local = {f"{g}.weight": full[f"weight{g}"], f"{g}._extra_state": full.get("_extra_state")}
        if module.use_bias:
            local[f"{g}.bias"] = full[f"bias{g}"]
        if singleton:
            expert_prefix, offsets = f"{expert}.{prefix}", sharded_offsets
        else:
            expert_prefix = prefix
            offsets = (*sharded_offsets, (ep_axis, expert, ep_size * n))
        sub = make_sharded_tensors_for_checkpoint(local, "", tp_axis_map, offsets, **groups)
        replace_prefix_for_sharding(sub, f"{g}.", expert_prefix)
        sharded[f"{prefix}weight{g}"] = sub[f"{g}.weight"]
        sharded[f"{prefix}_extra_state{'' if g == 0 else g}"] = sub[f"{g}._extra_state"]
        if module.use_bias:
            sharded[f"{prefix}bias{g}"] = sub[f"{g}.bias"]
    for key, entry in sharded.items():
        replica_id = entry.replica_id
        assert len(replica_id) == 3, f"expected (PP, TP, DP) replica_id for {key}: {replica_id}"
        if getattr(entry, "is_data_parallel_fully_shard", False):
            edp = 0
        elif isinstance(entry, ShardedObject):
            edp = edp_object_rank
        else:
            edp = edp_rank
        entry.replica_id = (*replica_id[:2], edp)
    return sharded
