"""Blockwise 8-bit quantization for a compressed wire: int8, float8 e4m3fn and float8 e5m2.

A float32 message is cut into blocks of ``block`` elements (a power of two; the last block may
be short). Each block travels as its 8-bit values and one float32 scale, the block's largest
magnitude over the format's largest value, so each block uses the format's whole range whatever
the magnitudes elsewhere in the message (a gradient's layers differ by orders of magnitude).
``quantize`` makes them; ``dequantize_add`` adds a received block into a float32 accumulator,
where sums are taken in float32 and rounded once, as the 16-bit wire's are.

Every value is rounded to the nearest point of the format's grid, ties to even (torch's own
casts). For a block whose largest magnitude is ``a``, with scale ``s = a / QMAX``, the error of
one element ``x`` is at most (``error_bound``):

- int8 (QMAX 127): ``s / 2``;
- float8 e4m3fn (QMAX 448, 3 mantissa bits): ``max(|x| 2**-4, s 2**-10)``;
- float8 e5m2 (QMAX 57344, 2 mantissa bits): ``max(|x| 2**-3, s 2**-17)``.

A block whose largest magnitude is below ``TINY`` (2**-100) travels as zeros with a zero scale,
as an all-zero block does: its values are below any use, and the reciprocal of a smaller
block's scale overflows float32 (an e4m3fn block of 1e-39 became NaN; error feedback shrinks a
residual left alone in a block towards such sizes step by step).

A block holding inf or nan gets a NaN scale and zero values: everything it dequantizes to is
NaN, so a sum that takes it in is non-finite where it lands, as an unquantized sum would be, and
GradScaler's check of the result still sees it. Other blocks are unaffected.

The Triton kernels round in float32 arithmetic on the grid and then cast exactly, rather than
relying on the float32-to-float8 cast: Triton's interpreter (how CI runs them) rounds values that
carry into the next power of two down a whole binade (31.45 became 16, not 32, in e4m3fn).
"""

from __future__ import annotations

import threading

import torch

from ..config import wire_block_problem
from ._launch import use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # the reference path needs no Triton
    triton = None

# blocks whose largest magnitude is below this travel as zeros: QMAX / TINY fits float32 for
# every format, and TINY / QMAX is a normal float32
TINY = 2.0 ** -100
# format: (largest value, mantissa bits, smallest normal exponent); int8 is a grid of integers
FORMATS = {
    torch.int8: (127.0, 0, 0),
    torch.float8_e4m3fn: (448.0, 3, -6),
    torch.float8_e5m2: (57344.0, 2, -14),
}


def check_format(dtype: torch.dtype, block: int) -> None:
    """Refuse a wire dtype or block size the quantizer does not take, saying what it takes."""
    if dtype not in FORMATS:
        names = ", ".join(str(d).replace("torch.", "") for d in FORMATS)
        raise ValueError(f"8-bit wire: {dtype} is not a quantized wire dtype; use one of {names}")
    problem = wire_block_problem(block)
    if problem is not None:
        raise ValueError(f"8-bit wire: block size {block!r}; {problem}")


