"""Shared-memory transport for ranks on one host.

Each collective runs in steps of at most ``chunk_bytes`` per rank. A step writes into buffer set
``step % 2``; because every rank passes the next step's barrier only after all ranks finished the
previous step, a buffer set is never overwritten while a peer still reads it (one barrier per step
for broadcast/gather ops, two for all_reduce).

all_reduce of n elements on w ranks: each rank stages the (w-1)/w of its tensor that peers reduce,
reduces its own 1/w share (reading peers' slots and its own tensor in place), publishes the result,
then copies the other shares back. Every share is reduced by exactly one rank in rank order, so
all ranks get bit-identical results. Float16/bfloat16 are accumulated in float32, and their AVG
(all_reduce, reduce_scatter) is divided there before the one rounding, so they are never widened
on their way through shared memory (the bits of widening them, in half the bytes).
"""

from __future__ import annotations

import numpy as np
import torch

from .. import numerics
from ..call import Call
from ..ops import COMBINE, LOW_PRECISION, RedOp, dtype_of_code, moved_as_bytes, signature_code
from ..signatures import OPS, REDUCE_ROOT_FACTOR
from .base import Capabilities, Transport, block_offsets
from .shm_segment import ShmSegment

_NO_CALL_SHOWN = (0, 0, 0, 0)  # a header's user-call fields when the op is no step of another call
ONE_SHOT_BYTES = 16 << 10  # all_reduce below this size uses one barrier (see all_reduce)
# what small_all_reduce reduces in numpy: dtypes whose arithmetic numpy does as torch does (IEEE
# floats, wrapping integers), and the ops it applies to them; 16-bit floats (float32
# accumulation) and bool (bytes) keep the general path
SMALL_DTYPES = {torch.float32: np.float32, torch.float64: np.float64, torch.int64: np.int64,
                torch.int32: np.int32, torch.int8: np.int8, torch.uint8: np.uint8}
_FROM_NUMPY = {np.dtype(n): t for t, n in SMALL_DTYPES.items()}
SMALL_COMBINE = {RedOp.SUM: np.add, RedOp.PRODUCT: np.multiply, RedOp.MIN: np.minimum, RedOp.MAX: np.maximum}

_SMALL_VIEWS_KEPT = 64  # (parity, size, dtype) keys of small_all_reduce's views before they are made anew


def _combine_into(out: np.ndarray, sources: list[np.ndarray], fn) -> None:
    """``out`` = ``fn`` of ``sources`` in rank order, as ShmTransport._combine applies torch's."""
    fn(sources[0], sources[1], out=out)
    for source in sources[2:]:
        fn(out, source, out=out)


def _signature(header: tuple[int, ...]) -> list[int]:
    """The call a header describes (signatures.py's form), in the user's elements: the user's call
    where the op is a step of it (the hierarchical transport's), else the op itself, whose header
    counts the bytes moved for dtypes that travel as bytes (bool, float8, int16, ...)."""
    if header[6]:
        return list(header[6:])
    _, _, op, code, numel, arg = header[:6]
    dtype = dtype_of_code(code) if code else None
    if dtype is not None and moved_as_bytes(dtype):
        numel //= dtype.itemsize
    return [op, code, numel, arg]


