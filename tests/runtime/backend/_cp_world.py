"""A persistent torch.distributed world for the context-parallel tests.

Starting processes and importing torch costs seconds, so one world of ``size`` spawned
processes serves every test of a module: the test process sends a case (a function of this
module, by name, plus keyword arguments) to every rank and collects each rank's return value.
Values travel as ``torch.save`` bytes, so tensors need no shared-memory plumbing.

Gloo on the CPU; NCCL (RCCL on ROCm) with one GPU per rank for the ``gpu`` cases.
"""

from __future__ import annotations

import contextlib
import io
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_rocm.runtime.backend.cp.dispatch import context_parallel_attention

_GROUPS: dict[tuple[tuple[int, ...], ...], Any] = {}


def _dumps(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _loads(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


def shard(x: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """Upstream's CP split, written out independently of the package: chunks r and 2cp-1-r."""
    chunks = x.chunk(2 * cp, dim=0)
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]]).clone()


def unshard(parts: list[torch.Tensor]) -> torch.Tensor:
    """Inverse of ``shard`` given every rank's part in rank order."""
    cp = len(parts)
    chunks: list[torch.Tensor | None] = [None] * (2 * cp)
    for rank, part in enumerate(parts):
        chunks[rank], chunks[2 * cp - 1 - rank] = part.chunk(2, dim=0)
    return torch.cat(chunks)  # type: ignore[arg-type]


