"""The step's scalars in one launch: the gradient multiplier (1 / loss scale x clipping
coefficient), found_inf, the global gradient norm, and whether the step counts.

Written as separate torch ops these are about ten launches of one element each (a reciprocal, a
stack and a norm, an add, a divide, a clamp, two multiplies, the conversions), which on a GPU
cost more host time than the arithmetic; one program computes them all from the buckets' norms.

Reads the n bucket norms and the two GradScaler scalars; writes 4 numbers into ``out``:
``[multiplier, found_inf, global norm, 1 - found_inf]``; the global norm (of the unscaled
gradients) only when clipping, which is what asks for it; otherwise that element is left as is.
The clipping coefficient is clip_grad_norm_'s: ``min(max_norm / (norm + 1e-6), 1)``.
"""

from __future__ import annotations

import torch

from ._launch import use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # the reference path needs no Triton
    triton = None

MULTIPLIER, FOUND_INF, GRAD_NORM, COUNTS = range(4)
_BLOCK = 1024  # norms read per iteration; a model has tens to hundreds of buckets


if triton is not None:

    @triton.jit
    def _step_scalars_kernel(norms_ptr, n, grad_scale_ptr, found_inf_ptr, out_ptr, max_norm,
                             HAS_SCALE: tl.constexpr, HAS_INF: tl.constexpr, CLIP: tl.constexpr,
                             BLOCK: tl.constexpr):
        inv_scale = 1.0
        if HAS_SCALE:
            inv_scale = 1.0 / tl.load(grad_scale_ptr).to(tl.float32)
        found_inf = 0.0
        if HAS_INF:
            found_inf = tl.load(found_inf_ptr).to(tl.float32)
        multiplier = inv_scale
        if CLIP:
            squares = tl.zeros([BLOCK], dtype=tl.float32)
            for start in range(0, n, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                x = tl.load(norms_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
                squares += x * x
            norm = tl.sqrt(tl.sum(squares, axis=0)) * inv_scale
            multiplier = inv_scale * tl.minimum(max_norm / (norm + 1e-6), 1.0)
            tl.store(out_ptr + 2, norm)
        tl.store(out_ptr + 0, multiplier)
        tl.store(out_ptr + 1, found_inf)
        tl.store(out_ptr + 3, 1.0 - found_inf)


def step_scalars(norms: torch.Tensor, grad_scale: torch.Tensor | None, found_inf: torch.Tensor | None,
                 max_norm: float | None, out: torch.Tensor, force_triton: bool | None = None) -> torch.Tensor:
    """Fill ``out`` (4 elements, the norms' dtype and device) with the step's scalars; returns it.

    Args:
        norms: (n,) the buckets' 2-norms of the averaged, still loss-scaled gradients (read only
            when clipping); float32, or float64 when some update computes in it.
        grad_scale, found_inf: what GradScaler hands the optimizer, or None.
        max_norm: clip the global norm to it; None for no clipping.
        force_triton: None picks Triton for float32 on CUDA (float64 takes the reference: Triton
            computes this in float32), True forces it (tests, TRITON_INTERPRET=1 on CPU tensors).
    """
    if out.numel() != 4 or out.dtype != norms.dtype or out.device != norms.device or not out.is_contiguous():
        raise ValueError(f"step_scalars: out must be 4 contiguous elements of {norms.dtype} on {norms.device}; "
                         f"found {out.numel()} of {out.dtype} on {out.device}")
    if not use_triton(norms.device, force_triton, norms.dtype):
        return step_scalars_reference(norms, grad_scale, found_inf, max_norm, out)
    if triton is None:
        raise ImportError("step_scalars: Triton is not installed; pip install triton")
    _step_scalars_kernel[(1,)](norms, norms.numel(), out if grad_scale is None else grad_scale,
                               out if found_inf is None else found_inf, out,
                               float(max_norm) if max_norm is not None else 0.0,
                               HAS_SCALE=grad_scale is not None, HAS_INF=found_inf is not None,
                               CLIP=max_norm is not None, BLOCK=_BLOCK)
    return out


def step_scalars_reference(norms: torch.Tensor, grad_scale: torch.Tensor | None, found_inf: torch.Tensor | None,
                           max_norm: float | None, out: torch.Tensor) -> torch.Tensor:
    """The same in torch ops (the CPU path and the kernel's oracle), in the norms' dtype."""
    dtype, device = norms.dtype, norms.device
    inv_scale = (torch.ones((), dtype=dtype, device=device) if grad_scale is None
                 else grad_scale.to(device, dtype).reshape(()).reciprocal())
    inf = torch.zeros((), dtype=dtype, device=device) if found_inf is None else found_inf.to(device, dtype).reshape(())
    multiplier = inv_scale
    if max_norm is not None:
        norm = torch.linalg.vector_norm(norms) * inv_scale
        multiplier = inv_scale * (max_norm / (norm + 1e-6)).clamp(max=1.0)
        out[GRAD_NORM] = norm
    out[MULTIPLIER], out[FOUND_INF], out[COUNTS] = multiplier, inf, 1.0 - inf
    return out