class ShmTransport(Transport):
    name = "shm"
    capabilities = Capabilities(accumulates_low_precision=True, reduce_scatters_16_bit=frozenset(LOW_PRECISION),
                                all_reduces_16_bit_avg=frozenset(LOW_PRECISION), runs_inline=True,
                                checks_signatures=True, takes_block_views=True)

    def __init__(self, store, rank: int, world_size: int, chunk_bytes: int, timeout, **shown) -> None:
        super().__init__(rank, world_size, **shown)
        # the segment writes most of this transport's errors: it names ranks as this one does
        self.seg = ShmSegment(store, rank, world_size, chunk_bytes, timeout, shown_as=self.shown_as,
                              peers_shown=self.peers_shown, refused=self._refusal,
                              announce=self.refusals.announce_failure if self.refusals is not None else None)
        self.seq = 0
        self.step = 0
        # float32 accumulator for 16-bit reductions: one chunk's worth of elements.
        self._acc = torch.empty(chunk_bytes // 2, dtype=torch.float32)
        self._scratch = torch.empty(chunk_bytes, dtype=torch.uint8)
        self._small_views: dict[tuple, list[np.ndarray]] = {}  # small_all_reduce's (_small_slots)

    # protocol helpers --------------------------------------------------------------------------
    def _begin(self, call: Call, op: str, dtype: torch.dtype | None, numel: int, arg: int) -> tuple[int, ...]:
        if self.seg.broken:
            self.seg._fail("an earlier collective failed on this rank")
        self.seq += 1
        self.seg.entering(call.index, self.shown_op(call, op))
        code = signature_code(call.carrying or dtype) if dtype else 0
        # as a hierarchical transport's host part, the user's call is published beside the
        # step's own: ranks of one host that called different collectives are told what they
        # called (an all_reduce and a barrier), not the reduce_scatter step the all_reduce starts with
        shown_call = call.signature if self.shown_as is not None and call.signature else _NO_CALL_SHOWN
        header = (self.seq, call.index, OPS[op], code, numel, arg, *shown_call)
        self.seg.publish_header(header)
        return header

    def _sync(self, header: tuple[int, ...] | None) -> None:
        """Barrier; on an op's first step also check that every rank called the same op."""
        self.seg.barrier()
        if header is not None:
            # as the host part of a hierarchical transport, a mismatch found here goes on the
            # group's board too: ranks on other hosts, waiting between hosts for these, hear it
            announce = self.refusals.announce_mismatch if self.refusals is not None else None
            self.seg.check_headers(header, _signature, announce)

    def _steps(self, numel: int, elem_bytes: int):
        """(start, stop) ranges of at most one chunk; at least one range, so empty ops still sync."""
        per_step = max(1, self.seg.chunk_bytes // elem_bytes)
        for start in range(0, max(numel, 1), per_step):
            self.step += 1
            yield start, min(start + per_step, numel)

    def _combine(self, sources: list[torch.Tensor], dest: list[torch.Tensor], op: RedOp) -> None:
        """Reduce ``sources`` in rank order into every tensor of ``dest``.

        A ``dest`` may be the very memory of one source (in-place calls). The accumulator is
        therefore a ``dest`` that no later source (index >= 2) aliases, else scratch memory.
        AVG comes only for 16-bit floats (all_reduces_16_bit_avg, reduce_scatters_16_bit).
        """
        numel, dtype, shape = sources[0].numel(), sources[0].dtype, sources[0].shape
        if dtype in LOW_PRECISION and op in (RedOp.SUM, RedOp.AVG, RedOp.PRODUCT):
            # float32 accumulation, an AVG divided, one rounding into each of dest
            numerics.reduce_blocks_(self._acc[:numel].view(shape), sources, op, self.world_size, into=dest)
            return
        fn = COMBINE[op]
        later = {s.data_ptr() for s in sources[2:]}
        acc = next((d for d in dest if d.data_ptr() not in later), None)
        if acc is None:
            acc = self._scratch.view(dtype)[:numel].view(shape)
        fn(sources[0], sources[1], out=acc)
        for src in sources[2:]:
            fn(acc, src, out=acc)
        for d in dest:
            if d.data_ptr() != acc.data_ptr():
                d.copy_(acc)

    # the caller's-thread path of small calls (backend/fast_cpu.py) -------------------------------
    @property
    def small_bytes(self) -> int:
        """The largest all_reduce ``small_all_reduce`` takes: one slot of one step."""
        return min(ONE_SHOT_BYTES, self.seg.chunk_bytes)

    def _small_slots(self, parity: int, nbytes: int, dtype: np.dtype) -> list[np.ndarray]:
        """Every rank's first ``nbytes`` of its slot of buffer set ``parity``, as numpy ``dtype``:
        made once per size and dtype (a few per job), not per call."""
        key = (parity, nbytes, dtype)
        views = self._small_views.get(key)
        if views is None:
            if len(self._small_views) >= _SMALL_VIEWS_KEPT:
                self._small_views.clear()
            views = self._small_views[key] = [
                self.seg.slot(parity, p, torch.uint8)[:nbytes].numpy().view(dtype) for p in range(self.world_size)]
        return views

    def small_all_reduce(self, call: Call, mine: np.ndarray, op: RedOp) -> None:
        """The all_reduce of a tensor that fits a slot, of one of SMALL_DTYPES, with an op of
        SMALL_COMBINE: ``mine``, a flat numpy view of its memory, reduced in place in rank order.
        Every rank stages all of its tensor and reduces every slot itself: one barrier instead of
        two, and the redundant arithmetic is cheaper than the second barrier. ``all_reduce`` runs
        such calls here too, so the small path and the general route are one protocol."""
        header = self._begin(call, "all_reduce", _FROM_NUMPY[mine.dtype], mine.size, int(op))
        self.step += 1
        slots = self._small_slots(self.step % 2, mine.nbytes, mine.dtype)
        slots[self.rank][:] = mine
        self._sync(header)
        fn = SMALL_COMBINE[op]
        if mine.dtype.kind != "f":  # integers wrap without a warning, as torch's do
            _combine_into(mine, slots, fn)
            return
        with np.errstate(all="ignore"):  # overflow to inf, inf - inf: torch's ops warn of neither
            _combine_into(mine, slots, fn)

    def small_broadcast(self, call: Call, mine: np.ndarray, dtype: torch.dtype, numel: int, root: int) -> None:
        """broadcast as ``broadcast`` runs one of at most ``small_bytes`` (its header and step), of
        ``mine``, the tensor's bytes; ``dtype`` and ``numel`` as the general route's header gives
        them (a dtype moved as bytes counts bytes)."""
        header = self._begin(call, "broadcast", dtype, numel, root)
        self.step += 1
        slot = self._small_slots(self.step % 2, mine.nbytes, mine.dtype)[root]
        if self.rank == root:
            slot[:] = mine
        self._sync(header)
        if self.rank != root:
            mine[:] = slot

    def small_all_gather(self, call: Call, output: np.ndarray, mine: np.ndarray, dtype: torch.dtype, numel: int) -> None:
        """all_gather as ``all_gather`` runs one whose input fits a slot: ``mine`` (the input's
        bytes) into block ``rank`` of ``output`` (bytes, every rank's block in rank order)."""
        header = self._begin(call, "all_gather", dtype, numel, 0)
        self.step += 1
        slots = self._small_slots(self.step % 2, mine.nbytes, mine.dtype)
        slots[self.rank][:] = mine
        self._sync(header)
        blocks = output.reshape(self.world_size, mine.size)
        for q in range(self.world_size):
            blocks[q] = mine if q == self.rank else slots[q]

    # collectives -------------------------------------------------------------------------------
    def all_reduce(self, call: Call, tensor: torch.Tensor, op: RedOp) -> None:
        w, r = self.world_size, self.rank
        small = tensor.numel() * tensor.element_size() <= self.small_bytes
        if small and tensor.dtype in SMALL_DTYPES and op in SMALL_COMBINE and tensor.is_contiguous():
            return self.small_all_reduce(call, tensor.detach().numpy().reshape(-1), op)
        header = self._begin(call, "all_reduce", tensor.dtype, tensor.numel(), int(op))
        if small:
            # as small_all_reduce, for the dtypes numpy does not reduce as torch does (16-bit
            # floats, summed in float32) and the bitwise ops
            self.step += 1
            n = tensor.numel()
            self.seg.slot(self.step, r, tensor.dtype)[:n].copy_(tensor)
            self._sync(header)
            self._combine([self.seg.slot(self.step, p, tensor.dtype)[:n] for p in range(w)], [tensor], op)
            return
        for start, stop in self._steps(tensor.numel(), tensor.element_size()):
            x, m = tensor[start:stop], stop - start
            bounds = [(q * m // w, (q + 1) * m // w) for q in range(w)]
            lo, hi = bounds[r]
            mine = self.seg.slot(self.step, r, tensor.dtype)
            mine[:lo].copy_(x[:lo])
            mine[hi:m].copy_(x[hi:])
            self._sync(header if start == 0 else None)
            sources = [x[lo:hi] if p == r else self.seg.slot(self.step, p, tensor.dtype)[lo:hi] for p in range(w)]
            self._combine(sources, [x[lo:hi], mine[lo:hi]], op)
            self.seg.barrier()
            for q, (qlo, qhi) in enumerate(bounds):
                if q != r:
                    x[qlo:qhi].copy_(self.seg.slot(self.step, q, tensor.dtype)[qlo:qhi])

    def broadcast(self, call: Call, tensor: torch.Tensor, root: int) -> None:
        header = self._begin(call, "broadcast", tensor.dtype, tensor.numel(), root)
        for start, stop in self._steps(tensor.numel(), tensor.element_size()):
            x = tensor[start:stop]
            if self.rank == root:
                self.seg.slot(self.step, root, tensor.dtype)[: stop - start].copy_(x)
            self._sync(header if start == 0 else None)
            if self.rank != root:
                x.copy_(self.seg.slot(self.step, root, tensor.dtype)[: stop - start])

    def reduce(self, call: Call, tensor: torch.Tensor, root: int, op: RedOp) -> None:
        header = self._begin(call, "reduce", tensor.dtype, tensor.numel(), root * REDUCE_ROOT_FACTOR + int(op))
        for start, stop in self._steps(tensor.numel(), tensor.element_size()):
            x, m = tensor[start:stop], stop - start
            if self.rank != root:
                self.seg.slot(self.step, self.rank, tensor.dtype)[:m].copy_(x)
            self._sync(header if start == 0 else None)
            if self.rank == root:
                sources = [x if p == root else self.seg.slot(self.step, p, tensor.dtype)[:m]
                           for p in range(self.world_size)]
                self._combine(sources, [x], op)

    def all_gather(self, call: Call, output: torch.Tensor, input: torch.Tensor, op: str = "all_gather") -> None:
        """``output`` flat, or a (world_size, rows, columns) view with ``input`` (rows, columns)
        (``takes_block_views``); a step stages the same columns of every row."""
        part = input.view(1, -1) if input.dim() == 1 else input
        blocks = output if output.dim() == 3 else output.view(self.world_size, *part.shape)
        rows, n = part.shape
        header = self._begin(call, op, input.dtype, input.numel(), 0)
        for start, stop in self._steps(n, input.element_size() * rows):
            k = stop - start
            self.seg.slot(self.step, self.rank, input.dtype)[: rows * k].view(rows, k).copy_(part[:, start:stop])
            self._sync(header if start == 0 else None)
            for q in range(self.world_size):
                src = part[:, start:stop] if q == self.rank else \
                    self.seg.slot(self.step, q, input.dtype)[: rows * k].view(rows, k)
                blocks[q, :, start:stop].copy_(src)

    def reduce_scatter(self, call: Call, output: torch.Tensor, input: torch.Tensor, op: RedOp) -> None:
        """``input`` flat, or a (world_size, rows, columns) view with ``output`` (rows, columns)
        (``takes_block_views``)."""
        w, r = self.world_size, self.rank
        mine_out = output.view(1, -1) if output.dim() == 1 else output
        blocks = input if input.dim() == 3 else input.view(w, *mine_out.shape)
        rows, n = mine_out.shape
        header = self._begin(call, "reduce_scatter", input.dtype, output.numel(), int(op))
        # a step stages k columns of every peer's block: w * rows * k elements per slot
        for start, stop in self._steps(n, input.element_size() * w * rows):
            piece = rows * (stop - start)
            mine = self.seg.slot(self.step, r, input.dtype)
            for q in range(w):
                if q != r:
                    mine[q * piece : (q + 1) * piece].view(rows, -1).copy_(blocks[q, :, start:stop])
            self._sync(header if start == 0 else None)
            sources = [blocks[r, :, start:stop] if p == r
                       else self.seg.slot(self.step, p, input.dtype)[r * piece : (r + 1) * piece].view(rows, -1)
                       for p in range(w)]
            self._combine(sources, [mine_out[:, start:stop]], op)

    def all_to_all(self, call: Call, output: torch.Tensor, input: torch.Tensor) -> None:
        w, r, n = self.world_size, self.rank, input.numel() // self.world_size
        header = self._begin(call, "all_to_all", input.dtype, input.numel(), 0)
        for start, stop in self._steps(n, input.element_size() * w):
            k = stop - start
            mine = self.seg.slot(self.step, r, input.dtype)
            for q in range(w):
                mine[q * k : (q + 1) * k].copy_(input[q * n + start : q * n + stop])
            self._sync(header if start == 0 else None)
            for q in range(w):
                output[q * n + start : q * n + stop].copy_(self.seg.slot(self.step, q, input.dtype)[r * k : (r + 1) * k])

    def gather_split_sizes(self, call: Call, output: torch.Tensor, input: torch.Tensor) -> None:
        # an op of its own in the headers, so that it never pairs with a peer's all_gather
        self.all_gather(call, output, input, "split_sizes")

    def all_to_all_v(self, call: Call, output: torch.Tensor, input: torch.Tensor, sends: list[list[int]]) -> None:
        """Blocks of any size. Each rank's input is one stream, its blocks in rank order; step s
        stages a chunk of every rank's stream, elements [s C, (s + 1) C), with one copy, and each
        rank copies out the part of each peer's chunk that falls in the peer's block for it
        (``sends`` says where that is). So every slot is full on every step but the last, however
        skewed the sizes. (Before, every block was padded to the largest one any rank sends: two
        fresh buffers of world_size x that block on every call, and the padding moved too.)"""
        r, w = self.rank, self.world_size
        totals = [sum(row) for row in sends]
        header = self._begin(call, "all_to_all_v", input.dtype, sum(totals), 0)
        mine_at = [sum(row[:r]) for row in sends]  # where my block starts in rank p's stream
        out_at = block_offsets(self.splits(sends)[1])
        for start, stop in self._steps(max(totals), input.element_size()):
            staged = max(0, min(stop, totals[r]) - start)
            self.seg.slot(self.step, r, input.dtype)[:staged].copy_(input[start : start + staged])
            self._sync(header if start == 0 else None)
            for p in range(w):
                lo, hi = max(start, mine_at[p]), min(stop, mine_at[p] + sends[p][r])
                if lo < hi:
                    at = out_at[p] + lo - mine_at[p]
                    output[at : at + hi - lo].copy_(self.seg.slot(self.step, p, input.dtype)[lo - start : hi - start])

    def all_gather_v(self, call: Call, output: torch.Tensor, input: torch.Tensor, sizes: list[int]) -> None:
        """Inputs of different sizes: all_gather's steps over the largest, step s staging
        elements [s C, (s + 1) C) of each rank's input (what it has of them). Each input is
        staged once; as an all_to_all_v it was staged world_size times, after a copy that
        repeated it world_size times."""
        r, w = self.rank, self.world_size
        header = self._begin(call, "all_gather_v", input.dtype, sum(sizes), 0)
        at = block_offsets(sizes)
        for start, stop in self._steps(max(sizes), input.element_size()):
            staged = max(0, min(stop, sizes[r]) - start)
            self.seg.slot(self.step, r, input.dtype)[:staged].copy_(input[start : start + staged])
            self._sync(header if start == 0 else None)
            for q in range(w):
                k = min(stop, sizes[q]) - start
                if k > 0:
                    src = input[start : start + k] if q == r else self.seg.slot(self.step, q, input.dtype)[:k]
                    output[at[q] + start : at[q] + start + k].copy_(src)

    def gather(self, call: Call, output: torch.Tensor | None, input: torch.Tensor, root: int) -> None:
        # all_gather's steps, with only the root reading: the others write and pass the barrier
        n = input.numel()
        header = self._begin(call, "gather", input.dtype, n, root)
        for start, stop in self._steps(n, input.element_size()):
            if self.rank != root:
                self.seg.slot(self.step, self.rank, input.dtype)[: stop - start].copy_(input[start:stop])
            self._sync(header if start == 0 else None)
            if self.rank == root:
                for q in range(self.world_size):
                    src = input[start:stop] if q == root else self.seg.slot(self.step, q, input.dtype)[: stop - start]
                    output[q * n + start : q * n + stop].copy_(src)

    def scatter(self, call: Call, output: torch.Tensor, input: torch.Tensor | None, root: int) -> None:
        # the root stages one k-element piece of every peer's block per step, as all_to_all does
        w, r, n = self.world_size, self.rank, output.numel()
        header = self._begin(call, "scatter", output.dtype, n, root)
        for start, stop in self._steps(n, output.element_size() * w):
            k = stop - start
            if r == root:
                staged = self.seg.slot(self.step, r, output.dtype)
                for q in range(w):
                    if q != r:
                        staged[q * k : (q + 1) * k].copy_(input[q * n + start : q * n + stop])
            self._sync(header if start == 0 else None)
            if r == root:
                output[start:stop].copy_(input[r * n + start : r * n + stop])
            else:
                output[start:stop].copy_(self.seg.slot(self.step, root, output.dtype)[r * k : (r + 1) * k])

    def barrier(self, call: Call) -> None:
        self._sync(self._begin(call, "barrier", None, 0, 0))

    def entering(self, call: Call) -> None:
        self.seg.publish_call(call.index)

    def reject(self, call_index: int, reason: str, learn_outcome: bool = True) -> None:
        # peers that leave the call mark the segment broken, which this rank's next call sees
        self.seg.reject(call_index, reason)

    def interrupt(self, reason: str) -> None:
        super().interrupt(reason)
        self.seg.interrupted = reason

    def peer_left(self) -> str | None:
        return self.seg.peer_left()

    def _refusal(self) -> str | None:
        """A refusal of the current call, a failure or a mismatch posted on the group's board (set
        when this transport is the host part of a hierarchical one); peers on this host use the
        segment's own flags."""
        return None if self.refusals is None else self.refusals.heard(self.seg.current_call)

    def close(self) -> None:
        self.seg.close()
