"""The arithmetic of reductions, in one place: every transport, the NCCL path and the compiled
sharded step call it, so each rule has one home (STYLE.md 8c).

- AVG is a SUM across the ranks and one division at the end (``across_ranks``, ``finish_``,
  ``averaged_``): floats divided before their one rounding, integers truncated toward zero, as
  NCCL averages them (torch's "nccl" backend accepts integer AVG). A gradient average made of a
  SUM, where the group may have no AVG (gloo has none), divides each rank's share before the SUM,
  in the copy it makes anyway (``share_of_mean``): SurvivingSync's module and DDP paths, as
  torch's DDP divides before its all_reduce.
- A PREMUL_SUM is a SUM of inputs each rank first multiplies by a factor (``reduction``,
  ``premultiplied``).
- Complex SUM and AVG are the sums of their real and imaginary parts (``complex_as_real``).
- bool reduces as its uint8 bytes, with the op that gives bool's answer there (``bool_on_bytes``).
- 16-bit floats are reduced in float32 (``reduce_blocks_``): every rank's values widened exactly,
  combined in rank order (the same order on every rank, so every rank gets the same bits), an
  AVG divided, and the result rounded to 16 bits once; ``add_widened_`` is its one widening step.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from .ops import COMBINE, RedOp, dtype_name, from_torch

# bool ------------------------------------------------------------------------------------------

_BOOL_ON_BYTES = {RedOp.SUM: RedOp.MAX, RedOp.MAX: RedOp.MAX, RedOp.BOR: RedOp.MAX,
                  RedOp.MIN: RedOp.MIN, RedOp.PRODUCT: RedOp.MIN, RedOp.BAND: RedOp.MIN, RedOp.BXOR: RedOp.BXOR}


def bool_on_bytes(op: RedOp) -> RedOp:
    """The op that gives bool's answer on bool tensors viewed as uint8 (each 0 or 1), which is how
    every transport and NCCL carry them: any rank true (SUM, MAX, BOR) is MAX, every rank true
    (PRODUCT, MIN, BAND) is MIN, and XOR stays XOR. (AVG is refused on bool before this.)"""
    return _BOOL_ON_BYTES[op]


# AVG -------------------------------------------------------------------------------------------


def _as_sum(op: RedOp, ranks: int) -> tuple[RedOp, int | None]:
    """(the op to reduce with, what to divide the result by before its rounding): an AVG is a
    SUM divided by the number of ranks; any other op is itself, with nothing to divide."""
    return (RedOp.SUM, ranks) if op is RedOp.AVG else (op, None)


def across_ranks(op: RedOp) -> RedOp:
    """The op the ranks apply for ``op``: SUM for an AVG (which ``finish_`` then divides), else ``op``."""
    return _as_sum(op, 1)[0]


def averaged_(total: torch.Tensor, ranks: int) -> torch.Tensor:
    """``total``, a sum over ``ranks`` ranks, divided in place into their mean: a float exactly
    (before any rounding to 16 bits), an integer truncated toward zero, as NCCL averages integers."""
    return total.div_(ranks) if total.is_floating_point() else total.div_(ranks, rounding_mode="trunc")


def share_of_mean(tensor: torch.Tensor, ranks: int, out: torch.Tensor) -> torch.Tensor:
    """This rank's share of a mean over ``ranks`` ranks, written into ``out`` (a float buffer the
    caller then SUMs across the ranks): ``tensor`` divided by ``ranks``, in the one copy."""
    return torch.div(tensor, ranks, out=out)


def finish_(total: torch.Tensor, op: RedOp, ranks: int, into: torch.Tensor | None = None) -> None:
    """Complete ``op`` on ``total`` once ``ranks`` ranks applied ``across_ranks(op)`` to it: an
    AVG's division, then the one rounding into ``into`` where ``total`` is a float32 copy of it."""
    _, divide_by = _as_sum(op, ranks)
    if divide_by is not None:
        averaged_(total, divide_by)
    if into is not None and into is not total:
        into.copy_(total)


# 16-bit values in float32 ----------------------------------------------------------------------

# elements per piece of ``add_widened_`` on the CPU (1 MiB of float32: stays in cache)
_WIDEN_PIECE = 1 << 18


def _combine_(total: torch.Tensor, part: torch.Tensor, fn, widen_in: torch.Tensor | None) -> None:
    """``total = fn(total, part)`` in ``total``'s dtype. Where ``widen_in`` is given (a buffer of
    ``total``'s dtype), a ``part`` of another dtype is widened into it first, in pieces of its
    size: torch's mixed-dtype ops make their own fresh float32 copy of ``part`` on the CPU
    (page faults from 32 MiB) and run at a third of a float32 op's speed. Widening is exact, so
    both give the same bits."""
    if widen_in is None or part.dtype == total.dtype:
        fn(total, part, out=total)
        return
    n, piece = part.numel(), widen_in.numel()
    if n <= piece:
        fn(total, widen_in[:n].view(part.shape).copy_(part), out=total)
        return
    for start in range(0, n, piece):  # 1-D tensors only
        k = min(piece, n - start)
        into = total[start : start + k]
        fn(into, widen_in[:k].copy_(part[start : start + k]), out=into)


