"""A collective call's signature: what every rank of a group must agree on (op, dtype, size and
the op's argument), as a few integers that compare across ranks and travel in a tensor or a
store key, and its description in words for error messages.

Two checks use them: ``SMDDP_CHECK_COLLECTIVES``' all_gather of every call's signature
(algorithms.Collectives._agree), and the look that ranks waiting long in a call take at each
other's signatures through the store (refusals.RefusalBoard.mismatch_in), which is always on.
"""

from __future__ import annotations

import torch

from .ops import RedOp, dtype_name, dtype_of_code, signature_code

OPS = {"all_reduce": 1, "broadcast": 2, "reduce": 3, "all_gather": 4, "reduce_scatter": 5,
       "all_to_all": 6, "barrier": 7, "gather": 8, "scatter": 9, "all_to_all_v": 10, "all_gather_v": 11}
_NAMES = {code: name for name, code in OPS.items()}

_ROOTED = {"broadcast", "gather", "scatter"}
_REDUCING = {"all_reduce", "reduce_scatter"}
_UNEVEN = {"all_to_all_v": ("all_to_all", "with split sizes"),
           "all_gather_v": ("all_gather", "with outputs of different sizes")}
_OUTPUT_SIZED = {"reduce_scatter", "scatter"}  # their signature holds the size of a rank's output
REDUCE_ROOT_FACTOR = 16
"""reduce's argument is root * REDUCE_ROOT_FACTOR + op: both must agree, and RedOp has fewer
than 16 members."""


def signature(op: str, dtype: torch.dtype | None, numel: int, arg: int = 0) -> list[int]:
    """The signature of ``op`` (a key of OPS) on ``numel`` elements of ``dtype`` (None: no
    tensor) with ``arg`` (the root, the reduction, or reduce's combination of both)."""
    return [OPS[op], signature_code(dtype) if dtype else 0, numel, arg]


def describe(sig: list[int]) -> str:
    """``sig`` in words, as the user called it: ``all_reduce(numel=10, dtype=float32, op=SUM)``."""
    code, dtype_code, numel, arg = sig
    name = _NAMES.get(code, f"collective #{code}")
    if name == "barrier":
        return "barrier()"
    words = [f"numel={numel}", f"dtype={dtype_name(dtype_of_code(dtype_code)) if dtype_code else '-'}"]
    if name in _ROOTED:
        words.append(f"root={arg}")
    elif name in _REDUCING:
        words.append(f"op={_op_name(arg)}")
    elif name == "reduce":
        words += [f"root={arg // REDUCE_ROOT_FACTOR}", f"op={_op_name(arg % REDUCE_ROOT_FACTOR)}"]
    if name in _OUTPUT_SIZED:
        words[0] = f"output numel={numel}"
    if name in _UNEVEN:  # their sizes are checked apart, in a table every rank gathers
        name, words[0] = _UNEVEN[name]
    return f"{name}({', '.join(words)})"


def _op_name(code: int) -> str:
    try:
        return RedOp(code).name
    except ValueError:
        return f"#{code}"
