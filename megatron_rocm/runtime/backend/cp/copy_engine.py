"""Ulysses' exchanges on the GPUs' copy engines, through symmetric memory, within one host.

The a2a scheme moves every query, output and their gradients across the CP group, 288 MB per
layer and micro-batch for Llama-2-70B's heads at 16k on two GPUs, and nothing can run while a
layer's exchange is in flight. NCCL's point-to-point kernels moved 64-80 MB between two H200s
at 238-246 GiB/s; a copy engine reading the same bytes from the peer's memory moved them at
307-313 GiB/s, and writing them at 317-324 GiB/s, without taking SMs from the kernels beside
it.

So every rank of a CP group on one host maps one symmetric allocation (``torch.distributed.
_symmetric_memory``) with two regions: an *outbox*, which the rank packs the heads bound for
each peer into and the peers pull from, and an *inbox*, which the peers push results into.
Transfers are plain ``copy_`` between contiguous tensors (``cudaMemcpyAsync``: a copy engine)
on a side stream. One barrier of the group (symmetric memory's signal pads, on the side
stream) per exchange says every rank has written: after it, a scatter pulls from the peers'
outboxes, a gather unpacks its inbox. No second barrier guards the regions against being
written again too early, because Ulysses alternates scatter and gather on every link:

* a rank packs its outbox again only after the gather that followed its last scatter has
  sealed, and every peer pulled from it before its own barrier of that gather;
* a rank pushes into a peer's inbox only after the scatter before it has sealed, and the peer
  queued its barrier of that scatter after unpacking its inbox the time before.

What a review of this protocol asked for, and what the link
does about it:

* exchanges queued from a second compute stream: a rank packs its outbox only once the
  current stream has waited for everything the link queued before (``before_packing``), and
  the link's next barrier waits for the unpacking of its inbox (``after_unpacking``), so the
  argument above holds whichever stream queues an exchange;
* a kernel raising with copies in flight: buffers the side stream writes or reads are
  recorded on it, so the allocator never hands their memory out while a copy may still run;
* a rank dying mid-exchange: every barrier times out after the CP group's own collective
  timeout (Megatron's ``--distributed-timeout-minutes``) and traps its kernel, which leaves the
  process's CUDA context unusable, much as NCCL's watchdog aborts the process, instead of
  spinning;
* sizes that keep growing: the window grows at least twofold, so it is remapped a few times,
  not at every new size (each region may so hold up to twice the largest exchange, and never
  shrinks);
* a group made again under a name an earlier group had: PyTorch caches symmetric memory's
  store by group name, so such a group keeps the process group (logged under ``auto``; the
  record outlives ``decide_again``, as PyTorch's cache does);
* "one host" is judged by host name.

``MEGATRON_ROCM_CP_A2A_TRANSPORT`` picks: ``auto`` (the default: copy engines on CUDA where
every rank of the group is on this host and symmetric memory maps, the process group's
point-to-point otherwise; ROCm keeps RCCL until this is measured on AMD GPUs),
``process-group`` or ``copy-engine`` (an error where it cannot work).
"""

from __future__ import annotations

import math
import socket
import warnings
import weakref
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from megatron_rocm.runtime import settings
from megatron_rocm.runtime.kernels.launch import is_hip, log_fallback_once
from megatron_rocm.runtime.platform import capturing

Tensor = torch.Tensor

TRANSPORT_ENV = "MEGATRON_ROCM_CP_A2A_TRANSPORT"
TRANSPORTS = settings.choices(TRANSPORT_ENV)
_ALIGN = 256  # bytes: every view starts on a boundary any dtype's copy kernel is happy with
_PROBE_BYTES = 1 << 20  # the first window: maps the peers once before any exchange needs it

# by (group name, id of the group): upstream's tests destroy groups and make new ones whose
# names can repeat; a link keeps its group alive, so its id is not reused while cached
_links: dict[tuple[str, int], CopyEngineLink | None] = {}
# group name -> the group that mapped symmetric memory under it (PyTorch's store is per name)
_mapped_names: dict[str, weakref.ref] = {}


def requested_transport() -> str:
    """The transport ``MEGATRON_ROCM_CP_A2A_TRANSPORT`` asks for (``auto`` if unset)."""
    return str(settings.get(TRANSPORT_ENV))


def why_not_copy_engines(group: Any, device: torch.device, on_rocm: bool, auto: bool) -> str | None:
    """Why this group's exchanges cannot (or, under ``auto``, should not) use copy engines.

    Collective over ``group`` once the local checks pass: every rank must see the same host.
    """
    if device.type != "cuda":
        return f"the tensors are on {device.type}, not a GPU"
    if auto and on_rocm:
        return "ROCm keeps RCCL until copy engines are measured on AMD GPUs"
    backend = str(dist.get_backend(group))
    if "nccl" not in backend:  # "nccl", or a per-device list such as "cpu:gloo,cuda:nccl"
        return f"the CP group's backend is {backend}, not nccl"
    try:
        import torch.distributed._symmetric_memory  # noqa: F401
    except ImportError as exc:
        return f"this PyTorch has no symmetric memory ({exc})"
    hosts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    if len(set(hosts)) > 1:
        return "the CP group spans hosts"
    earlier = _mapped_names.get(group.group_name)
    if earlier is not None and earlier() is not group:
        return (
            f"an earlier group named {group.group_name!r} mapped symmetric memory, whose store "
            f"PyTorch caches by group name"
        )
    return None