def contiguous_split(x: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """A *wrong* layout (plain contiguous split), to show the parity check notices."""
    return x.chunk(cp, dim=0)[rank].clone()


@contextlib.contextmanager
def _as_if_captured() -> Iterator[None]:
    """a2a told it is inside a CUDA-graph capture (CPU worlds cannot capture), failing if it
    still decides the group's transport (its probe's collectives would be captured) or builds
    a handoff."""
    from megatron_rocm.runtime.backend.cp import a2a as a2a
    from megatron_rocm.runtime.backend.cp import copy_engine as link

    def refuse(name: str) -> Callable[..., Any]:
        def called(*args: Any, **kw: Any) -> Any:
            raise AssertionError(f"{name} ran inside a capture")

        return called

    saved = (a2a.capturing, link.capturing, a2a.Handoff, a2a.hand_on_early)
    a2a.capturing = link.capturing = lambda device: True
    a2a.Handoff, a2a.hand_on_early = refuse("Handoff"), refuse("hand_on_early")
    link.decide_again()
    try:
        yield
    finally:
        a2a.capturing, link.capturing, a2a.Handoff, a2a.hand_on_early = saved
    if link._links:
        raise AssertionError("the group's transport was decided inside a capture")


def _group(partition: list[list[int]] | None) -> tuple[Any, tuple[int, ...]]:
    """(CP group containing this rank, its global ranks); every rank creates every group."""
    rank = dist.get_rank()
    if partition is None:
        return None, tuple(range(dist.get_world_size()))
    key = tuple(tuple(p) for p in partition)
    if key not in _GROUPS:
        _GROUPS[key] = [dist.new_group(list(p)) for p in key]
    for ranks, group in zip(key, _GROUPS[key]):
        if rank in ranks:
            return group, ranks
    raise AssertionError(f"rank {rank} is in no group of {partition}")


def _device() -> torch.device:
    return (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend() == "nccl"
        else torch.device("cpu")
    )


def parity_case(
    *,
    tensors: dict[str, torch.Tensor],
    comm_type: str,
    causal: bool,
    scale: float | None,
    dtype: torch.dtype,
    kernel: str = "auto",
    partition: list[list[int]] | None = None,
    layout: str = "zigzag",
    fused: bool = False,
    a2a_stages: int | str | None = None,
    a2a_transport: str | None = None,
) -> dict[str, Any]:
    """Run CP attention on this rank's shard of the full q/k/v; return output and grads, how
    many batches of transfers a2a posted to the process group (``posts``: one per head group
    and direction) and whether a2a's exchanges went by copy engines (``copy_engine``)."""
    from megatron_rocm.runtime.backend.cp import a2a as _cp_a2a
    from megatron_rocm.runtime.backend.cp import copy_engine as _cp_copy_engine

    os.environ["MEGATRON_ROCM_CP_KERNEL"] = kernel
    os.environ.pop(_cp_a2a.STAGES_ENV, None)
    if a2a_stages is not None:
        os.environ[_cp_a2a.STAGES_ENV] = str(a2a_stages)
    if a2a_transport is not None:  # decided once per group: decide again
        os.environ[_cp_copy_engine.TRANSPORT_ENV] = a2a_transport
        _cp_copy_engine.decide_again()
    posted, post = [], _cp_a2a.post
    _cp_a2a.post = lambda *args: posted.append(args) or post(*args)
    group, members = _group(partition)
    cp, cp_rank = len(members), members.index(dist.get_rank())
    split = shard if layout == "zigzag" else contiguous_split
    device = _device()
    local = {n: split(t, cp, cp_rank).to(device) for n, t in tensors.items()}
    if fused:  # q/k/v as strided views of one projection output, as Megatron splits them
        heads = [local[n].shape[2] for n in "qkv"]
        fused_leaf = torch.cat([local[n] for n in "qkv"], dim=2).to(dtype).requires_grad_()
        inputs = fused_leaf.split(heads, dim=2)
    else:
        inputs = leaves = [local[n].to(dtype).requires_grad_() for n in "qkv"]
    try:
        out = context_parallel_attention(
            *inputs, cp_group=group, causal=causal, softmax_scale=scale, comm_type=comm_type
        )
        out.backward(local["grad"].to(dtype))
    finally:
        _cp_a2a.post = post
        os.environ.pop(_cp_a2a.STAGES_ENV, None)
        os.environ.pop(_cp_copy_engine.TRANSPORT_ENV, None)
    copy_engine = _cp_copy_engine.uses_copy_engines(group)
    grads = fused_leaf.grad.split(heads, dim=2) if fused else [t.grad for t in leaves]
    result = {"out": out.detach()}
    result.update({f"d{n}": grad for n, grad in zip("qkv", grads)})
    tensors = {n: t.float().cpu() for n, t in result.items()}
    return {"members": members, "posts": len(posted), "copy_engine": copy_engine, **tensors}


def captured_parity_case(**case: Any) -> dict[str, Any]:
    """``parity_case`` with a2a inside a CUDA-graph capture, as far as it can tell: it must
    then neither decide its group's transport nor hand an exchange to the projection."""
    with _as_if_captured():
        return parity_case(**case)


def ring_hop_case(*, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, Any]:
    """The ring's backward, recording the dtypes of every hop of the dK/dV sums; then again with
    the last hop sent in fp32 as the earlier ones (``_final`` made a no-op). Both dK/dV."""
    from megatron_rocm.runtime.backend.cp import ring as _cp_ring

    os.environ["MEGATRON_ROCM_CP_KERNEL"] = "math"
    cp, rank, device = dist.get_world_size(), dist.get_rank(), _device()
    local = {n: shard(t, cp, rank).to(device) for n, t in tensors.items()}
    exchange, hops = _cp_ring.Ring.exchange, []

    def recording(ring: Any, sent: tuple[torch.Tensor, ...]) -> Any:
        hops.append([str(t.dtype) for t in sent])
        return exchange(ring, sent)

    def grads() -> list[torch.Tensor]:
        leaves = [local[n].to(dtype).requires_grad_() for n in "qkv"]
        out = context_parallel_attention(
            *leaves, cp_group=None, causal=True, softmax_scale=None, comm_type="p2p"
        )
        hops.clear()  # the backward's hops only
        out.backward(local["grad"].to(dtype))
        return [t.grad.cpu() for t in leaves[1:]]

    _cp_ring.Ring.exchange = recording
    try:
        sent_final = grads()
        hop_dtypes = list(hops)
        final = _cp_ring._final
        _cp_ring._final = lambda grads, dtypes: grads
        try:
            sent_fp32 = grads()
        finally:
            _cp_ring._final = final
    finally:
        _cp_ring.Ring.exchange = exchange
    return {"hops": hop_dtypes, "final": sent_final, "fp32": sent_fp32}


def dropout_case(
    *, comm_type: str, p: float, kernel: str, dtype: torch.dtype, shape: tuple[int, ...], eps: float
) -> dict[str, float]:
    """Is the backward the derivative of the dropped-out forward? (a directional derivative)

    The same RNG seed before every call makes the forward a deterministic function of q/k/v.
    Its central difference along a random direction must equal <grad, direction> summed over
    all ranks; a backward that regenerated a different dropout mask would not.
    """
    os.environ["MEGATRON_ROCM_CP_KERNEL"] = kernel
    rank, device = dist.get_rank(), _device()
    s, b, heads, groups, dim = shape
    generator = torch.Generator().manual_seed(100 + rank)

    def rand(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=generator, dtype=torch.float64).to(device, dtype)

    q, k, v = rand(s, b, heads, dim), rand(s, b, groups, dim), rand(s, b, groups, dim)
    grad, dirs = rand(s, b, heads * dim), [rand(*t.shape) for t in (q, k, v)]

    def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: float = p) -> torch.Tensor:
        torch.manual_seed(7 + rank)
        return context_parallel_attention(
            q,
            k,
            v,
            cp_group=None,
            causal=True,
            softmax_scale=None,
            dropout_p=p,
            comm_type=comm_type,
        )

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = forward(*leaves)
    out.backward(grad)
    with torch.no_grad():
        again = forward(q, k, v)
        plain = forward(q, k, v, p=0.0)
        plus = forward(*(t + eps * d for t, d in zip((q, k, v), dirs)))
        minus = forward(*(t - eps * d for t, d in zip((q, k, v), dirs)))
        numeric = ((plus.double() - minus.double()) * grad.double()).sum() / (2 * eps)
        analytic = sum((t.grad.double() * d.double()).sum() for t, d in zip(leaves, dirs))
        both = torch.stack([numeric, analytic]).to(device)
        dist.all_reduce(both)
    return {
        "numeric": both[0].item(),
        "analytic": both[1].item(),
        "repeatable": bool(torch.equal(out.detach(), again)),
        "dropped": (out.detach() - plain).abs().max().item(),
    }