def reduce_blocks_(total: torch.Tensor, blocks: Sequence[torch.Tensor], op: RedOp, mean_of: int | None = None,
                   into: Sequence[torch.Tensor] = (), widen_in: torch.Tensor | None = None) -> torch.Tensor:
    """Reduce ``blocks`` (one per rank, in rank order) with ``op`` into ``total``, in ``total``'s
    dtype (float32 for 16-bit blocks: their values are widened exactly and combined in float32),
    divide an AVG, and round the result once into each tensor of ``into``. Returns ``total``.

    Args:
        total: the accumulator, shaped as each block (may be one of ``into`` when it has their dtype).
        op: SUM, AVG, PRODUCT, MIN, MAX or a bitwise op; an AVG sums and then divides.
        mean_of: how many ranks an AVG averages (default: one per block; more where each block
            already holds a sum over several ranks, as a host's sum does).
        widen_in: a buffer of ``total``'s dtype to widen each block into first (see ``_combine_``);
            None: a mixed-dtype op per block.
    """
    op, divide_by = _as_sum(op, mean_of or len(blocks))
    fn = COMBINE[op]
    total.copy_(blocks[0])
    for block in blocks[1:]:
        _combine_(total, block, fn, widen_in)
    if divide_by is not None:
        averaged_(total, divide_by)  # before the rounding into ``into``, as a widened AVG would
    for out in into:
        if out.data_ptr() != total.data_ptr():
            out.copy_(total)
    return total


def add_widened_(total: torch.Tensor, part: torch.Tensor) -> None:
    """``total += part`` for a 16-bit ``part`` and a float32 ``total``. On the CPU torch's
    mixed-dtype add runs at a third of the speed of a float32 one (9.3 ms against 3.0 ms for
    4.7M elements, one core), so the CPU widens ``part`` piece by piece into a small float32
    buffer first; the bits are the same."""
    buffer = None
    if total.device.type == "cpu":
        buffer = torch.empty(min(_WIDEN_PIECE, part.numel()), dtype=total.dtype)
    _combine_(total, part, torch.add, buffer)


# PREMUL_SUM ------------------------------------------------------------------------------------

Factor = float | torch.Tensor  # a PREMUL_SUM's: a number, or a one-element tensor
# Whether a PREMUL_SUM's factor reaches Python: older torch keeps it in C++, where only its own
# backends see it (torch 2.11 does)
FACTOR_READABLE = hasattr(dist.ReduceOp, "factor")


def reduction(reduce_op: object) -> tuple[RedOp, Factor | None]:
    """The op to reduce with and, for a PREMUL_SUM, the factor each rank multiplies its own input
    by before the SUM (as NCCL's premultiplied sum; FSDP2 sends one where a gradient divide factor
    is set). Other ops have no factor."""
    op = getattr(reduce_op, "op", reduce_op)
    if op != dist.ReduceOp.RedOpType.PREMUL_SUM:
        return from_torch(reduce_op), None
    if not FACTOR_READABLE:
        raise ValueError(f"PREMUL_SUM: torch {torch.__version__} does not let a backend written in Python read the "
                         "factor (torch 2.13 does, as ReduceOp.factor); upgrade torch, or multiply the input by the "
                         "factor and reduce with ReduceOp.SUM")
    factor = getattr(reduce_op, "factor", None)
    if isinstance(factor, torch.Tensor) and factor.numel() == 1 and factor.is_floating_point():
        return RedOp.SUM, factor.reshape(())
    if isinstance(factor, (int, float)) and not isinstance(factor, bool):
        return RedOp.SUM, float(factor)
    found = f"a tensor of shape {tuple(factor.shape)} and dtype {dtype_name(factor.dtype)}" if isinstance(
        factor, torch.Tensor) else repr(factor)
    raise ValueError(f"PREMUL_SUM needs a factor that is a number or a one-element floating-point tensor, found "
                     f"{found}; pass dist.ReduceOp.PREMUL_SUM(factor) or dist._make_nccl_premul_sum(factor)")


def premultiplied(t: torch.Tensor, factor: Factor | None, in_place: bool) -> torch.Tensor:
    """What a rank sums for a PREMUL_SUM: ``t`` times ``factor`` (a tensor factor moved to
    ``t``'s device), in place or as a copy; ``t`` itself where there is no factor."""
    if factor is None:
        return t
    if isinstance(factor, torch.Tensor) and factor.device != t.device:
        factor = factor.to(t.device)
    return t.mul_(factor) if in_place else t * factor


# complex numbers -------------------------------------------------------------------------------


def complex_as_real(tensors: list, op: RedOp) -> list:
    """Complex tensors as views of their (real, imaginary) pairs where ``op`` adds them (SUM and
    AVG; a PREMUL_SUM arrives here as SUM): a complex sum is the sums of its parts, as torch's
    all_reduce and NCCL compute it, and the views share the tensors' memory, so results land in
    them. Other ops keep complex tensors, which the checks refuse; so are lazy conjugate views
    left as they are, for the checks' own message."""
    if op not in (RedOp.SUM, RedOp.AVG):
        return tensors
    return [torch.view_as_real(t) if isinstance(t, torch.Tensor) and t.is_complex() and not t.is_conj() else t
            for t in tensors]
