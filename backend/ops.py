"""The ops and dtypes the backend supports, as data, so errors can list them."""

from __future__ import annotations

import enum

import torch
import torch.distributed as dist


class RedOp(enum.IntEnum):
    """Reduction ops a transport sees. AVG reaches a transport only in a 16-bit reduce_scatter or
    all_reduce on one whose ``Capabilities.reduce_scatters_16_bit`` or ``all_reduces_16_bit_avg`` holds the
    dtype (and the hierarchical transport's part inside a host, in its float16 AVG's
    reduce_scatter); elsewhere the algorithms layer turns it into SUM and a division (numerics.py)."""

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
    """Map a ``dist.ReduceOp`` (or its ``RedOpType``) to ours (PREMUL_SUM: see ``numerics.reduction``)."""
    op = getattr(reduce_op, "op", reduce_op)
    try:
        return _FROM_TORCH[op]
    except (KeyError, TypeError):
        names = ", ".join(o.name for o in RedOp)
        raise ValueError(f"reduce op {op} is not supported; supported: {names}, PREMUL_SUM(factor)") from None


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