def blocks_of(n: int, block: int) -> int:
    """How many scales a message of ``n`` elements carries."""
    return -(-n // block)


def _check_message(name: str, x: torch.Tensor, dtype: torch.dtype | None = None) -> None:
    if x.dim() != 1 or not x.is_contiguous() or (dtype is not None and x.dtype != dtype):
        want = f"{str(dtype).replace('torch.', '')} " if dtype is not None else ""
        raise ValueError(f"{name} must be a flat contiguous {want}tensor; found shape {tuple(x.shape)} "
                         f"{x.dtype} (contiguous={x.is_contiguous()})")


if triton is not None:

    @triton.jit
    def _to_grid(y, MANTISSA: tl.constexpr, MIN_EXP: tl.constexpr):
        """y rounded to the format's grid, ties to even, in float32 (exact: the grid is float32's)."""
        if MANTISSA == 0:  # int8: the integers
            return _nearest_even(y)
        # the spacing of the grid at |y|: 2**(exponent - mantissa bits); subnormals, below the
        # smallest normal exponent, share its spacing
        exponent = ((y.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
        unit = ((tl.maximum(exponent, MIN_EXP) - MANTISSA + 127) << 23).to(tl.float32, bitcast=True)
        return _nearest_even(y / unit) * unit

    @triton.jit
    def _nearest_even(r):
        down = tl.floor(r)
        frac = r - down
        odd = (down - 2.0 * tl.floor(down * 0.5)) != 0.0
        return tl.where((frac > 0.5) | ((frac == 0.5) & odd), down + 1.0, down)

    @triton.jit
    def _quantize_kernel(x_ptr, q_ptr, scale_ptr, n, QMAX: tl.constexpr, MANTISSA: tl.constexpr,
                         MIN_EXP: tl.constexpr, TINY: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        finite = tl.abs(x) < float("inf")  # nan < inf is False too
        bad = tl.max(tl.where(finite, 0, 1), axis=0)
        x = tl.where(finite, x, 0.0)  # the block is sent as zeros with a NaN scale
        largest = tl.max(tl.abs(x), axis=0)
        largest = tl.where(largest >= TINY, largest, 0.0)
        inverse = tl.where(largest > 0, QMAX / tl.where(largest > 0, largest, 1.0), 0.0)
        q = _to_grid(x * inverse, MANTISSA, MIN_EXP)
        q = tl.minimum(tl.maximum(q, -QMAX), QMAX)
        q = tl.where(bad != 0, 0.0, q)
        tl.store(q_ptr + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(scale_ptr + pid, tl.where(bad != 0, float("nan"), largest / QMAX))

    @triton.jit
    def _dequantize_add_kernel(acc_ptr, q_ptr, scale_ptr, n, BLOCK: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        scale = tl.load(scale_ptr + pid)
        q = tl.load(q_ptr + offs, mask=mask).to(tl.float32)  # lanes past n are never stored
        acc = tl.load(acc_ptr + offs, mask=mask)
        tl.store(acc_ptr + offs, acc + q * scale, mask=mask)


def quantize(x: torch.Tensor, dtype: torch.dtype, block: int, *, force_triton: bool | None = None,
             out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (flat float32) as ``dtype`` values and one float32 scale per ``block`` elements.

    force_triton: None picks the Triton kernel on CUDA and the reference on the CPU; True forces
    the kernel (tests run it on CPU tensors under TRITON_INTERPRET=1), False the reference.
    out: (values, scales) to write into, flat and contiguous (a wire buffer's parts), instead of
    new tensors.
    """
    check_format(dtype, block)
    _check_message("quantize: x", x, torch.float32)
    if out is None:
        q = torch.empty(x.numel(), dtype=dtype, device=x.device)
        scales = torch.empty(blocks_of(x.numel(), block), dtype=torch.float32, device=x.device)
    else:
        q, scales = out
        _check_message("quantize: out values", q, dtype)
        _check_message("quantize: out scales", scales, torch.float32)
        if q.numel() != x.numel() or scales.numel() != blocks_of(x.numel(), block):
            raise ValueError(f"quantize: {x.numel()} values in blocks of {block} need out tensors of {x.numel()} "
                             f"values and {blocks_of(x.numel(), block)} scales; found {q.numel()} and "
                             f"{scales.numel()}")
    if not use_triton(x.device, force_triton, x.dtype):
        quantize_reference(x, q, scales, block)
        return q, scales
    if triton is None:
        raise ImportError("quantize: Triton is not installed; pip install triton")
    if x.numel():
        qmax, mantissa, min_exp = FORMATS[dtype]
        _quantize_kernel[(scales.numel(),)](x, q, scales, x.numel(), QMAX=qmax, MANTISSA=mantissa,
                                            MIN_EXP=min_exp, TINY=TINY, BLOCK=block)
    return q, scales


def quantize_reference(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, block: int) -> None:
    """The same quantization in plain torch ops (the CPU path and the kernel's oracle). Few
    passes, each in place where it can be, into a scratch kept per thread: a fresh 10 MB tensor
    per op costs more in page faults than the op itself. 2.6M values on one core: 39 ms with
    a tensor per op, 25 ms with the largest magnitude as an infinity norm, 9 ms with a clamp and
    the message copied whole to pad its last block; 2.4M int8 values on the 2-core VM: 2.8 ms
    with those, 2.2 ms as written (whole blocks where they lie, the short last block padded on
    its own, no clamp)."""
    qmax = FORMATS[q.dtype][0]
    n = x.numel()
    full = n // block * block
    if full:
        _quantize_blocks(x[:full].view(-1, block), q[:full].view(-1, block), scales[: full // block], qmax)
    if full < n:  # the short last block, padded with zeros, as the kernel reads it
        last = x.new_zeros(block)
        last[: n - full] = x[full:]
        values = torch.empty(block, dtype=q.dtype, device=x.device)
        _quantize_blocks(last.view(1, block), values.view(1, block), scales[-1:], qmax)
        q[full:].copy_(values[: n - full])


def _quantize_blocks(blocks: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, qmax: float) -> None:
    """quantize_reference of whole blocks: ``blocks`` (float32) and ``q`` are (count, block) views,
    ``scales`` has one element per block. Each element goes through the same operations wherever
    its block lies, so the bits do not depend on how a message is cut into calls."""
    # the largest magnitude, inf or nan where a block holds them, without a tensor of magnitudes
    # (amax and amin, vectorised: 1 ms for 2.6M values on one core, where aminmax took 8.5 ms
    # and vector_norm(ord=inf, dim=1) 10 ms)
    largest = torch.maximum(torch.amax(blocks, dim=1, keepdim=True), torch.amin(blocks, dim=1, keepdim=True).neg_())
    bad = ~torch.isfinite(largest)
    largest.masked_fill_(bad | (largest < TINY), 0.0)
    y = _scratch(blocks.numel(), blocks.device).view(-1, blocks.shape[1])
    torch.mul(blocks, torch.where(largest > 0, qmax / largest, 0.0), out=y)
    # No clamp to [-qmax, qmax]: |x| <= largest, so |x * fl(qmax / largest)| <= qmax (1 + 2**-24)**2,
    # which goes to qmax in every format (int8: rounds below 127.5; float8: the cast rounds to the
    # grid, ties to even, and the next point up is far). A non-finite block is nan here, zeroed below.
    if q.dtype == torch.int8:
        y.round_()  # ties to even
    mine = scales.view(-1, 1)
    torch.div(largest, qmax, out=mine)
    if bad.any():
        y.masked_fill_(bad, 0.0)
        mine.masked_fill_(bad, float("nan"))
    q.copy_(y)


def dequantize_add(acc: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, block: int, *,
                   force_triton: bool | None = None) -> None:
    """``acc += q * scale`` per block, in float32: where a quantized message's pieces are summed."""
    check_format(q.dtype, block)
    _check_message("dequantize_add: acc", acc, torch.float32)
    _check_message("dequantize_add: q", q)
    if q.numel() != acc.numel() or scales.numel() != blocks_of(acc.numel(), block) or scales.dtype != torch.float32:
        raise ValueError(f"dequantize_add: {acc.numel()} accumulator elements take {acc.numel()} values and "
                         f"{blocks_of(acc.numel(), block)} float32 scales of blocks of {block}; found {q.numel()} "
                         f"values and {scales.numel()} {scales.dtype} scales")
    if not use_triton(acc.device, force_triton, acc.dtype):
        dequantize_add_reference(acc, q, scales, block)
        return
    if triton is None:
        raise ImportError("dequantize_add: Triton is not installed; pip install triton")
    if acc.numel():
        _dequantize_add_kernel[(scales.numel(),)](acc, q, scales, acc.numel(), BLOCK=block)


def dequantize_add_reference(acc: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, block: int) -> None:
    full = acc.numel() // block * block
    if full:
        values = _scratch(full, acc.device).copy_(q[:full]).view(-1, block)
        acc[:full].view(-1, block).add_(values.mul_(scales[: full // block, None]))
    if full < acc.numel():  # the short last block
        acc[full:].add_(q[full:].float() * scales[-1])


_SCRATCH = threading.local()  # per thread: a transport's thread may quantize while the caller's does


def _scratch(numel: int, device: torch.device) -> torch.Tensor:
    """A float32 buffer of at least ``numel`` elements for this thread, kept between calls
    (it grows to the largest message the thread has quantized)."""
    buf = getattr(_SCRATCH, "buf", None)
    if buf is None or buf.numel() < numel or buf.device != device:
        buf = torch.empty(numel, dtype=torch.float32, device=device)
        _SCRATCH.buf = buf
    return buf[:numel]


def error_bound(x: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, block: int) -> torch.Tensor:
    """The most each element of ``x`` may be off after ``quantize`` and dequantization (float32)."""
    qmax, mantissa, min_exp = FORMATS[dtype]
    per_element = scales.repeat_interleave(block)[: x.numel()]
    if mantissa == 0:
        bound = per_element / 2
    else:
        # half the grid's spacing: relative above the smallest normal, absolute (in units of the
        # scale) among the subnormals
        bound = torch.maximum(x.abs() * 2.0 ** -(mantissa + 1), per_element * 2.0 ** (min_exp - mantissa - 1))
    # a block below TINY travels as zeros: what it loses is itself
    return torch.where(per_element == 0, x.abs(), bound)