def group_timeout_ms(group: Any) -> int:
    """The group's collective timeout in milliseconds (what its NCCL watchdog waits), or
    PyTorch's default for NCCL groups where the group does not say."""
    timeout = None
    try:
        timeout = group._get_backend(torch.device("cuda")).options._timeout
    except (AttributeError, RuntimeError, ValueError):
        pass
    if not isinstance(timeout, timedelta):
        timeout = getattr(dist.constants, "default_pg_nccl_timeout", None) or timedelta(minutes=10)
    return max(1, int(timeout.total_seconds() * 1000))


def link_for(group: Any, device: torch.device) -> CopyEngineLink | None:
    """The group's copy-engine link, or None for the process group's point-to-point.

    Decided once per group (every rank of it calls this at the same point: the first a2a
    attention), from ``MEGATRON_ROCM_CP_A2A_TRANSPORT``; under ``auto`` every reason not to
    use copy engines is logged once, and ``copy-engine`` that cannot work is an error.
    """
    key = group_key(group)
    if key in _links:
        return _links[key]
    group = group if group is not None else dist.group.WORLD
    choice = requested_transport()
    link = None
    if choice != "process-group":
        reason = why_not_copy_engines(group, device, is_hip(), auto=choice == "auto")
        if reason is None:
            # every rank records the name before the probe, whether its mapping then works or
            # not (one rank's failure keeps all on the process group, but PyTorch's store for
            # the name exists on all of them): a later group of this name is refused alike
            _mapped_names[group.group_name] = weakref.ref(group)
            link = CopyEngineLink(group, device)
            reason = link.probe()
        if reason:
            if choice == "copy-engine":
                raise ValueError(f"{TRANSPORT_ENV}=copy-engine: {reason}")
            log_fallback_once(
                f"a2a-transport:{reason}", f"a2a exchanges through the process group: {reason}"
            )
            link = None
    _links[key] = link
    return link


def link_for_call(group: Any, device: torch.device) -> CopyEngineLink | None:
    """``link_for``, except while a CUDA graph is captured: then the process group.

    A capture cannot take the copy engines' side stream (its earlier work was never captured:
    CUDA refuses the dependency) nor the first call's probe, whose collectives and symmetric
    allocation must not be recorded; NCCL's and RCCL's point-to-point can be. So a captured
    a2a exchanges through the process group, and an explicit ``copy-engine`` is an error there.
    Eager calls before and after the capture (warm-up, evaluation) keep the group's transport.
    """
    if not capturing(device):
        return link_for(group, device)
    if requested_transport() == "copy-engine":
        raise ValueError(
            f"{TRANSPORT_ENV}=copy-engine: copy engines cannot join a CUDA-graph capture "
            "(--cuda-graph-impl); unset it or use process-group"
        )
    log_fallback_once(
        "a2a-transport:capture",
        "a2a exchanges through the process group while a CUDA graph is captured",
    )
    return None


def group_key(group: Any) -> tuple[str, int]:
    """A CP group's name and identity (``None``: the default group), as its exchanges are
    keyed."""
    group = group if group is not None else dist.group.WORLD
    return group.group_name, id(group)


def uses_copy_engines(group: Any) -> bool:
    """Whether ``group``'s a2a exchanges were decided to go by copy engines."""
    return _links.get(group_key(group)) is not None


def decide_again() -> None:
    """Forget every group's decision, so the next a2a call reads the transport switch anew
    (benchmarks and tests that change it between cases; drops the links' windows)."""
    _links.clear()


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def slot(owner: int, other: int) -> int:
    """The segment of ``owner``'s region that holds what goes to (outbox) or came from (inbox)
    group rank ``other``: the owner's peers in rank order, the owner left out."""
    return other if other < owner else other - 1


class Layout:
    """Where each tensor of one exchange sits in a region: one segment per peer (the
    destination in an outbox, the source in an inbox, ``slot``), the tensors one after the
    other in each, every one of the same shape on every rank."""

    def __init__(self, shapes: list[tuple[tuple[int, ...], torch.dtype]], ranks: int) -> None:
        self.shapes = shapes
        self.offsets, size = [], 0
        for shape, dtype in shapes:
            self.offsets.append(size)
            size += _aligned(math.prod(shape) * dtype.itemsize)
        self.segment = size
        self.nbytes = size * (ranks - 1)


