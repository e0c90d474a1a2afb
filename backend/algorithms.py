"""What to move: turns the process group's tensor lists into flat transport calls.

This layer decides where the numerics that must not depend on the transport happen (their rules
are numerics.py's): float16/bfloat16 reductions accumulate in float32 (upcast here when the
transport cannot do it itself), AVG is SUM followed by one division in float32, bool reductions
run as uint8 max/min, lists of same-dtype tensors are packed into one buffer so they cost one
collective, and non-contiguous tensors go through a contiguous copy.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from .call import Call
from .errors import PeerRefusedError, RecoverableMismatchError, where
from . import agreement, numerics
from .ops import LOW_PRECISION, RedOp, flat_view, moved_as_bytes
from .scratch import DEFAULT_MAX_BYTES, Scratch
from .signatures import REDUCE_ROOT_FACTOR, mismatch_said, paired_with_size_exchange_said, signature
from .transports.base import Transport, overlap
from .transports.refusals import explained


PIECES_MIN_BYTES = 64 << 10
"""From this size a 16-bit SUM or AVG all_reduce on a transport that cannot sum 16-bit floats in
float32 itself (gloo, MPI) moves its pieces in 16 bits (``Collectives._sum_in_pieces``) instead
of widening the whole message to float32, which sends twice the bytes. Below it the message is
waiting on latency, and one widened call beats the two calls of the exchange."""

PIECES_ROUND_BYTES = 4 << 20
"""A larger 16-bit message is summed in pieces this size after another: on 2 simulated hosts at
1 Gbit/s one round of 16 MiB took 1.45x the time of four rounds of 4 MiB."""

# said by mismatches every rank finds in one gathered table, before any data moves
_STILL_USABLE = "Every rank raised this before any data moved; the group can still be used."

SIZES_MARK = 0x534D4444505F535A
"""The last element of every rank's row in the exchange of split sizes: a row without it came
from a rank that made another collective of the same byte size, which gloo and MPI pair with
the exchange without an error (shm's headers tell them apart)."""

# what an uneven all_to_all's ranks must agree on, said when they do not
_SPLIT_RULE = ("Rank q's output_split_sizes[p] must equal rank p's input_split_sizes[q] (and list all_to_all's "
               "tensor sizes likewise).")


def _as_is(t: torch.Tensor) -> torch.Tensor:
    return t


def _flat(t: torch.Tensor) -> tuple[torch.Tensor, Callable[[], None]]:
    """A 1-D contiguous view of ``t`` and a function that writes results back into ``t``."""
    if t.is_contiguous():
        return flat_view(t), lambda: None
    flat = t.contiguous().view(-1)
    return flat, lambda: t.copy_(flat.view_as(t))


def _pack(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, Callable[[], None]]:
    """One flat buffer holding every tensor (same dtype), and the function that unpacks it."""
    if len(tensors) == 1:
        return _flat(tensors[0])
    buf = torch.cat([t.reshape(-1) for t in tensors])

    def unpack() -> None:
        offset = 0
        for t in tensors:
            t.copy_(buf[offset : offset + t.numel()].view_as(t))
            offset += t.numel()

    return buf, unpack


def _adjacent(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """One flat view of ``tensors`` when they lie one after another in one piece of memory (the
    blocks of one tensor, ``list(out.chunk(world_size))``), else None. A gather or scatter then
    moves them where they are: a fresh buffer as large as all of them, as before, page-faulted
    on every call, and scatter ran at 0.43x gloo's speed at 64 MiB (2 ranks)."""
    first = tensors[0] if tensors else None
    if first is None or not all(t.is_contiguous() and t.dtype == first.dtype for t in tensors):
        return None
    size, at = first.element_size(), first.data_ptr()
    for t in tensors:
        if t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() or t.data_ptr() != at:
            return None
        at += t.numel() * size
    total = sum(t.numel() for t in tensors)
    return torch.empty(0, dtype=first.dtype).set_(first.untyped_storage(), first.storage_offset(), (total,))


def _unaliased(src: torch.Tensor, dst: torch.Tensor, in_place_at: int | None = None) -> torch.Tensor:
    """``src`` (flat), or a copy of it where it overlaps ``dst`` other than as the in-place form
    (starting at element ``in_place_at`` of ``dst``, which the transports take as it is): a
    transport writing ``dst`` in its own order would otherwise overwrite input not yet sent."""
    if not (src.numel() and dst.numel() and overlap(src, dst)):
        return src
    if in_place_at is not None and src.data_ptr() == dst[in_place_at:].data_ptr():
        return src
    return src.clone()


def _moved_per_element(dtype: torch.dtype) -> int:
    """How many of what the transport moves make one element of ``dtype``: its bytes where
    ``moved_as_bytes`` says so (sizes of such ops are then counted in bytes), else 1."""
    return dtype.itemsize if moved_as_bytes(dtype) else 1


def _by_dtype(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.dtype, []).append(t)
    return list(groups.values())


class Collectives:
    """The algorithms of one process group over its transport."""

    def __init__(self, transport: Transport, check_signatures: bool, scratch_max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.transport = transport
        self.rank, self.world_size = transport.rank, transport.world_size
        self._check = check_signatures and not transport.capabilities.checks_signatures
        # float32 copies of 16-bit messages, reused (scratch.py says why)
        self.scratch = Scratch(scratch_max_bytes)

    # shared steps ------------------------------------------------------------------------------
    @staticmethod
    def _as_bytes(t: torch.Tensor | None) -> torch.Tensor | None:
        """A flat tensor that an op only moves, as its uint8 bytes where ``moved_as_bytes`` says so
        (bool, float8, int16, ...): transports move the dtypes they reduce, and bytes (the step's
        ``Call.carrying`` names the dtype, for the headers)."""
        if t is None:
            return None
        return t.view(torch.uint8) if moved_as_bytes(t.dtype) else t

    def _agree(self, call: Call, op: str, dtype: torch.dtype | None, numel: int, arg: int = 0,
               moves: bool = False) -> Call:
        """Verify that every rank calls the same op on the same size and dtype, where enabled;
        otherwise tell the group's refusal board what this rank is calling, so that a wait in it
        that lasts compares it with its peers' (refusals.RefusalBoard.mismatch_in). Returns the
        step of ``call`` the transport runs: its signature, and for an op that ``moves`` data,
        the dtype it carries as bytes."""
        mine = signature(op, dtype, numel, arg)
        carried = dtype if moves and dtype is not None and moved_as_bytes(dtype) else None
        step = call.step(mine, carried)
        if not self._check:
            board = self.transport.refusals
            if board is not None:
                board.entering(call.index, mine)
            return step
        try:
            # the transport's own all_gather, not agreement.exchange_in_group: this runs inside
            # every collective, and int64 signatures need no words or second call
            everyone = self.transport.signature_check(call.step(mine), mine)  # int64 signatures: no bytes carried
        except PeerRefusedError:  # says what happened, naming this call, as it would without the check
            raise
        except dist.DistBackendError as exc:
            raise type(exc)(f"{where(self.rank, self.world_size, op)} checking that every rank called "
                            f"the same collective failed: {exc}") from exc
        if agreement.agreed(everyone):
            return step
        said = mismatch_said([(r, call.index, s) for r, s in enumerate(everyone)])
        raise RecoverableMismatchError(f"{where(self.rank, self.world_size, op)} {said} {_STILL_USABLE}")

    def _needs_float32(self, dtype: torch.dtype, op: RedOp | None) -> bool:
        """16-bit floats go over the wire as float32 when the transport cannot accumulate them in
        float32 itself, and for AVG (so the sum is divided before its single rounding)."""
        return dtype in LOW_PRECISION and (op is RedOp.AVG or not self.transport.capabilities.accumulates_low_precision)

    def _wire(self, flat: torch.Tensor, op: RedOp) -> tuple[torch.Tensor, RedOp, Callable[[], None]]:
        """The tensor the transport reduces, the op it applies, and the write-back afterwards."""
        if flat.dtype is torch.bool:
            return flat.view(torch.uint8), numerics.bool_on_bytes(op), lambda: None
        wire = self.scratch.widened("wire", flat) if self._needs_float32(flat.dtype, op) else flat
        return wire, numerics.across_ranks(op), lambda: numerics.finish_(wire, op, self.world_size, into=flat)

    def _sums_in_pieces(self, flat: torch.Tensor, op: RedOp) -> bool:
        return (flat.dtype in LOW_PRECISION and op in (RedOp.SUM, RedOp.AVG) and self.world_size > 1
                and not self.transport.capabilities.accumulates_low_precision
                and flat.numel() * flat.element_size() >= PIECES_MIN_BYTES)

    def _sum_in_pieces(self, step: Call, flat: torch.Tensor, op: RedOp) -> None:
        """A 16-bit SUM or AVG all_reduce whose bytes all travel in 16 bits and whose arithmetic is
        float32: an all_to_all gives each rank every rank's values of one share of the message,
        which it sums in float32 in rank order (and divides, for an AVG) and rounds once; an
        all_gather of the rounded shares completes it. Each rank sends 2 (w - 1) / w of the
        message, as a ring all_reduce does, in half the bytes of the widened message; every rank
        gets the same bits, which are those of a float32 sum in rank order rounded once."""
        w, n = self.world_size, flat.numel()
        share = -(-n // w)
        if share * w == n:
            send = flat
        else:  # the last share is padded with zeros, which add nothing
            send = self.scratch.get("pieces out", flat.dtype, share * w)
            send[:n].copy_(flat)
            send[n:].zero_()
        pieces = self.scratch.get("pieces in", flat.dtype, share * w)
        self.transport.all_to_all(step, pieces, send)  # block q: rank q's values of this rank's share
        blocks = pieces.view(w, share)
        mine = blocks[0]  # reused for this rank's rounded share, once every block is read
        numerics.reduce_blocks_(self.scratch.get("wire", torch.float32, share), blocks, op, into=[mine])
        if share * w == n:
            self.transport.all_gather(step, flat, mine)
        else:
            gathered = self.scratch.get("pieces out", flat.dtype, share * w)
            self.transport.all_gather(step, gathered, mine)
            flat.copy_(gathered[:n])

    # collectives -------------------------------------------------------------------------------
    def all_reduce(self, call: Call, tensors: list[torch.Tensor], op: RedOp,
                   premultiplied: Callable[[torch.Tensor], torch.Tensor] = _as_is) -> None:
        """``premultiplied`` (a PREMUL_SUM's factor, in place) runs once the ranks agreed on the
        call: a mismatch raises RecoverableMismatchError, which must leave the input as it was."""
        for group in _by_dtype(tensors):
            flat, unpack = _pack(group)
            step = self._agree(call, "all_reduce", flat.dtype, flat.numel(), int(op))
            flat = premultiplied(flat)
            if op is RedOp.AVG and flat.dtype in self.transport.capabilities.all_reduces_16_bit_avg:
                self.transport.all_reduce(step, flat, op)  # 16 bits on the network (widened: twice the bytes)
            elif self._sums_in_pieces(flat, op):
                round_numel = PIECES_ROUND_BYTES // flat.element_size()
                for start in range(0, flat.numel(), round_numel):
                    self._sum_in_pieces(step, flat[start : start + round_numel], op)
            else:
                wire, wire_op, finish = self._wire(flat, op)
                self.transport.all_reduce(step, wire, wire_op)
                finish()
            unpack()

    def broadcast(self, call: Call, tensors: list[torch.Tensor], root: int) -> None:
        for group in _by_dtype(tensors):
            flat, unpack = _pack(group)
            step = self._agree(call, "broadcast", flat.dtype, flat.numel(), root, moves=True)
            self.transport.broadcast(step, self._as_bytes(flat), root)
            if self.rank != root:
                unpack()

    def reduce(self, call: Call, tensor: torch.Tensor, root: int, op: RedOp,
               premultiplied: Callable[[torch.Tensor], torch.Tensor] = _as_is) -> None:
        """``premultiplied``: as all_reduce's (in place on the root, a copy elsewhere)."""
        flat, unpack = _flat(tensor)
        step = self._agree(call, "reduce", flat.dtype, flat.numel(), root * REDUCE_ROOT_FACTOR + int(op))
        flat = premultiplied(flat)
        wire, wire_op, finish = self._wire(flat, op)
        self.transport.reduce(step, wire, root, wire_op)
        if self.rank == root:
            finish()
            unpack()

    def _move(self, call: Call, op: str, output: torch.Tensor, input: torch.Tensor, in_place_at: int | None = None) -> None:
        """A collective that only moves bytes (no arithmetic): any dtype travels as it is. An
        input that overlaps the output other than at ``in_place_at`` goes from a copy (an in-place
        all_to_all_single on gloo, an all_gather whose input is another rank's block on shm)."""
        src, _ = _flat(input)
        dst, unpack = _flat(output)
        step = self._agree(call, op, src.dtype, src.numel(), moves=True)
        src, dst = self._as_bytes(_unaliased(src, dst, in_place_at)), self._as_bytes(dst)
        getattr(self.transport, op)(step, dst, src)
        unpack()

    def all_gather(self, call: Call, output: torch.Tensor, input: torch.Tensor) -> None:
        """``output`` holds world_size blocks of ``input``'s numel, in rank order; ``input`` may
        be this rank's own block of it."""
        self._move(call, "all_gather", output, input, in_place_at=self.rank * input.numel())

    def reduce_scatter(self, call: Call, output: torch.Tensor, input: torch.Tensor, op: RedOp) -> None:
        """``output`` gets the reduction of block ``rank`` of every rank's ``input``."""
        src, _ = _flat(input)
        dst, unpack = _flat(output)
        step = self._agree(call, "reduce_scatter", src.dtype, dst.numel(), int(op))
        if src.dtype is torch.bool:
            self.transport.reduce_scatter(step, dst.view(torch.uint8), src.view(torch.uint8), numerics.bool_on_bytes(op))
        elif src.dtype in self.transport.capabilities.reduce_scatters_16_bit and op in (RedOp.SUM, RedOp.AVG):
            self.transport.reduce_scatter(step, dst, src, op)  # 16 bits on the network (widened: twice the bytes)
        else:
            wire_out, wire_op, finish = self._wire(dst, op)
            wire_in = self.scratch.widened("wire in", src) if wire_out is not dst else src
            self.transport.reduce_scatter(step, wire_out, wire_in, wire_op)
            finish()
        unpack()

    def all_to_all(self, call: Call, output: torch.Tensor, input: torch.Tensor) -> None:
        """Block ``q`` of ``input`` goes to rank ``q``; ``output`` block ``q`` comes from rank ``q``."""
        self._move(call, "all_to_all", output, input)

    def gather(self, call: Call, outputs: list[torch.Tensor], input: torch.Tensor, root: int) -> None:
        """The root's ``outputs`` (one per rank) receive every rank's ``input``; elsewhere
        ``outputs`` is empty."""
        src, _ = _flat(input)
        n = src.numel()
        step = self._agree(call, "gather", src.dtype, n, root, moves=True)
        everyone = adjacent = _adjacent(outputs) if self.rank == root else None
        if self.rank == root and everyone is None:
            everyone = torch.empty(self.world_size * n, dtype=src.dtype)
        elif adjacent is not None:
            src = _unaliased(src, adjacent, root * n)  # the input may lie in another rank's block
        self.transport.gather(step, self._as_bytes(everyone), self._as_bytes(src), root)
        if everyone is not None and adjacent is None:
            for out, block in zip(outputs, everyone.view(self.world_size, n)):
                out.copy_(block.view_as(out))

    def scatter(self, call: Call, output: torch.Tensor, inputs: list[torch.Tensor], root: int) -> None:
        """``output`` receives the root's ``inputs[rank]``; elsewhere ``inputs`` is empty."""
        dst, unpack = _flat(output)
        step = self._agree(call, "scatter", dst.dtype, dst.numel(), root, moves=True)
        everything = None
        if self.rank == root:
            everything = _adjacent(inputs)
            if everything is None:
                everything, _ = _pack(inputs)
        self.transport.scatter(step, self._as_bytes(dst), self._as_bytes(everything), root)
        unpack()

    def all_to_all_v(self, call: Call, output: torch.Tensor, output_splits: list[int], input: torch.Tensor,
                     input_splits: list[int], row: int = 1, rule: str = _SPLIT_RULE) -> None:
        """Block ``q`` of ``input`` (``input_splits[q]`` rows of ``row`` elements, in rank order)
        goes to rank ``q``; ``output`` receives ``output_splits[q]`` rows from rank ``q``. Every rank's
        splits are first gathered (one small all_gather, always): a rank whose expectations differ
        from what its peers send then fails the call on every rank, naming them, before any data
        moves. Sizes change from call to call here (MoE routing), and without the check MPI
        returned partly filled outputs without an error; the shm transport plans its steps with
        every rank's sizes."""
        src, _ = _flat(input)
        dst, unpack = _flat(output)
        step = self._agree(call, "all_to_all_v", src.dtype, 0, moves=True)
        rows = self._agreed_splits(step, input_splits, output_splits, row, rule)
        unit = row * _moved_per_element(src.dtype)  # a row, in what the transport moves
        src, dst = self._as_bytes(_unaliased(src, dst)), self._as_bytes(dst)  # blocks move to other offsets
        self.transport.all_to_all_v(step, dst, src, [[c * unit for c in r] for r in rows])
        unpack()

    def all_gather_v(self, call: Call, outputs: list[torch.Tensor], input: torch.Tensor) -> None:
        """``outputs[q]`` receives rank q's ``input``, whose sizes differ. Every rank's sizes are
        first checked against its peers', as an uneven all_to_all's whose every block is the
        input. Outputs that lie one after another (``list(out.split(sizes))``) are written where
        they are; the input may be its own output."""
        src, _ = _flat(input)
        w, sizes = self.world_size, [t.numel() for t in outputs]
        step = self._agree(call, "all_gather_v", src.dtype, 0, moves=True)
        self._agreed_splits(step, [src.numel()] * w, sizes, 1,
                            rule="Rank q's output tensor p must have as many elements as rank p's input.")
        adjacent = _adjacent(outputs)
        received = adjacent if adjacent is not None else torch.empty(sum(sizes), dtype=src.dtype)
        mine = sum(sizes[: self.rank])
        src = _unaliased(src, received, mine)  # the input may lie in another rank's output
        unit = _moved_per_element(src.dtype)
        self.transport.all_gather_v(step, self._as_bytes(received), self._as_bytes(src), [n * unit for n in sizes])
        if adjacent is None:
            for out, block in zip(outputs, received.split(sizes)):
                out.copy_(block.view_as(out))

    def _agreed_splits(self, step: Call, input_splits: list[int], output_splits: list[int], row: int,
                       rule: str = _SPLIT_RULE) -> list[list[int]]:
        """Every rank's splits (in rows of ``row`` elements), gathered; raises
        CollectiveMismatchError on every rank (they all see the same table) where ranks' rows
        differ in size or a rank expects other sizes than its peers send. Returns what each
        rank sends each rank, in rows: ``[p][q]`` from p to q."""
        w = self.world_size
        mine = torch.tensor(list(input_splits) + list(output_splits) + [row, SIZES_MARK], dtype=torch.int64)
        table = torch.empty(w * mine.numel(), dtype=torch.int64)
        # int64 sizes move here, whatever the data's dtype: the step carries none
        self.transport.gather_split_sizes(step._replace(carrying=None), table, mine)
        rows = table.view(w, mine.numel()).tolist()
        unmarked = [p for p, r in enumerate(rows) if r[-1] != SIZES_MARK]
        if unmarked:
            # those ranks' call has completed with this rank's sizes as its data: no error reaches
            # them from here, but the board's announcement does, in their next call's wait
            said = paired_with_size_exchange_said(step.index, list(step.signature or ()),
                                                  [p for p in range(w) if p not in unmarked], unmarked,
                                                  mine.numel() * mine.element_size())
            if self.transport.refusals is not None:
                self.transport.refusals.announce_mismatch(said)
            raise explained(said, where(self.rank, w, step.op))
        widths = [r[2 * w] for r in rows]
        if len(set(widths)) > 1:
            raise RecoverableMismatchError(
                f"{where(self.rank, w, step.op)} ranks' rows differ in size "
                f"({'; '.join(f'rank {p}: {e} elements' for p, e in enumerate(widths))}); every rank's tensors "
                f"must have the same size in every dimension but the first. {_STILL_USABLE}")
        unit = "rows" if row > 1 else "elements"
        wrong = [(p, q, rows[p][q], rows[q][w + p]) for p in range(w) for q in range(w) if rows[p][q] != rows[q][w + p]]
        if wrong:
            said = "; ".join(f"rank {p} sends {sends} {unit} to rank {q}, which expects {expects}"
                             for p, q, sends, expects in wrong[:8])
            raise RecoverableMismatchError(
                f"{where(self.rank, w, step.op)} ranks disagree on the block sizes ({said}"
                f"{'; ...' if len(wrong) > 8 else ''}). {rule} {_STILL_USABLE}"
            )
        return [r[:w] for r in rows]

    def barrier(self, call: Call) -> None:
        self.transport.barrier(self._agree(call, "barrier", None, 0))
