"""What the NCCL path can run, as a table: the router (route.py) asks it once per CUDA call,
before the call takes a number, and sends what NCCL cannot run through host memory (staged.py).

NCCL reduces 8 dtypes with SUM, PRODUCT, MIN, MAX and (from 2.10) AVG. The table maps each
(dtype, op) a call can bring to NCCL's codes, or to the reason NCCL cannot run it:

- bool reduces as uint8 with the op that gives bool's answer (numerics.bool_on_bytes); XOR has
  no NCCL form;
- the bitwise ops have no NCCL form on any dtype;
- AVG before NCCL 2.10 is NCCL's SUM and one division on the communication stream;
- AVG of a one-rank group is SUM: NCCL's one-rank AVG kernel leaves the last (n mod its block
  count) elements unwritten before NCCL 2.29.7 (NVIDIA/nccl#1950; the conformance suite caught
  it on an H100 with NCCL 2.28.9);
- bfloat16 needs NCCL 2.10 (cupy defines the constant whatever NCCL it loads).

Ops that only move data (broadcast, all_gather, all_to_all_single) run on every dtype: one
without an NCCL type travels as its bytes (float8 parameters under FSDP2, int16, complex).
"""

from __future__ import annotations

from typing import Iterable, NamedTuple

import torch

from .. import numerics
from ..ops import BITWISE_OPS, DTYPES, RedOp
from .communicators import NCCL_AVG_VERSION, NCCL_BF16_VERSION, NCCL_DTYPE_NAMES, NCCL_OP_NAMES

REDUCES, MOVES = "reduces", "moves"
NCCL_FORMS: dict[str, str] = {
    "all_reduce": REDUCES,
    "reduce": REDUCES,
    "reduce_scatter": REDUCES,
    "reduce_scatter_tensor": REDUCES,
    "broadcast": MOVES,
    "all_gather": MOVES,
    "all_gather_into_tensor": MOVES,
    "all_to_all_single": MOVES,
}
"""The ops the NCCL path runs (op as errors name it -> how); the others (all_to_all of tensor
lists, gather, scatter, send, recv) go through host memory."""


class ReduceCode(NamedTuple):
    dtype: int
    """NCCL's dtype code."""
    op: int
    """NCCL's op code."""
    divide: bool
    """An AVG that NCCL runs as a SUM: the result is divided by the world size afterwards."""


class MoveCode(NamedTuple):
    dtype: int
    """NCCL's dtype code: the dtype's own, or uint8 for its bytes."""
    per_element: int
    """How many of NCCL's elements make one of the tensor's."""


class NcclSupport:
    """The table for one group: its NCCL's dtype and op codes, its world size, its NCCL version."""

    def __init__(self, dtype_codes: dict[torch.dtype, int], op_codes: dict[RedOp, int], world_size: int,
                 version: int) -> None:
        if version < NCCL_BF16_VERSION:
            dtype_codes = {dt: code for dt, code in dtype_codes.items() if dt is not torch.bfloat16}
        self._dtype_codes = dtype_codes
        avg_native = version >= NCCL_AVG_VERSION and RedOp.AVG in op_codes
        self._reduce: dict[tuple[torch.dtype, RedOp], ReduceCode | str] = {
            (dtype, red): _reduce_code(dtype_codes, op_codes, dtype, red, world_size, avg_native)
            for dtype in DTYPES for red in RedOp}

    @classmethod
    def of(cls, nccl, version: int, world_size: int) -> "NcclSupport":
        """The table for cupy's ``nccl`` module as loaded, at NCCL ``version``."""
        return cls({dt: getattr(nccl, name) for dt, name in NCCL_DTYPE_NAMES.items() if hasattr(nccl, name)},
                   {op: getattr(nccl, name) for op, name in NCCL_OP_NAMES.items() if hasattr(nccl, name)},
                   world_size, version)

    def reduce_code(self, dtype: torch.dtype, red: RedOp) -> ReduceCode:
        """NCCL's codes for reducing ``dtype`` with ``red``; a call that reaches the NCCL path
        was routed there by ``staging_reason``, which refuses what has none."""
        code = self._reduce[(dtype, red)]
        if isinstance(code, str):
            raise AssertionError(f"the NCCL path was given a call it cannot run ({code}): route.py must stage it")
        return code

    def reduce_codes(self) -> dict[tuple[torch.dtype, RedOp], ReduceCode]:
        """Every (dtype, op) NCCL reduces, with its codes."""
        return {key: code for key, code in self._reduce.items() if not isinstance(code, str)}

    def move_code(self, dtype: torch.dtype) -> MoveCode:
        """How an op that only moves data carries ``dtype``: its NCCL type, else its bytes."""
        code = self._dtype_codes.get(torch.uint8 if dtype is torch.bool else dtype)
        if code is not None:
            return MoveCode(code, 1)
        return MoveCode(self._dtype_codes[torch.uint8], dtype.itemsize)

    def staging_reason(self, op: str, dtypes: Iterable[torch.dtype], red: RedOp | None) -> str | None:
        """Why NCCL cannot run ``op`` on tensors of ``dtypes`` reducing with ``red`` (None for
        the ops that move data), or None where it can."""
        form = NCCL_FORMS.get(op)
        if form is None:
            return f"{op} has no NCCL form here"
        if form is MOVES or red is None:
            return None
        for dtype in dtypes:
            code = self._reduce.get((dtype, red), f"dtype {dtype} is not reduced by NCCL")
            if isinstance(code, str):
                return f"{op}: {code}"
        return None


def _reduce_code(dtype_codes: dict[torch.dtype, int], op_codes: dict[RedOp, int], dtype: torch.dtype, red: RedOp,
                 world_size: int, avg_native: bool) -> ReduceCode | str:
    """One entry of the table: the codes, or why there are none."""
    if dtype is torch.bool:
        if red is RedOp.AVG:
            return "AVG on bool"  # refused by the call's checks on every path
        dtype, red = torch.uint8, numerics.bool_on_bytes(red)
    if red in BITWISE_OPS:
        return f"{red.name}: NCCL has no bitwise reductions"
    if dtype not in dtype_codes:
        return f"dtype {dtype} has no NCCL type in this cupy/NCCL"
    if red is RedOp.AVG and world_size == 1:
        red = RedOp.SUM  # the average of one rank is its value, and SUM gives it exactly (see above)
    divide = red is RedOp.AVG and not avg_native
    red = numerics.across_ranks(red) if divide else red
    if red not in op_codes:
        return f"{red.name} has no NCCL op in this cupy/NCCL"
    return ReduceCode(dtype_codes[dtype], op_codes[red], divide)
