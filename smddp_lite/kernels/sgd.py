"""Fused SGD update (momentum, dampening, Nesterov, weight decay) over one flat buffer.

With momentum it reads grad, param, momentum_buffer and writes param, momentum_buffer: 20 bytes
per float32 parameter; without, 12. Asked (``write_grad``), the gradient times ``scale``
(unscaled and clipped) is written back, 4 bytes more (see adam.py). The first step fills the
momentum buffer with the gradient,
as torch.optim.SGD does; ``step`` (a device tensor counting this step) tells the kernel which
step it is, so no host branch is needed.
"""

from __future__ import annotations

import torch

from ._launch import BLOCK, arithmetic_dtype, check_buffers, skipped_on_host, torch_fused_cpu, use_triton

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None


if triton is not None:

    @triton.jit
    def _sgd_kernel(param_ptr, grad_ptr, buf_ptr, lr_ptr, step_ptr, scale_ptr, found_inf_ptr,
                    n, momentum, dampening, weight_decay,
                    HAS_MOMENTUM: tl.constexpr, NESTEROV: tl.constexpr, WRITE_GRAD: tl.constexpr,
                    BLOCK: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)  # 64-bit offsets
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        found_inf = tl.load(found_inf_ptr)
        # a step with inf/nan gradients touches nothing: no element is in bounds
        mask = offs < tl.where(found_inf == 0, n, 0)
        lr = tl.load(lr_ptr)
        scale = tl.load(scale_ptr)

        p = tl.load(param_ptr + offs, mask=mask).to(tl.float32)
        g = tl.load(grad_ptr + offs, mask=mask).to(tl.float32) * scale
        if WRITE_GRAD:  # the unscaled, clipped gradient, before weight decay joins it
            tl.store(grad_ptr + offs, g.to(grad_ptr.dtype.element_ty), mask=mask)
        g = g + weight_decay * p
        if HAS_MOMENTUM:
            first = tl.load(step_ptr) == 1.0
            buf = tl.load(buf_ptr + offs, mask=mask).to(tl.float32)
            buf = tl.where(first, g, momentum * buf + (1.0 - dampening) * g)
            tl.store(buf_ptr + offs, buf.to(buf_ptr.dtype.element_ty), mask=mask)
            if NESTEROV:
                g = g + momentum * buf
            else:
                g = buf
        tl.store(param_ptr + offs, (p - lr * g).to(param_ptr.dtype.element_ty), mask=mask)


def sgd_step(param, grad, momentum_buffer, *, lr, step, scale, found_inf, momentum, dampening,
             weight_decay, nesterov, write_grad: bool = True, force_triton: bool | None = None) -> None:
    """Update ``param`` (and ``momentum_buffer`` when momentum != 0) in place, and leave ``grad``
    multiplied by ``scale``.

    Args:
        momentum_buffer: flat like ``param``; ignored (may be None) when ``momentum`` is 0.
        lr, step, scale, found_inf: 1-element device tensors, float32 (float64 for float64
            parameters); ``step`` counts this step.
        write_grad: leave ``grad`` multiplied by ``scale`` (as adam_step).
    """
    streams = dict(param=param, grad=grad)
    if momentum != 0:
        streams["momentum_buffer"] = momentum_buffer
    n = check_buffers("sgd_step", streams, dict(lr=lr, step=step, scale=scale, found_inf=found_inf))
    if not use_triton(param.device, force_triton, param.dtype):
        if force_triton is None and torch_fused_cpu(param.device, "_fused_sgd_", param.dtype):
            # on the CPU reading ``step`` is free; torch's kernel divides by grad_scale
            torch._fused_sgd_([param], [grad], [momentum_buffer] if momentum != 0 else [],
                              weight_decay=weight_decay, momentum=momentum, lr=float(lr), dampening=dampening,
                              nesterov=nesterov, maximize=False, is_first_step=bool(step.item() == 1.0),
                              grad_scale=scale.reciprocal(), found_inf=found_inf)
            return
        sgd_reference(param, grad, momentum_buffer, lr=lr, step=step, scale=scale, found_inf=found_inf,
                      momentum=momentum, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov,
                      write_grad=write_grad)
        return
    if triton is None:
        raise ImportError("sgd_step: Triton is not installed; pip install triton")
    if n == 0:
        return
    _sgd_kernel[(triton.cdiv(n, BLOCK),)](
        param, grad, momentum_buffer if momentum != 0 else param, lr, step, scale, found_inf,
        n, float(momentum), float(dampening), float(weight_decay),
        HAS_MOMENTUM=momentum != 0, NESTEROV=bool(nesterov), WRITE_GRAD=bool(write_grad), BLOCK=BLOCK)


def sgd_reference(param, grad, momentum_buffer, *, lr, step, scale, found_inf, momentum, dampening,
                  weight_decay, nesterov, write_grad: bool = True) -> None:
    """The same update in plain torch ops (the CPU path and the kernel's oracle)."""
    skip = skipped_on_host(found_inf)
    if skip:
        return
    keep = None if skip is not None else found_inf == 0
    compute = arithmetic_dtype(param.dtype)
    p = param.to(compute)
    g = grad.to(compute) * scale
    writes = [(grad, g)] if write_grad else []  # the unscaled, clipped gradient, before weight decay
    g = g + weight_decay * p
    if momentum != 0:
        buf = torch.where(step == 1.0, g, momentum * momentum_buffer.to(compute) + (1.0 - dampening) * g)
        writes.append((momentum_buffer, buf))
        g = g + momentum * buf if nesterov else buf
    writes.append((param, p - lr * g))
    for dst, src in writes:
        dst.copy_(src if keep is None else torch.where(keep, src, dst.to(compute)))
