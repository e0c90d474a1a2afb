"""The ops and dtypes the backend supports, as data, so errors can list them."""

from __future__ import annotations

import enum

import torch
import torch.distributed as dist


class RedOp(enum.IntEnum):
    """Reduction ops a transport sees. AVG reaches a transport only in a 16-bit reduce_scatter or
    all_reduce on one whose ``Capabilities.reduce_scatters_16_bit`` or ``all_reduces_16_bit_avg`` holds the
    dtype (and the hierarchical transport's part inside a host, in its float16 AVG's
    reduce_scatter); elsewhere the algorithms layer turns it into SUM and a division."""

    SUM = 0
    AVG = 1
    PRODUCT = 2
    MIN = 3
    MAX = 4
    BAND = 5
    BOR = 6
    BXOR = 7


_FROM_TORCH = {
    dist.ReduceOp.SUM: RedOp.SUM,
    dist.ReduceOp.AVG: RedOp.AVG,
    dist.ReduceOp.PRODUCT: RedOp.PRODUCT,
    dist.ReduceOp.MIN: RedOp.MIN,
    dist.ReduceOp.MAX: RedOp.MAX,
    dist.ReduceOp.BAND: RedOp.BAND,
    dist.ReduceOp.BOR: RedOp.BOR,
    dist.ReduceOp.BXOR: RedOp.BXOR,
}

# The dtypes every transport reduces -> small code used in cross-rank signatures (order is part of
# the wire format). Ops that only move data take any other dtype too, as bytes (see moved_as_bytes).
DTYPES: dict[torch.dtype, int] = {
    torch.float32: 1,
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.float64: 4,
    torch.int32: 5,
    torch.int64: 6,
    torch.uint8: 7,
    torch.bool: 8,
    torch.int8: 9,
}
DTYPE_BY_CODE = {code: dtype for dtype, code in DTYPES.items()}
# Ops whose tensors must be of a reducible dtype; every other op only moves bytes.
REDUCING_OPS = frozenset({"all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor"})
# Every dtype torch defines, in one order on every rank: the signature code of a moved-only dtype.
_ALL_DTYPES = sorted({d for d in vars(torch).values() if isinstance(d, torch.dtype)}, key=str)
LOW_PRECISION = (torch.float16, torch.bfloat16)
FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
BITWISE_OPS = (RedOp.BAND, RedOp.BOR, RedOp.BXOR)

def as_sum(op: RedOp, world_size: int) -> tuple[RedOp, int | None]:
    """(the op to reduce with, what to divide the result by before its rounding): an AVG is a
    SUM divided by the group's size; any other op is itself, with nothing to divide."""
    return (RedOp.SUM, world_size) if op is RedOp.AVG else (op, None)


# each op as an elementwise function of two tensors (``fn(a, b, out=a)`` reduces into ``a``)
COMBINE = {
    RedOp.SUM: torch.add,
    RedOp.PRODUCT: torch.mul,
    RedOp.MIN: torch.minimum,
    RedOp.MAX: torch.maximum,
    RedOp.BAND: torch.bitwise_and,
    RedOp.BOR: torch.bitwise_or,
    RedOp.BXOR: torch.bitwise_xor,
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def supported_dtype_names() -> str:
    return ", ".join(dtype_name(d) for d in DTYPES)


def flat_view(t: torch.Tensor) -> torch.Tensor:
    """A 1-D view of contiguous ``t`` with stride 1. ``view(-1)`` keeps the stride of a 0- or
    1-element tensor (``x[:, 1]`` of a 1 x 3 tensor has stride 3), which is contiguous all the
    same, and viewing that as bytes fails ("stride(-1) must be 1")."""
    flat = t.view(-1)
    if flat.numel() <= 1 and flat.stride(0) != 1:
        flat = flat.as_strided((flat.numel(),), (1,))
    return flat


def moved_as_bytes(dtype: torch.dtype) -> bool:
    """Whether a data-moving op carries ``dtype`` as its raw bytes: bool (no transport has a bool
    type) and every dtype that is not reduced (float8 for FSDP's float8 all_gather, int16,
    uint16...). Moving bytes cannot change a value, whatever it encodes."""
    return dtype is torch.bool or dtype not in DTYPES


def signature_code(dtype: torch.dtype) -> int:
    """A code for ``dtype`` that is the same on every rank (cross-rank signatures, shm headers)."""
    code = DTYPES.get(dtype)
    return code if code is not None else 64 + _ALL_DTYPES.index(dtype)


def dtype_of_code(code: int) -> torch.dtype | None:
    """The dtype of a ``signature_code``; None for 0 (no tensor) or a code it never gives."""
    if code in DTYPE_BY_CODE:
        return DTYPE_BY_CODE[code]
    return _ALL_DTYPES[code - 64] if 64 <= code < 64 + len(_ALL_DTYPES) else None


def from_torch(reduce_op: object) -> RedOp:
    """Map a ``dist.ReduceOp`` (or its ``RedOpType``) to ours (PREMUL_SUM: see ``reduction``)."""
    op = getattr(reduce_op, "op", reduce_op)
    try:
        return _FROM_TORCH[op]
    except (KeyError, TypeError):
        names = ", ".join(o.name for o in RedOp)
        raise ValueError(f"reduce op {op} is not supported; supported: {names}, PREMUL_SUM(factor)") from None


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


def divide_(t: torch.Tensor, by: int) -> torch.Tensor:
    """``t`` divided by ``by`` in place, as an AVG finishes: an integer tensor's quotient is
    truncated toward zero, as NCCL averages integers (torch's "nccl" backend accepts them)."""
    return t.div_(by) if t.is_floating_point() else t.div_(by, rounding_mode="trunc")


def check_op_for_dtype(op: RedOp, dtype: torch.dtype) -> None:
    """Refuse combinations that have no meaning (AVG of bool, bitwise ops on floats)."""
    if op is RedOp.AVG and dtype is torch.bool:
        raise ValueError(
            f"ReduceOp.AVG cannot average bool tensors (torch's nccl refuses them too); "
            "use MAX (any) or MIN (all), or convert the tensor to an integer or float"
        )
    if op in BITWISE_OPS and dtype in FLOATS:
        raise ValueError(
            f"ReduceOp.{op.name} needs an integer or bool tensor, found {dtype_name(dtype)}"
        )