class CopyEngineLink:
    """One CP group's symmetric window, side stream and barriers (see the module docstring)."""

    def __init__(self, group: Any, device: torch.device) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        self.timeout_ms = group_timeout_ms(group)
        self._window: Tensor | None = None
        self._handle: Any = None
        self._region = 0  # bytes per region (outbox, then inbox)

    def probe(self) -> str | None:
        """Map a first window on every rank; why that failed on any of them, else None (the
        ranks agree, so all of them take the same transport)."""
        failure = None
        try:
            self.reserve(_PROBE_BYTES)
        except Exception as exc:  # noqa: BLE001 - any failure to map means: not here
            first = (str(exc).strip().splitlines() or [""])[0]
            failure = f"symmetric memory did not map ({type(exc).__name__}: {first})"
        mapped = torch.tensor([0 if failure else 1], device=self.device)
        dist.all_reduce(mapped, op=dist.ReduceOp.MIN, group=self.group)
        if failure is None and not mapped.item():
            failure = "symmetric memory did not map on another rank of the CP group"
        return failure

    def reserve(self, nbytes: int) -> None:
        """Grow both regions to hold ``nbytes``, at least doubling them (collective: every rank
        asks for the same sizes, since every rank's exchanges have the same shapes)."""
        if nbytes <= self._region:
            return
        import torch.distributed._symmetric_memory as symm_mem

        torch.cuda.synchronize(self.device)  # nothing may still read or write the old window
        region = _aligned(max(nbytes, 2 * self._region))
        window = symm_mem.empty(2 * region, dtype=torch.uint8, device=self.device)
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None:  # a subgroup's store; releases that call it unneeded warn
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                enable(self.group.group_name)
        handle = symm_mem.rendezvous(window, self.group.group_name)
        self._window, self._handle, self._region = window, handle, region

    def _views(self, rank: int | None, base: int, layout: Layout, index: int) -> list[Tensor]:
        """``layout``'s tensors in segment ``index`` of the region at ``base``: of this rank's
        window (``rank`` None) or mapped from group rank ``rank``'s."""
        start = base + index * layout.segment
        views = []
        for (shape, dtype), offset in zip(layout.shapes, layout.offsets, strict=True):
            nbytes = math.prod(shape) * dtype.itemsize
            if rank is None:
                assert self._window is not None
                raw = self._window[start + offset : start + offset + nbytes]
            else:
                raw = self._handle.get_buffer(rank, (nbytes,), torch.uint8, start + offset)
            views.append(raw.view(dtype).view(shape))
        return views

    def outbox(self, layout: Layout, dst: int) -> list[Tensor]:
        """This rank's outbox views for group rank ``dst``."""
        return self._views(None, 0, layout, slot(self.rank, dst))

    def peer_outbox(self, layout: Layout, src: int) -> list[Tensor]:
        """Group rank ``src``'s outbox views for this rank (mapped from its memory)."""
        return self._views(src, 0, layout, slot(src, self.rank))

    def inbox(self, layout: Layout, src: int) -> list[Tensor]:
        """This rank's inbox views for what group rank ``src`` pushes."""
        return self._views(None, self._region, layout, slot(self.rank, src))

    def peer_inbox(self, layout: Layout, dst: int) -> list[Tensor]:
        """Group rank ``dst``'s inbox views for what this rank pushes there."""
        return self._views(dst, self._region, layout, slot(dst, self.rank))

    def before_packing(self) -> None:
        """Make the current stream wait for everything the link has queued: the outbox may
        be written once the last exchange's barrier has passed, whichever stream queued it."""
        torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def after_unpacking(self) -> None:
        """Make the side stream wait for the current stream's unpacking of the inbox: the
        next barrier, which lets the peers push into it again, comes after it."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def barrier(self) -> None:
        """A barrier of the group on the side stream, after everything the current stream
        has queued so far; a peer missing for the group's timeout stops it with an error."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            self._handle.barrier(channel=0, timeout_ms=self.timeout_ms)

    def uses(self, tensors: list[Tensor] | tuple[Tensor, ...]) -> None:
        """``tensors``, of the current stream's memory, are read or written by the side stream:
        their memory is not handed out again before its copies have run, even if the caller
        fails before waiting for them."""
        for t in tensors:
            t.record_stream(self.stream)

    def copy(
        self,
        pairs: list[tuple[Tensor, Tensor]],
        keep: tuple[Tensor, ...] = (),
        after_current: bool = True,
    ) -> Arrival:
        """Copy each ``(dst, src)`` on the side stream, after the current stream's work so far
        unless ``after_current`` is False (the caller knows the side stream already waited for
        everything the copies need); ``keep`` are tensors of the current stream's allocator
        read there."""
        if after_current:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            for dst, src in pairs:
                dst.copy_(src)
        self.uses(keep)
        return self._arrival()

    def seal(self) -> Arrival:
        """A barrier (``barrier``) that the current stream can wait for: every rank has
        written what it had queued before it."""
        self.barrier()
        return self._arrival()

    def _arrival(self) -> Arrival:
        event = torch.cuda.Event()
        event.record(self.stream)
        return Arrival(event)


class Arrival:
    """Copies queued on the side stream; ``wait`` makes the current stream wait for them (the
    host never waits), as a process group's ``Work.wait`` does."""

    def __init__(self, event: Any) -> None:
        self._event = event

    def wait(self) -> list[Tensor]:
        torch.cuda.current_stream().wait_event(self._event)
        return []
