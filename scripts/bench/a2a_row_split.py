"""Could an a2a rank start its attention on the query rows it already holds? One GPU, no CP.

    python -m scripts.bench.a2a_row_split [--length 16384] [--heads 32/4] [--kernels cudnn,flash]
        [--rep-ms 100] [--json FILE]
    python -m scripts.bench.a2a_row_split --cpu   # tiny fp32 run on the CPU: checks the script

After Ulysses' first exchange (``cp.a2a``) a rank holds the whole sequence for its share of the
heads (``--heads``: query/kv heads per rank, 32/4 is Llama-2-70B's 64/8 at cp 2). Its own two
zigzag chunks of those heads never travel; of what does, the other rank's query chunks are
~80% of the bytes with 8:1 grouped kv heads, its key/value chunks the rest. Attention rows are
independent, so once the small key/value part has landed (the rank's last chunk attends to the
other rank's keys), the rows of its own chunks could run while the other rank's queries
arrive, hiding most of the exchange. This times what splitting the rows that way costs,
forward and backward, against one causal call over the whole sequence (``whole``). The
sequence is in four zigzag chunks (cp 2); the split has three row groups, the fewest that keep
one rank's rows apart from the other's: chunk 0, chunks 1-2, chunk 3 (``ROW_GROUPS``).

* ``merge``: each group's rows as a full block over the keys before it plus the causal diagonal
  block, merged by log-sum-exp (``SoftmaxMerger``) and differentiated with the merged output
  and lse, as the ring does: any block kernel can run it;
* ``bottom_right``: one causal call per group over its key prefix, which needs a kernel that
  aligns a short query block's causal mask to the bottom right. Checked at run time
  (``causal_alignment``): on H100, cuDNN's op (through torch's causal flag; an explicit mask
  is not tried) aligns it to the top left and flash to the bottom right.

Gradients of the split cases are summed in fp32. One JSON line per (kernel, case): forward and
backward ms (medians of ``triton.testing.do_bench``), ``overhead_ms`` against ``whole``, and
the largest difference from ``whole`` in the output and in each gradient. Splitting pays only
if ``overhead_ms`` is well below the exchange it would hide (about 0.2 ms per layer on NVLink
copy engines).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from megatron_rocm.runtime.backend.cp.block_attention import (
    KERNELS,
    BlockKernel,
    SoftmaxMerger,
)
from scripts.bench import timing as bench_timing

CHUNKS = 4  # Megatron's zigzag at cp 2: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
ROW_GROUPS = ((0, 1), (1, 3), (3, 4))  # [start, end) in chunks: one rank's rows, the other's
Grads = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
# (query rows, key range, causal, the rows' final output, their final lse, the kernel's state)
Block = tuple[slice, slice, bool, torch.Tensor, torch.Tensor, object]


def causal_alignment(kernel: BlockKernel, device: str, dtype: torch.dtype) -> str:
    """Where ``kernel`` puts the causal diagonal when there are fewer query rows than keys:
    ``top_left`` (row i sees keys <= i), ``bottom_right`` (the last row sees every key), or
    ``neither``."""
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, 64, generator=gen, device=device).to(dtype)
               for n in (64, 256, 256))  # fmt: skip
    out, _, _ = kernel.forward(q, k, v, causal=True, scale=0.125, dropout_p=0.0)
    scores = (q.float() @ k.float().transpose(-1, -2)) * 0.125
    rows, keys = torch.arange(64, device=device)[:, None], torch.arange(256, device=device)
    tolerance = 0.05 if dtype != torch.float32 else 1e-4
    for name, visible in (("top_left", keys <= rows), ("bottom_right", keys <= rows + 192)):
        ref = torch.softmax(scores.masked_fill(~visible, float("-inf")), -1) @ v.float()
        if (out.float() - ref).abs().max().item() < tolerance:
            return name
    return "neither"


class Attention:
    """One rank's attention after the exchange: ``[1, heads, length, d]`` views of ``[s, b, h, d]``
    buffers (the a2a layout), a gradient for its output, and the three ways to compute it."""

    def __init__(self, kernel: BlockKernel, length: int, heads: int, kv_heads: int,
                 device: str, dtype: torch.dtype) -> None:  # fmt: skip
        gen = torch.Generator(device=device).manual_seed(0)

        def bhsd(h: int) -> torch.Tensor:
            return torch.randn(length, 1, h, 128 if device != "cpu" else 32, generator=gen,
                               device=device).to(dtype).permute(1, 2, 0, 3)  # fmt: skip

        self.kernel, self.q, self.k, self.v = kernel, bhsd(heads), bhsd(kv_heads), bhsd(kv_heads)
        self.dout = bhsd(heads)
        self.scale = self.q.shape[-1] ** -0.5
        self.piece = length // CHUNKS

    def _call(self, q: torch.Tensor, keys: slice, causal: bool) -> tuple:
        return self.kernel.forward(q, self.k[:, :, keys], self.v[:, :, keys], causal=causal,
                                   scale=self.scale, dropout_p=0.0)  # fmt: skip

    def _grads(self, dout: torch.Tensor, q: torch.Tensor, keys: slice, out: torch.Tensor,
               lse: torch.Tensor, state: object, causal: bool) -> Grads:  # fmt: skip
        return self.kernel.backward(dout, q, self.k[:, :, keys], self.v[:, :, keys], out, lse,
                                    state, causal=causal, scale=self.scale, dropout_p=0.0)  # fmt: skip

    def whole(self) -> tuple[Callable[[], object], Callable[[], Grads], torch.Tensor]:
        """One causal call over the whole sequence."""
        everything = slice(None)
        saved = self._call(self.q, everything, True)

        def backward() -> Grads:
            return self._grads(self.dout, self.q, everything, *saved, True)

        return lambda: self._call(self.q, everything, True), backward, saved[0]

    def _rows(self, group: tuple[int, int]) -> slice:
        return slice(group[0] * self.piece, group[1] * self.piece)

    def merge(self) -> tuple[Callable[[], object], Callable[[], Grads], torch.Tensor]:
        """Per row group: a full block over the keys before it and the diagonal, merged by lse."""
        return self._split(self._merged_rows)

    def bottom_right(self) -> tuple[Callable[[], object], Callable[[], Grads], torch.Tensor]:
        """Per row group: one causal call over its key prefix (a bottom-right aligned kernel)."""
        return self._split(self._prefix_rows)

    def _split(
        self, rows_of: Callable[[slice, torch.Tensor, list[Block]], None]
    ) -> tuple[Callable[[], object], Callable[[], Grads], torch.Tensor]:
        """A forward that runs ``rows_of`` for every row group (it writes their output and lists
        its blocks), the backward of those blocks, and the output."""
        out = torch.empty_like(self.q)
        blocks: list[Block] = []

        def forward() -> None:
            blocks.clear()
            for group in ROW_GROUPS:
                rows_of(self._rows(group), out, blocks)

        forward()
        return forward, lambda: self._split_backward(blocks), out

    def _merged_rows(self, rows: slice, out: torch.Tensor, blocks: list[Block]) -> None:
        q, parts = self.q[:, :, rows], [(rows, True)]
        if rows.start:
            parts.insert(0, (slice(0, rows.start), False))
        results = [self._call(q, keys, causal) for keys, causal in parts]
        merger = SoftmaxMerger(q, q.shape[-1])
        for i, (o, lse, _) in enumerate(results):
            merger.add(slice(None), o, lse, first=i == 0)
        out[:, :, rows] = merger.out
        for (keys, causal), (_, _, state) in zip(parts, results, strict=True):
            blocks.append((rows, keys, causal, out[:, :, rows], merger.lse, state))

    def _prefix_rows(self, rows: slice, out: torch.Tensor, blocks: list[Block]) -> None:
        keys = slice(0, rows.stop)
        o, lse, state = self._call(self.q[:, :, rows], keys, True)
        out[:, :, rows] = o
        blocks.append((rows, keys, True, o, lse, state))

    def _split_backward(self, blocks: list[Block]) -> Grads:
        """Every block's gradients, given its rows' final output and lse, summed in fp32."""
        dq, dk, dv = (torch.zeros_like(t, dtype=torch.float32) for t in (self.q, self.k, self.v))
        for rows, keys, causal, out, lse, state in blocks:
            q = self.q[:, :, rows]
            g = self._grads(self.dout[:, :, rows], q, keys, out, lse, state, causal)
            dq[:, :, rows] += g[0]
            dk[:, :, keys] += g[1]
            dv[:, :, keys] += g[2]
        return dq, dk, dv


def run_kernel(name: str, a: argparse.Namespace, device: str, dtype: torch.dtype) -> list[dict]:
    """The records of one block kernel: ``whole`` first, then each split it can run, each
    compared with ``whole`` (or one record saying why the kernel cannot run here)."""
    kernel = KERNELS[name]
    heads, kv_heads = (int(n) for n in a.heads.split("/"))
    attention = Attention(kernel, a.length, heads, kv_heads, device, dtype)
    why = kernel.unsupported(attention.q, attention.k, attention.v, 0.0)
    label = "cpu" if device == "cpu" else torch.cuda.get_device_name(0)
    if why:
        return [{"kernel": name, "device": label, "unsupported": why}]
    alignment = causal_alignment(kernel, device, dtype)
    cases = ["whole", "merge"] + (["bottom_right"] if alignment == "bottom_right" else [])
    records, reference = [], None
    for case in cases:
        forward, backward, out = getattr(attention, case)()
        grads = backward()
        timing = {"rep": a.rep_ms} if device != "cpu" else {}
        record = {
            "kernel": name, "case": case, "device": label, "length": a.length, "heads": a.heads,
            "causal_alignment": alignment,
            "fwd_ms": round(bench_timing.median_ms(forward, device, **timing), 4),
            "bwd_ms": round(bench_timing.median_ms(backward, device, **timing), 4),
        }  # fmt: skip
        if reference is None:
            reference = (out.float().clone(), [g.float() for g in grads], record)
        else:
            base = reference[2]
            record["overhead_ms"] = round(
                record["fwd_ms"] + record["bwd_ms"] - base["fwd_ms"] - base["bwd_ms"], 4
            )
            record["max_abs_err"] = {
                what: (mine.float() - theirs).abs().max().item()
                for what, mine, theirs in zip(
                    ("out", "dq", "dk", "dv"),
                    (out, *grads),
                    (reference[0], *reference[1]),
                    strict=True,
                )
            }
        records.append(record)
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=16384, help="whole sequence, tokens")
    parser.add_argument("--heads", default="32/4", help="query/kv heads on the rank")
    parser.add_argument(
        "--kernels", help="block kernels to time (default cudnn,flash; math with --cpu)"
    )
    parser.add_argument(
        "--rep-ms", type=int, default=100, help="milliseconds do_bench spends on each timing"
    )
    parser.add_argument("--json", type=Path, help="write the records here (JSON lines)")
    parser.add_argument(
        "--cpu",
        action="store_true",
        help="tiny fp32 run on the CPU (length 256, heads 4/2, the math kernel unless --kernels)",
    )
    a = parser.parse_args(argv)
    if a.cpu:
        device, dtype, a.length, a.heads = "cpu", torch.float32, 256, "4/2"
        a.kernels = a.kernels or "math"
    elif torch.cuda.is_available():
        device, dtype = "cuda", torch.bfloat16
        a.kernels = a.kernels or "cudnn,flash"
    else:
        print("bench_a2a_row_split: needs a GPU (or --cpu)", file=sys.stderr)
        return 3
    if a.length % (CHUNKS * 8):
        parser.error(f"--length must be a multiple of {CHUNKS * 8}")
    unknown = [k for k in a.kernels.split(",") if k not in KERNELS]
    if unknown:
        parser.error(f"unknown kernel(s) {', '.join(unknown)}; one of {', '.join(KERNELS)}")
    records = [r for name in a.kernels.split(",") for r in run_kernel(name, a, device, dtype)]
    for record in records:
        print(json.dumps(record), flush=True)
    if a.json:
        a.json.write_text("".join(json.dumps(r) + "\n" for r in records))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