def thd_rows(padded: list[int], cp: int, rank: int) -> list[int]:
    """TE's per-document CP split, written out independently of the package: of every
    document's padded span cut into 2cp equal chunks, chunks r and 2cp-1-r, in order."""
    rows: list[int] = []
    for begin, end in zip(padded, padded[1:]):
        chunk = (end - begin) // (2 * cp)
        for position in (rank, 2 * cp - 1 - rank):
            rows.extend(range(begin + position * chunk, begin + (position + 1) * chunk))
    return rows


def packed_parity_case(
    *,
    tensors: dict[str, torch.Tensor],
    cu_seqlens: list[int],
    padded: list[int] | None,
    causal: bool,
    scale: float | None,
    dtype: torch.dtype,
    kernel: str | None = None,
    rows_of: str = "thd",
    through_module: str | None = None,
) -> dict[str, Any]:
    """Packed CP attention on this rank's rows of the whole packed q/k/v: output and grads.

    ``through_module``: called as upstream's attention layer calls it, through the backend's
    ``TEDotProductAttention`` with ``PackedSeqParams``-like arguments, with CP over the world
    from the config (``static``) or, as hybrid CP does, from ``PackedSeqParams.cp_group`` on
    a module built without CP (``dynamic``), or CP turned off by ``local_cp_size=1`` on a
    module built with it (``off``: every rank attends over all rows).
    """
    from megatron_rocm.runtime.backend.packed.context_parallel import (
        packed_context_parallel_attention,
    )

    cp, rank, device = dist.get_world_size(), dist.get_rank(), _device()
    layout = padded if padded is not None else cu_seqlens
    if through_module == "off":
        rows = list(range(layout[-1]))
    elif rows_of == "thd":
        rows = thd_rows(layout, cp, rank)
    else:  # a *wrong* layout (plain contiguous split), to show the parity check notices
        rows = list(range(rank * layout[-1] // cp, (rank + 1) * layout[-1] // cp))
    index = torch.tensor(rows)
    leaves = [tensors[n][index].to(device, dtype).requires_grad_() for n in "qkv"]

    def offsets(values: list[int] | None) -> torch.Tensor | None:
        return None if values is None else torch.tensor(values, dtype=torch.int32, device=device)

    params = {
        "cu_seqlens_q": offsets(cu_seqlens),
        "cu_seqlens_kv": offsets(cu_seqlens),
        "cu_seqlens_q_padded": offsets(padded),
        "cu_seqlens_kv_padded": offsets(padded),
    }
    if through_module:
        dynamic = {
            "static": {},
            "dynamic": {"cp_group": dist.group.WORLD, "local_cp_size": cp},
            "off": {"cp_group": None, "local_cp_size": 1},
        }[through_module]
        built_cp = 1 if through_module == "dynamic" else cp
        packed = SimpleNamespace(qkv_format="thd", **params, **dynamic)
        out = _te_attention(leaves, built_cp, causal, scale)(
            *leaves, None, packed_seq_params=packed
        )
    else:
        out = packed_context_parallel_attention(
            *leaves, **params, cp_group=None, causal=causal, softmax_scale=scale,
            implementation=kernel,
        )  # fmt: skip
    out.backward(tensors["grad"][index].to(device, dtype))
    result = {"out": out.detach(), **{f"d{n}": t.grad for n, t in zip("qkv", leaves)}}
    from megatron_rocm.runtime.backend.packed.thd_attention import last_implementation

    tensors_out = {n: t.float().cpu() for n, t in result.items()}
    return {"rows": rows, "implementation": last_implementation(), **tensors_out}


def _te_attention(leaves: list[torch.Tensor], cp: int, causal: bool, scale: float | None) -> Any:
    """The backend's TEDotProductAttention as a TE spec builds it, with CP over the world."""
    from megatron_rocm.runtime.backend.dot_product_attention import TEDotProductAttention

    heads, dim = leaves[0].shape[1], leaves[0].shape[2]
    config = SimpleNamespace(
        kv_channels=dim, attention_dropout=0.0, window_size=None, softmax_type="vanilla",
        num_attention_heads=heads, tensor_model_parallel_size=1, context_parallel_size=cp,
    )  # fmt: skip
    return TEDotProductAttention(
        config,
        layer_number=1,
        attn_mask_type="padding_causal" if causal else "padding",
        attention_type="self",
        softmax_scale=scale,
        pg_collection=SimpleNamespace(cp=dist.group.WORLD, tp=None),
    )


def _serve(rank: int, size: int, port: int, backend: str, tasks: Any, results: Any) -> None:
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=size,
        timeout=timedelta(seconds=300),
    )
    while (task := tasks.get()) is not None:
        name, kwargs = task
        try:
            results.put((rank, True, _dumps(globals()[name](**_loads(kwargs)))))
        except Exception:  # noqa: BLE001 - reported to the test process
            results.put((rank, False, traceback.format_exc()))
    # Leave without destroy_process_group: on rank 0, which hosts the store, it waits for
    # the other ranks' connections to close and would stall the teardown.
    results.close()
    results.join_thread()
    os._exit(0)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class World:
    """``size`` ranks waiting for cases; ``run`` returns every rank's result, in rank order."""

    def __init__(self, size: int, backend: str = "gloo") -> None:
        ctx = mp.get_context("spawn")
        self.size = size
        self.alive = True
        self.tasks = [ctx.Queue() for _ in range(size)]
        self.results = ctx.Queue()
        port = _free_port()
        self.procs = [
            ctx.Process(
                target=_serve,
                args=(r, size, port, backend, self.tasks[r], self.results),
                daemon=True,
            )
            for r in range(size)
        ]
        for proc in self.procs:
            proc.start()

    def run(self, name: str, timeout: float = 300.0, **kwargs: Any) -> list[Any]:
        payload = _dumps(kwargs)
        for tasks in self.tasks:
            tasks.put((name, payload))
        values: dict[int, Any] = {}
        errors = []
        for _ in range(self.size):
            try:
                rank, ok, value = self.results.get(timeout=timeout)
            except queue.Empty:
                self.close()
                raise AssertionError(
                    f"{name}: no answer from the ranks within {timeout} s"
                ) from None
            if ok:
                values[rank] = _loads(value)
            else:
                errors.append(f"rank {rank}:\n{value}")
        if errors:  # the other ranks may be stuck in a collective: start afresh next time
            self.close()
            raise AssertionError("\n".join(errors))
        return [values[r] for r in range(self.size)]

    def close(self) -> None:
        self.alive = False
        for tasks in self.tasks:
            tasks.put(None)
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()


def probe_case(*, failing_ranks: list[int]) -> str | None:
    """A copy-engine link's probe where mapping the window fails on ``failing_ranks``: what
    this rank's probe says (the ranks must agree that the link cannot be used)."""
    from megatron_rocm.runtime.backend.cp.copy_engine import CopyEngineLink

    link = object.__new__(CopyEngineLink)  # no CUDA stream on the CPU: the probe's logic only
    link.group, link.device = dist.group.WORLD, torch.device("cpu")

    def reserve(nbytes: int) -> None:
        if dist.get_rank() in failing_ranks:
            raise RuntimeError("CUDA driver error: invalid device ordinal\nsecond line")

    link.reserve = reserve
    return link.probe()


def a2a_order_case(*, tensors: dict[str, torch.Tensor]) -> list[str]:
    """The order of a2a's copies and posted exchanges in one forward (``copy`` / ``post``)."""
    from megatron_rocm.runtime.backend.cp import a2a as _cp_a2a

    os.environ["MEGATRON_ROCM_CP_KERNEL"] = "math"
    events: list[str] = []
    post, copy_wide = _cp_a2a.post, _cp_a2a.copy_wide
    _cp_a2a.post = lambda *args: events.append("post") or post(*args)
    _cp_a2a.copy_wide = lambda *args: events.append("copy") or copy_wide(*args)
    try:
        cp, rank = dist.get_world_size(), dist.get_rank()
        q, k, v = (shard(tensors[n], cp, rank) for n in "qkv")
        out = context_parallel_attention(
            q, k, v, cp_group=None, causal=True, softmax_scale=None, comm_type="a2a"
        )
        out.sum()  # read: the peers' heads land (unpacked) before anything reads the output
    finally:
        _cp_a2a.post, _cp_a2a.copy_wide = post, copy_wide
    return events


def early_output_case(
    *, tensors: dict[str, torch.Tensor], transport: str | None = None
) -> dict[str, Any]:
    """a2a's output returned early (the default) and read by a reshape and a matmul, against
    the output finished inside the attention (``MEGATRON_ROCM_CP_A2A_HANDOFF=backward``); then
    an early output nobody reads, followed by the group's next exchange. Memory is handed out
    filled with NaN (torch's deterministic mode), so columns read before they land show."""
    from megatron_rocm.runtime.backend.cp import copy_engine as _cp_copy_engine
    from megatron_rocm.runtime.backend.cp import early_output as _cp_early_output
    from megatron_rocm.runtime.backend.cp import handoff as _cp_handoff

    os.environ["MEGATRON_ROCM_CP_KERNEL"] = "math"
    if transport is not None:
        os.environ[_cp_copy_engine.TRANSPORT_ENV] = transport
        _cp_copy_engine.decide_again()
    cp, rank = dist.get_world_size(), dist.get_rank()
    q, k, v = (shard(tensors[n], cp, rank).to(_device()) for n in "qkv")

    def attend(handoff: str) -> torch.Tensor:
        os.environ[_cp_handoff.HANDOFF_ENV] = handoff
        try:
            return context_parallel_attention(
                q, k, v, cp_group=None, causal=True, softmax_scale=None, comm_type="a2a"
            )
        finally:
            os.environ.pop(_cp_handoff.HANDOFF_ENV, None)

    deterministic = torch.are_deterministic_algorithms_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        result = _early_reads(attend)
    finally:
        torch.use_deterministic_algorithms(deterministic)
        torch.utils.deterministic.fill_uninitialized_memory = fill
        os.environ.pop(_cp_copy_engine.TRANSPORT_ENV, None)
    return {
        **result,
        "open_after": len(_cp_early_output._landings),
        "copy_engine": _cp_copy_engine.uses_copy_engines(None),
    }


def _early_reads(attend: Callable[[str], torch.Tensor]) -> dict[str, Any]:
    finished = attend("backward")
    early = attend("1")
    early_type = type(early).__name__
    flat = early.reshape(finished.shape[0], 1, -1)  # the first read: lands the peers' heads
    read = flat.matmul(torch.eye(flat.shape[-1], dtype=flat.dtype, device=flat.device))
    unread = attend("1")  # lands when the next exchange starts
    attend("backward")
    return {
        "early_type": early_type,
        "finished_type": type(finished).__name__,
        "read": read.view_as(finished).cpu(),
        "finished": finished.cpu(),
        "after_unread": unread.as_subclass(torch.Tensor).cpu(),  # reads no torch function
    }


def two_streams_case(
    *, first: dict[str, torch.Tensor], second: dict[str, torch.Tensor], late_unpack: bool
) -> list[float]:
    """a2a attention, forward and backward, on copy engines: ``first`` queued from one CUDA
    stream and ``second`` from another that nothing orders after it but the link itself
    (``late_unpack``: the first stream idles ~10 ms before each unpacking of its inbox).
    Returns, per output and gradient of both, how far it is from what the same input gives
    one after the other on one stream (relative to its largest value: cuDNN's backward may
    sum in another order, so not always bit for bit; a race gives garbage)."""
    from megatron_rocm.runtime.backend.cp import copy_engine as _cp_copy_engine

    os.environ["MEGATRON_ROCM_CP_KERNEL"] = "auto"
    os.environ[_cp_copy_engine.TRANSPORT_ENV] = "copy-engine"
    _cp_copy_engine.decide_again()
    cp, rank, device = dist.get_world_size(), dist.get_rank(), _device()
    seal = _cp_copy_engine.CopyEngineLink.seal

    def run(tensors: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        q, k, v = (shard(tensors[n], cp, rank).to(device, torch.bfloat16).requires_grad_()
                   for n in "qkv")  # fmt: skip
        out = context_parallel_attention(
            q, k, v, cp_group=None, causal=True, softmax_scale=None, comm_type="a2a"
        )
        out.backward(shard(tensors["grad"], cp, rank).to(device, torch.bfloat16))
        return [out.detach(), q.grad, k.grad, v.grad]

    try:
        alone = [run(first), run(second)]
        torch.cuda.synchronize(device)
        streams = [torch.cuda.Stream(device=device) for _ in range(2)]
        side_by_side = []
        for stream, tensors in zip(streams, (first, second), strict=True):
            if late_unpack and stream is streams[0]:
                _cp_copy_engine.CopyEngineLink.seal = _late_after(seal)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                side_by_side.append(run(tensors))
            _cp_copy_engine.CopyEngineLink.seal = seal
        torch.cuda.synchronize(device)
    finally:
        _cp_copy_engine.CopyEngineLink.seal = seal
        os.environ.pop(_cp_copy_engine.TRANSPORT_ENV, None)
    return [
        ((a.float() - b.float()).abs().max() / a.float().abs().max()).item()
        for one, other in zip(alone, side_by_side, strict=True)
        for a, b in zip(one, other, strict=True)
    ]


def _late_after(seal: Any) -> Any:
    """``CopyEngineLink.seal`` whose wait makes the current stream idle ~10 ms after the seal:
    the inbox is unpacked late, while the peers go on."""

    def late(link: Any) -> Any:
        arrival = seal(link)
        wait = arrival.wait

        def wait_then_idle() -> list:
            done = wait()
            torch.cuda._sleep(20_000_000)  # GPU cycles, queued on the current stream
            return done

        arrival.wait = wait_then_idle
        return arrival

    return late


def handoff_case(
    *,
    tensors: dict[str, torch.Tensor],
    weight: torch.Tensor,
    handoff: str,
    also_read: bool = False,
    prune_first: bool = False,
    transport: str | None = None,
    dtype: torch.dtype = torch.float32,
) -> dict[str, Any]:
    """a2a attention whose output feeds the projection as ``TERowParallelLinear`` does at one
    TP rank (``project_attention_output``), two steps in a row, ``handoff`` the value of
    ``MEGATRON_ROCM_CP_A2A_HANDOFF``; ``also_read``: the loss
    reads the attention's output a second time, so the gradient it gets is not the linear's;
    ``prune_first``: the first step asks autograd only for the weight's and the attention
    output's gradients, so the attention's backward never runs to take the exchange.

    Returns the last step's output and gradients (q, k, v, weight), per step whether the
    attention's backward took the exchange the linear started (``taken``), how many started
    exchanges were settled, how many batches were posted to the process group, and how many
    early outputs the projection computed on while they landed (``split``)."""
    from megatron_rocm.runtime.backend import _linear_function
    from megatron_rocm.runtime.backend.cp import a2a as _cp_a2a
    from megatron_rocm.runtime.backend.cp import copy_engine as _cp_copy_engine
    from megatron_rocm.runtime.backend.cp import handoff as _cp_handoff

    os.environ["MEGATRON_ROCM_CP_KERNEL"] = "auto"
    os.environ[_cp_handoff.HANDOFF_ENV] = handoff
    if transport is not None:
        os.environ[_cp_copy_engine.TRANSPORT_ENV] = transport
        _cp_copy_engine.decide_again()
    taken: list[bool] = []
    posted, post, take = [], _cp_a2a.post, _cp_handoff.Handoff.take
    settled, settle = [], _cp_a2a.PreparedScatter.settle
    split, matmul = [], _linear_function._matmul_while_landing

    def spying_take(self: Any, grad: torch.Tensor) -> Any:
        result = take(self, grad)
        taken.append(result is not None)
        return result

    _cp_a2a.post = lambda *args: posted.append(args) or post(*args)
    _cp_handoff.Handoff.take = spying_take
    _cp_a2a.PreparedScatter.settle = lambda self: settled.append(1) or settle(self)
    _linear_function._matmul_while_landing = lambda *args: split.append(1) or matmul(*args)
    cp, rank, device = dist.get_world_size(), dist.get_rank(), _device()
    try:
        for n in range(2):  # after a settled exchange, the next ones must stay paired too
            q, k, v = (shard(tensors[n], cp, rank).to(device, dtype).requires_grad_()
                       for n in "qkv")  # fmt: skip
            w = weight.to(device, dtype).requires_grad_()
            out = context_parallel_attention(
                q, k, v, cp_group=None, causal=True, softmax_scale=None, comm_type="a2a"
            )
            y = _linear_function.project_attention_output(out, w, False)
            if y is None:
                y = _linear_function.LinearFunction.apply(out, w, False)
            if also_read:
                y = y + out * 0.5
            grad = shard(tensors["grad"], cp, rank).to(device, dtype)
            if prune_first and n == 0:
                torch.autograd.grad(y, [w, out], grad)
            else:
                y.backward(grad)
    finally:
        _cp_a2a.post, _cp_handoff.Handoff.take = post, take
        _cp_a2a.PreparedScatter.settle = settle
        _linear_function._matmul_while_landing = matmul
        os.environ.pop(_cp_handoff.HANDOFF_ENV, None)
        os.environ.pop(_cp_copy_engine.TRANSPORT_ENV, None)
    grads = {"out": y.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad, "dw": w.grad}
    return {
        "taken": taken,
        "settled": len(settled),
        "posts": len(posted),
        "split": len(split),
        "copy_engine": _cp_copy_engine.uses_copy_engines(None),
        **{n: t.float().cpu() for n, t in grads.items()},
    }


def missing_peer_case(*, tensors: dict[str, torch.Tensor], absent: int, timeout_s: float) -> Any:
    """a2a on copy engines over a group whose collective timeout is ``timeout_s``: every rank
    exchanges once, then every rank but ``absent`` exchanges again, which ``absent`` never
    joins. Returns ``"absent"`` on that rank; on the others, how the second exchange ended
    (the error's type and first line, or ``None``) and how many seconds it took. The link's
    barrier traps its kernel, so this process's CUDA context is unusable afterwards."""
    from megatron_rocm.runtime.backend.cp import copy_engine as _cp_copy_engine

    os.environ["MEGATRON_ROCM_CP_KERNEL"] = "auto"
    os.environ[_cp_copy_engine.TRANSPORT_ENV] = "copy-engine"
    _cp_copy_engine.decide_again()
    group = dist.new_group(list(range(dist.get_world_size())),
                           timeout=timedelta(seconds=timeout_s))  # fmt: skip
    cp, rank, device = dist.get_world_size(), dist.get_rank(), _device()
    q, k, v = (shard(tensors[n], cp, rank).to(device, torch.bfloat16) for n in "qkv")

    def exchange() -> torch.Tensor:
        with torch.no_grad():
            out = context_parallel_attention(
                q, k, v, cp_group=group, causal=True, softmax_scale=None, comm_type="a2a"
            )
            return out + 0  # a read: the output lands

    try:
        exchange()
        torch.cuda.synchronize(device)
        assert _cp_copy_engine.uses_copy_engines(group)
        dist.barrier()  # both ranks' first exchange is over before one of them leaves
        if rank == absent:
            return "absent"
        start = time.monotonic()
        error = None
        try:
            exchange()
            torch.cuda.synchronize(device)
        except Exception as exc:  # noqa: BLE001 - what ended it is the result
            error = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"
        return {"error": error, "seconds": time.monotonic() - start}
    finally:
        os.environ.pop(_cp_copy_engine.TRANSPORT_ENV, None)


def graph_case(*, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """a2a run eagerly under ``auto`` (copy engines on one CUDA host), then captured, forward
    and backward, into a CUDA graph as Megatron's ``--cuda-graph-impl`` does, and replayed on
    the same inputs: the replay's output and gradients against the eager ones, and which
    transport the eager call took."""
    from megatron_rocm.runtime.backend.cp import copy_engine as _cp_copy_engine

    _cp_copy_engine.decide_again()
    cp, rank, device = dist.get_world_size(), dist.get_rank(), _device()
    leaves = [
        shard(tensors[n], cp, rank).to(device, torch.bfloat16).requires_grad_() for n in "qkv"
    ]
    grad = shard(tensors["grad"], cp, rank).to(device, torch.bfloat16)

    def step() -> torch.Tensor:
        out = context_parallel_attention(
            *leaves, cp_group=None, causal=True, softmax_scale=None, comm_type="a2a"
        )
        out.backward(grad)
        return out

    eager = [step().detach().clone()] + [leaf.grad.clone() for leaf in leaves]
    copy_engine = _cp_copy_engine.uses_copy_engines(None)
    side = torch.cuda.Stream(device=device)  # torch.cuda.graph wants warm-up on a side stream
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for leaf in leaves:
            leaf.grad = None
        step()
    torch.cuda.current_stream(device).wait_stream(side)
    for leaf in leaves:
        leaf.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    graph.replay()
    torch.cuda.synchronize(device)
    replayed = [captured] + [leaf.grad for leaf in leaves]
    return {
        "copy_engine": copy_engine,
        "eager": [t.float().cpu() for t in eager],
        "replayed": [t.float().cpu() for t in replayed],
    }


def projected_case(
    *,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    freqs: torch.Tensor | None,
    out_weight: torch.Tensor,
    grad: torch.Tensor,
    heads: int,
    groups: int,
    causal: bool = True,
    dtype: torch.dtype = torch.float32,
    fuse: bool = False,
    interleaved: bool = False,
    transport: str | None = None,
    handoff: str = "1",
    kernel: str = "auto",
    projected_weight: torch.Tensor | None = None,
) -> dict[str, Any]:
    """Upstream's ``SelfAttention`` from the normalised input to the output projection, on this
    rank's shard, two ways: as upstream computes it (one QKV GEMM, the split, RoPE, then
    ``context_parallel_attention``, all plain autograd) and through ``cp.a2a_qkv`` (the
    projection split by rank around a2a's exchanges); both followed by the output projection
    as ``TERowParallelLinear`` computes it at one TP rank, so that its handoffs run too.
    ``fuse``: the QKV weight's gradient goes into ``main_grad`` (Megatron's fusion);
    ``projected_weight``: another QKV weight for the second way (a negative control).

    Returns, for each way (``upstream``, ``projected``), the output and the gradients of the
    input, both weights and the bias, and how many batches each posted to the process group."""
    from megatron_rocm.runtime.backend import _linear_function
    from megatron_rocm.runtime.backend.cp import a2a as _cp_a2a
    from megatron_rocm.runtime.backend.cp import a2a_qkv as _cp_a2a_qkv
    from megatron_rocm.runtime.backend.cp import copy_engine as _cp_copy_engine
    from megatron_rocm.runtime.backend.cp import handoff as _cp_handoff
    from megatron_rocm.runtime.backend.cp.block_attention import pick_kernel
    from megatron_rocm.runtime.kernels.rope import rope_reference

    os.environ["MEGATRON_ROCM_CP_KERNEL"] = kernel
    os.environ[_cp_handoff.HANDOFF_ENV] = handoff
    if transport is not None:
        os.environ[_cp_copy_engine.TRANSPORT_ENV] = transport
        _cp_copy_engine.decide_again()
    cp, rank, device = dist.get_world_size(), dist.get_rank(), _device()
    head_dim = weight.shape[0] // (heads + 2 * groups)
    local_freqs = None if freqs is None else shard(freqs, cp, rank).to(device)
    posted, post = [], _cp_a2a.post
    _cp_a2a.post = lambda *args: posted.append(args) or post(*args)

    def leaves(qkv_weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
        tensors = [shard(x, cp, rank), qkv_weight, bias, out_weight]
        # copies: each way's leaves must gather their own gradients
        return tuple(None if t is None else t.to(device, dtype).clone().requires_grad_()
                     for t in tensors)  # fmt: skip

    def upstream(xl, w, b) -> torch.Tensor:  # noqa: ANN001
        mixed = xl.matmul(w.t())  # upstream's linear: the GEMM, then the bias
        if b is not None:
            mixed = mixed + b
        s, batch = mixed.shape[:2]
        mixed = mixed.view(s, batch, groups, (heads // groups + 2) * head_dim)
        q, k, v = torch.split(mixed, [heads // groups * head_dim, head_dim, head_dim], dim=3)
        q = q.reshape(s, batch, -1, head_dim)
        if local_freqs is not None:
            q = rope_reference(q, local_freqs, interleaved)
            k = rope_reference(k, local_freqs, interleaved)
        return context_parallel_attention(
            q, k, v, cp_group=None, causal=causal, softmax_scale=None, comm_type="a2a"
        )

    def projected(xl, w, b) -> torch.Tensor:  # noqa: ANN001
        shape = (xl.shape[0], xl.shape[1], heads, head_dim)
        stand_in = xl.new_empty(()).expand(shape)
        return _cp_a2a_qkv.projected_a2a_attention(
            xl, w, b, heads=heads, groups=groups, head_dim=head_dim, freqs=local_freqs,
            interleaved=interleaved, fuse_wgrad=fuse, group=None, causal=causal,
            scale=head_dim**-0.5, dropout_p=0.0,
            kernel=pick_kernel(stand_in, stand_in, stand_in, 0.0),
        )  # fmt: skip

    results: dict[str, Any] = {}
    try:
        for name, attention in (("upstream", upstream), ("projected", projected)):
            wrong = projected_weight is not None and name == "projected"
            xl, w, b, wo = leaves(projected_weight if wrong else weight)
            if fuse and name == "projected":
                w.main_grad = torch.zeros(w.shape, dtype=torch.float32, device=device)
                w.grad_added_to_main_grad = False
            before = len(posted)
            out = attention(xl, w, b)
            y = _linear_function.project_attention_output(out, wo, False)
            assert (y is None) == (handoff == "0"), "a handoff missing, or one too many"
            if y is None:
                y = _linear_function.LinearFunction.apply(out, wo, False)
            y.backward(shard(grad, cp, rank).to(device, dtype))
            dw = w.main_grad if fuse and name == "projected" else w.grad
            result = {"y": y, "dx": xl.grad, "dw": dw, "dwo": wo.grad}
            if b is not None:
                result["db"] = b.grad
            results[name] = {n: t.detach().float().cpu() for n, t in result.items()}
            results[name]["posts"] = len(posted) - before
    finally:
        _cp_a2a.post = post
        os.environ.pop(_cp_handoff.HANDOFF_ENV, None)
        os.environ.pop(_cp_copy_engine.TRANSPORT_ENV, None)
    results["copy_engine"] = _cp_copy_engine.uses_copy_engines(None)
    return results


def retained_case(*, tensors: dict[str, torch.Tensor]) -> dict[str, int]:
    """a2a forward with the default handoffs, both ways (upstream's q/k/v and the projection
    around the exchanges), each output read (landed) as the projection would; then, before any
    backward, how many of a2a's ``Gather``\\ s are still alive: a landed forward's receive buffers
    must not wait in the autograd graph for the backward."""
    import gc

    from megatron_rocm.runtime.backend.cp import a2a as _cp_a2a
    from megatron_rocm.runtime.backend.cp import a2a_qkv as _cp_a2a_qkv
    from megatron_rocm.runtime.backend.cp.block_attention import pick_kernel

    os.environ["MEGATRON_ROCM_CP_KERNEL"] = "auto"
    cp, rank = dist.get_world_size(), dist.get_rank()
    q, k, v = (shard(tensors[n], cp, rank).requires_grad_() for n in "qkv")
    s, b, heads, dim = q.shape
    groups = k.shape[2]
    kernel = pick_kernel(q, k, v, 0.0)
    plain = context_parallel_attention(
        q, k, v, cp_group=None, causal=True, softmax_scale=None, comm_type="a2a"
    )
    x = torch.randn(s, b, 16, requires_grad=True)
    weight = torch.randn((heads + 2 * groups) * dim, 16, requires_grad=True)
    projected = _cp_a2a_qkv.projected_a2a_attention(
        x, weight, None, heads=heads, groups=groups, head_dim=dim, freqs=None,
        interleaved=False, fuse_wgrad=False, group=None, causal=True, scale=dim**-0.5,
        dropout_p=0.0, kernel=kernel,
    )  # fmt: skip
    losses = [(out * 1.0).sum() for out in (plain, projected)]  # reads: both land
    gc.collect()
    alive = sum(isinstance(o, _cp_a2a.Gather) for o in gc.get_objects())
    sum(losses).backward()
    return {"alive": alive}
