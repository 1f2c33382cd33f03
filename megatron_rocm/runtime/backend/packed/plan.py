"""How a packed (THD) batch is laid out, worked out once per batch and shared by every layer.

``PackedSeqParams`` carries ``cu_seqlens_q/kv`` (cumulative document lengths) and optionally
``cu_seqlens_q/kv_padded`` (cumulative storage offsets, padding included). Upstream passes the
same tensors to every layer, so the plan is cached on their identity (and in-place version):
its one host copy of the offsets (validation, document list, longest document) happens once
per batch, not once per layer.

``direct`` plans can run a varlen kernel on the storage offsets as they are: no padding, or
causal attention where each document's padding comes after its last real token (no real query
can see it; the padding rows' outputs are zeroed afterwards). Other plans gather the real
tokens first.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(eq=False)
class PackedPlan:
    t_q: int
    t_kv: int
    cu_q: torch.Tensor  # int32, on the device: cumulative real lengths
    cu_kv: torch.Tensor
    offsets_q: torch.Tensor  # int32, on the device: where each document starts in storage
    offsets_kv: torch.Tensor
    host: dict[str, list[int]]  # the same four, on the host
    direct: bool
    sources: tuple[torch.Tensor | None, ...] = ()
    versions: tuple[int, ...] = ()
    causal: bool = False
    _memo: dict[str, object] = field(default_factory=dict)

    def documents(self) -> list[tuple[int, int, int, int]]:
        """(start_q, len_q, start_kv, len_kv) per document, in storage rows."""
        cu_q, cu_kv, off_q, off_kv = (self.host[k] for k in ("cu_q", "cu_kv", "off_q", "off_kv"))
        return [
            (off_q[i], cu_q[i + 1] - cu_q[i], off_kv[i], cu_kv[i + 1] - cu_kv[i])
            for i in range(len(cu_q) - 1)
        ]

    def max_stored(self, side: str) -> int:
        """Longest document including its padding (what a kernel on the offsets sees)."""
        off = self.host[f"off_{side}"]
        return max([b - a for a, b in zip(off, off[1:])] + [1])

    def max_len(self, side: str) -> int:
        cu = self.host[f"cu_{side}"]
        return max([b - a for a, b in zip(cu, cu[1:])] + [1])

    def gather_index(self, side: str) -> torch.Tensor:
        """Storage rows of the real tokens, document by document (int64, on the device)."""
        key = f"gather_{side}"
        if key not in self._memo:
            self._memo[key] = rows_mask(self, side).nonzero().squeeze(1)
        return self._memo[key]  # type: ignore[return-value]


def segments(plan: PackedPlan, side: str) -> torch.Tensor:
    """Int32 ``[t]``: the document whose storage span holds each row (``n`` past the end)."""
    key = f"segment_{side}"
    if key not in plan._memo:
        t = plan.t_q if side == "q" else plan.t_kv
        off = plan.offsets_q if side == "q" else plan.offsets_kv
        starts = torch.zeros(t + 1, device=off.device, dtype=torch.int32)
        starts.index_add_(0, off[1:].long(), torch.ones_like(off[1:]))  # empty documents add 2
        plan._memo[key] = starts[:t].cumsum(0, dtype=torch.int32)
    return plan._memo[key]  # type: ignore[return-value]


def rows_mask(plan: PackedPlan, side: str) -> torch.Tensor:
    """Bool ``[t]``: True for rows holding a real token (no host sync)."""
    key = f"valid_{side}"
    if key not in plan._memo:
        t = plan.t_q if side == "q" else plan.t_kv
        cu, off = (plan.cu_q, plan.offsets_q) if side == "q" else (plan.cu_kv, plan.offsets_kv)
        n = cu.numel() - 1
        rows = torch.arange(t, device=cu.device, dtype=torch.int32)
        doc = segments(plan, side)
        inside = doc < n
        doc = doc.clamp(max=max(n - 1, 0))
        lengths = cu[1:] - cu[:-1]
        plan._memo[key] = inside & (rows - off[doc] < lengths[doc])
    return plan._memo[key]  # type: ignore[return-value]


_cache: list[PackedPlan] = []

# The offsets a ``PackedSeqParams`` carries, in the order the layout caches take them.
OFFSET_NAMES = ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded")


def versions_of(sources: tuple[torch.Tensor | None, ...]) -> tuple[int, ...]:
    """In-place versions of the offset tensors (-1 for an absent one)."""
    return tuple(-1 if s is None else s._version for s in sources)


def same_batch(
    cached: tuple[torch.Tensor | None, ...],
    cached_versions: tuple[int, ...],
    sources: tuple[torch.Tensor | None, ...],
) -> bool:
    """Whether ``sources`` are the very tensors a cached layout was worked out from, unchanged:
    upstream hands every layer the same offset tensors, so a layout is computed once a batch."""
    return all(a is b for a, b in zip(cached, sources)) and cached_versions == versions_of(sources)


def build_plan(
    t_q: int,
    t_kv: int,
    cu_q: torch.Tensor,
    cu_kv: torch.Tensor,
    padded_q: torch.Tensor | None,
    padded_kv: torch.Tensor | None,
    *,
    causal: bool,
    device: torch.device,
) -> PackedPlan:
    """Validate the offsets and decide the layout (cached for the same tensors)."""
    sources = (cu_q, cu_kv, padded_q, padded_kv)
    for plan in _cache:
        if (
            same_batch(plan.sources, plan.versions, sources)
            and (plan.t_q, plan.t_kv, plan.causal) == (t_q, t_kv, causal)
            and plan.cu_q.device == device
        ):
            return plan
    plan = _new_plan(t_q, t_kv, sources, causal, device)
    plan.sources, plan.versions = sources, versions_of(sources)
    _cache[:] = [plan]
    return plan


def as_offsets(x: torch.Tensor, name: str, device: torch.device) -> torch.Tensor:
    """Cumulative offsets as an int32 ``[n+1]`` tensor on ``device`` (a leading batch dim of 1,
    as some tags' batches keep, is dropped)."""
    if x.dim() == 2 and x.shape[0] == 1:  # core_v0.16's SFT batches keep a batch dim of 1
        x = x[0]
    if x.dim() != 1 or x.numel() < 2 or x.dtype.is_floating_point:
        raise ValueError(f"{name} must be an integer [n+1] tensor, got {x.dtype} {tuple(x.shape)}")
    return x.to(device=device, dtype=torch.int32)


def _new_plan(
    t_q: int,
    t_kv: int,
    sources: tuple[torch.Tensor | None, ...],
    causal: bool,
    device: torch.device,
) -> PackedPlan:
    dev = [None if s is None else as_offsets(s, n, device) for s, n in zip(sources, OFFSET_NAMES)]
    sizes = {d.numel() for d in dev if d is not None}
    if len(sizes) != 1:
        raise ValueError(
            f"cu_seqlens tensors differ in length: {[tuple(d.shape) for d in dev if d is not None]}"
        )
    cu_q, cu_kv = dev[0], dev[1]
    off_q = cu_q if dev[2] is None else dev[2]
    off_kv = cu_kv if dev[3] is None else dev[3]
    # One host copy per batch: everything below is decided from these lists.
    cu_q_h, cu_kv_h, off_q_h, off_kv_h = torch.stack([cu_q, cu_kv, off_q, off_kv]).tolist()
    for side, cu, off, t in (("q", cu_q_h, off_q_h, t_q), ("kv", cu_kv_h, off_kv_h, t_kv)):
        lengths = [b - a for a, b in zip(cu, cu[1:])]
        room = [b - a for a, b in zip(off, off[1:])]
        if cu[0] != 0 or off[0] != 0 or min(lengths) < 0 or min(room) < 0:
            raise ValueError(f"cu_seqlens_{side} must start at 0 and not decrease: {cu} / {off}")
        if any(length > r for length, r in zip(lengths, room)) or off[-1] > t:
            raise ValueError(
                f"cu_seqlens_{side}_padded {off} cannot hold documents of lengths {lengths} in "
                f"{t} rows"
            )
    if causal and [b - a for a, b in zip(cu_q_h, cu_q_h[1:])] != [
        b - a for a, b in zip(cu_kv_h, cu_kv_h[1:])
    ]:
        raise ValueError(
            "causal packed attention needs equal query and key lengths per document "
            f"(self-attention); got cu_seqlens_q={cu_q_h}, cu_seqlens_kv={cu_kv_h}"
        )
    unpadded = off_q_h == cu_q_h and off_kv_h == cu_kv_h
    # Causal: padding after each document's last token is invisible to every real query.
    same_layout = off_q_h == off_kv_h and cu_q_h == cu_kv_h
    direct = unpadded or (causal and same_layout)
    if unpadded:
        off_q, off_kv = cu_q, cu_kv
    return PackedPlan(
        t_q=t_q,
        t_kv=t_kv,
        cu_q=cu_q,
        cu_kv=cu_kv,
        offsets_q=off_q,
        offsets_kv=off_kv,
        host={"cu_q": cu_q_h, "cu_kv": cu_kv_h, "off_q": off_q_h, "off_kv": off_kv_h},
        direct=direct,
        causal=causal,
    )
