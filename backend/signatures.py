"""A collective call's signature: what every rank of a group must agree on (op, dtype, size and
the op's argument), as a few integers that compare across ranks and travel in a tensor or a
store key, and its description in words for error messages.

Three checks use them: ``SMDDP_CHECK_COLLECTIVES``' all_gather of every call's signature
(algorithms.Collectives._agree), the look that ranks waiting long in a call take at each other's
signatures through the store (refusals.RefusalBoard.mismatch_in), which is always on, and the
headers of the shared-memory transport (shm.py). All three say what they found in the same words
(``mismatch_said``), which name the ranks holding each call through agreement.said, as every check
that ranks agree does.
"""

from __future__ import annotations

import torch

from . import agreement
from .errors import ranks_said
from .ops import RedOp, dtype_name, dtype_of_code, signature_code

MISMATCH_SAID = "ranks called different collectives"
"""How every mismatch's message starts (after its prefix), wherever it was found: a waiting
rank's reason in shared memory, or the board's announcement, is recognised by it."""

OPS = {"all_reduce": 1, "broadcast": 2, "reduce": 3, "all_gather": 4, "reduce_scatter": 5,
       "all_to_all": 6, "barrier": 7, "gather": 8, "scatter": 9, "all_to_all_v": 10, "all_gather_v": 11,
       "split_sizes": 12}
"""``split_sizes``: the all_gather of every rank's sizes that all_to_all_v and all_gather_v start
with, where a transport tells it apart from a plain all_gather (shm's headers)."""
_NAMES = {code: name for name, code in OPS.items()}

_ROOTED = {"broadcast", "gather", "scatter"}
_REDUCING = {"all_reduce", "reduce_scatter"}
_UNEVEN = {"all_to_all_v": ("all_to_all", "with split sizes"),
           "all_gather_v": ("all_gather", "with outputs of different sizes")}
_OUTPUT_SIZED = {"reduce_scatter", "scatter"}  # their signature holds the size of a rank's output
_SPLIT_SIZES_SAID = ("the exchange of sizes that starts all_to_all(with split sizes) and all_gather(with outputs of "
                     "different sizes)")
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
    if name == "split_sizes":
        return _SPLIT_SIZES_SAID
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


def mismatch_said(calls: list[tuple[int, int, list[int]]], waiting: bool = False, look: str | None = None) -> str:
    """What ranks that called different collectives are told (after errors.where's prefix):
    ``calls`` holds (rank, call number, signature) of the ranks compared. The message names the
    call, each rank's collective (ranks that called the same named together), and where to look
    in the script, which depends on what differs. ``waiting``: found by ranks that wait for each
    other in it (the refusal board's look); ``look``: where to look, in place of what the calls'
    differences suggest. Starts with MISMATCH_SAID, ends with a full stop."""
    numbers = {number for _, number, _ in calls}
    same_number = len(numbers) == 1
    ordered = sorted(calls)
    each = agreement.said([describe(sig) if same_number else f"call #{number} {describe(sig)}"
                           for _, number, sig in ordered], [rank for rank, _, _ in ordered],
                          each="{ranks}: {value}", joined="; ")
    which = f" as call #{numbers.pop()} of this group" if same_number else ""
    how = ", and each waits for the others in it" if waiting else ""
    if look is None:
        look = _where_to_look([sig for _, _, sig in calls]) if same_number else _LOOK_FOR_AN_EXTRA_CALL
    return f"{MISMATCH_SAID}{which}{how}: {each}. {look}"


def paired_with_size_exchange_said(call: int, sig: list[int], ranks: list[int], others: list[int], nbytes: int) -> str:
    """What ``ranks``, whose call ``sig`` (an uneven all_to_all or list all_gather) starts with
    an exchange of sizes, are told when ``others`` sent no sizes into it: those made another
    collective that moves ``nbytes`` per rank, as the exchange does, and the two paired, so theirs
    returned the sizes as its data. Starts with MISMATCH_SAID, ends with a full stop."""
    other = f"another collective of {nbytes} bytes per rank, which paired with {_SPLIT_SIZES_SAID} (as long)"
    shown = sorted([(r, describe(sig)) for r in ranks] + [(r, other) for r in others])
    each = agreement.said([said for _, said in shown], [r for r, _ in shown], each="{ranks}: {value}", joined="; ")
    return (f"{MISMATCH_SAID} as call #{call} of this group: {each}, "
            f"so the result of that call on {ranks_said(others)} is the other ranks' sizes, not data. Some ranks passed "
            "split sizes (or output tensors of different sizes) and others did not: every rank must call the same "
            "form of the collective.")


_LOOK_FOR_AN_EXTRA_CALL = ("Every rank must call the same collectives in the same order: look for a collective that "
                           "only some ranks call (under `if rank == 0:`, or in a loop that runs a different number of "
                           "times on some ranks).")


def _where_to_look(sigs: list[list[int]]) -> str:
    """What to look for in the user's script, by what differs between the ranks' calls (made as
    the same call of the group)."""
    ops = {_NAMES.get(s[0]) for s in sigs}
    forms = {_UNEVEN.get(op, (op,))[0] for op in ops - {"split_sizes"}}  # the uneven forms' plain names
    if len(ops) > 1 and len(forms) == 1 and forms <= {"all_to_all", "all_gather"}:
        return ("Some ranks passed split sizes (or output tensors of different sizes) and others did not: every rank "
                "must call the same form of the collective.")
    if len(ops) > 1:
        return _LOOK_FOR_AN_EXTRA_CALL
    if len({s[3] for s in sigs}) > 1:
        return "Every rank must pass the same root and reduce op to a collective."
    hints = []
    if len({s[2] for s in sigs}) > 1:
        hints.append("Every rank must pass tensors of the same size to a collective: look for a tensor whose shape "
                     "depends on the rank's data (a last batch that is smaller on some ranks: drop_last=True, or pad "
                     "it).")
    if len({s[1] for s in sigs}) > 1:
        hints.append("Every rank must pass tensors of the same dtype to a collective: look for a cast (or autocast) "
                     "that only some ranks make.")
    return " ".join(hints)


def _op_name(code: int) -> str:
    try:
        return RedOp(code).name
    except ValueError:
        return f"#{code}"
