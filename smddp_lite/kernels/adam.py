"""Fused Adam / AdamW update over one flat buffer (an arena of buckets): one read of each stream,
one write of each state.

Per element it reads grad, param, exp_avg, exp_avg_sq and writes param, exp_avg, exp_avg_sq:
28 bytes per float32 parameter, the floor for an Adam step. The gradient is multiplied by
``scale`` (1 / loss scale x clipping coefficient) on the way in, so unscaling and clipping cost
no pass of their own. Asked (``write_grad``), that gradient is written back (32 bytes), as
torch's fused kernels and GradScaler.unscale_ + clip_grad_norm_ leave ``.grad`` unscaled and
clipped. ``lr``, ``step``, ``scale`` and ``found_inf`` are device tensors: a
scheduler changing the learning rate changes a value, not the compiled kernel, and nothing
waits on the host. A step with ``found_inf`` != 0 changes nothing (the caller leaves ``step``
where it was).
"""

from __future__ import annotations

import math

import torch

from ._launch import BLOCK, arithmetic_dtype, check_buffers, skipped_on_host, torch_fused_cpu, use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # the reference path needs no Triton
    triton = None


if triton is not None:

    @triton.jit
    def _bias_corrections(lr, step, log_beta1, log_beta2):
        # lr / (1 - beta1**step) and sqrt(1 - beta2**step), once per program, in float64: 1 - beta2
        # keeps 3 of float32's 7 digits (beta2 = 0.999), and on the GPU float32 exp and log are
        # approximate, which left 1 - beta2**step 1e-4 off at step 1 on an H200. 1 - beta and
        # log(beta) are taken on the host in float64 and reach the kernel rounded once to float32
        # (Triton passes numbers so): 1 - float32(0.999) instead is 1.3e-5 off.
        s = step.to(tl.float64)
        bias1 = 1.0 - tl.exp(s * log_beta1)  # float64 tensor x float32 scalar: float64
        bias2 = 1.0 - tl.exp(s * log_beta2)
        return (lr.to(tl.float64) / bias1).to(tl.float32), tl.sqrt(bias2).to(tl.float32)

    @triton.jit
    def _adam_kernel(param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr,
                     lr_ptr, step_ptr, scale_ptr, found_inf_ptr,
                     n, beta1, beta2, one_minus_beta1, one_minus_beta2, log_beta1, log_beta2, eps, weight_decay,
                     DECOUPLED: tl.constexpr, WRITE_GRAD: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)  # 64-bit offsets: buckets may pass 2**31 elements
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        found_inf = tl.load(found_inf_ptr)
        # a step with inf/nan gradients touches nothing: no element is in bounds
        mask = offs < tl.where(found_inf == 0, n, 0)
        lr = tl.load(lr_ptr)
        step = tl.load(step_ptr)
        scale = tl.load(scale_ptr)

        p = tl.load(param_ptr + offs, mask=mask).to(tl.float32)
        g = tl.load(grad_ptr + offs, mask=mask).to(tl.float32) * scale
        m = tl.load(exp_avg_ptr + offs, mask=mask).to(tl.float32)
        v = tl.load(exp_avg_sq_ptr + offs, mask=mask).to(tl.float32)
        if WRITE_GRAD:  # the unscaled, clipped gradient, before Adam's L2 term joins it
            tl.store(grad_ptr + offs, g.to(grad_ptr.dtype.element_ty), mask=mask)

        if DECOUPLED:  # AdamW: decay the weights themselves
            p = p * (1.0 - lr * weight_decay)
        else:  # Adam: L2 penalty folded into the gradient
            g = g + weight_decay * p
        m = beta1 * m + one_minus_beta1 * g
        v = beta2 * v + one_minus_beta2 * g * g
        step_size, bias2_sqrt = _bias_corrections(lr, step, log_beta1, log_beta2)
        denom = tl.sqrt(v) / bias2_sqrt + eps
        p = p - step_size * m / denom

        tl.store(param_ptr + offs, p.to(param_ptr.dtype.element_ty), mask=mask)
        tl.store(exp_avg_ptr + offs, m.to(exp_avg_ptr.dtype.element_ty), mask=mask)
        tl.store(exp_avg_sq_ptr + offs, v.to(exp_avg_sq_ptr.dtype.element_ty), mask=mask)


def _log(beta: float) -> float:
    """log(beta) for the kernel's beta**step = exp(step * log(beta)); beta = 0 (no momentum) gives
    -inf, so that beta**step is 0, as torch computes it."""
    return math.log(beta) if beta > 0 else -math.inf


def adam_step(param, grad, exp_avg, exp_avg_sq, *, lr, step, scale, found_inf, beta1, beta2, eps,
              weight_decay, decoupled, write_grad: bool = True, force_triton: bool | None = None,
              block: int = BLOCK, num_warps: int = 4) -> None:
    """Update ``param``, ``exp_avg``, ``exp_avg_sq`` (flat, same length) in place, and leave
    ``grad`` multiplied by ``scale``.

    Args:
        lr, step, scale, found_inf: 1-element tensors on the buffers' device, float32 (float64
            for float64 parameters); ``step`` already counts this step.
        decoupled: True for AdamW's weight decay, False for Adam's L2 penalty.
        write_grad: leave ``grad`` multiplied by ``scale``; False leaves it as it is (the
            caller's choice, or it knows ``scale`` is 1, where the write would change nothing).
            torch's fused CPU kernel writes it whichever is asked, in the same pass.
        force_triton: None picks Triton on CUDA, torch's fused CPU kernel on the CPU (else the
            reference); True forces the Triton kernel (tests run it on CPU tensors with
            TRITON_INTERPRET=1), False the reference.
        block, num_warps: the Triton kernel's launch shape: elements per program (a power of 2)
            and warps per program (benchmarks/adam_kernel_sweep.py times others on a GPU).
    """
    n = check_buffers("adam_step", dict(param=param, grad=grad, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq),
                      dict(lr=lr, step=step, scale=scale, found_inf=found_inf))
    if not use_triton(param.device, force_triton, param.dtype):
        fused = "_fused_adamw_" if decoupled else "_fused_adam_"
        if force_triton is None and torch_fused_cpu(param.device, fused, param.dtype):
            # torch's kernel divides by grad_scale (and writes the unscaled gradient back)
            getattr(torch, fused)([param], [grad], [exp_avg], [exp_avg_sq], [], [step], lr=float(lr),
                                  beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps, amsgrad=False,
                                  maximize=False, grad_scale=scale.reciprocal(), found_inf=found_inf)
            return
        adam_reference(param, grad, exp_avg, exp_avg_sq, lr=lr, step=step, scale=scale, found_inf=found_inf,
                       beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, decoupled=decoupled,
                       write_grad=write_grad)
        return
    if triton is None:
        raise ImportError("adam_step: Triton is not installed; pip install triton")
    if n == 0:
        return
    beta1, beta2 = float(beta1), float(beta2)  # torch.optim takes tensor betas too; Triton wants numbers
    grid = (triton.cdiv(n, block),)
    _adam_kernel[grid](param, grad, exp_avg, exp_avg_sq, lr, step, scale, found_inf,
                       n, beta1, beta2, 1.0 - beta1, 1.0 - beta2, _log(beta1), _log(beta2),
                       float(eps), float(weight_decay),
                       DECOUPLED=bool(decoupled), WRITE_GRAD=bool(write_grad), BLOCK=block, num_warps=num_warps)


def adam_reference(param, grad, exp_avg, exp_avg_sq, *, lr, step, scale, found_inf, beta1, beta2, eps,
                   weight_decay, decoupled, write_grad: bool = True) -> None:
    """The same update in plain torch ops (the CPU path and the kernel's oracle).

    Reads grad, param, exp_avg, exp_avg_sq once each in the math below, but torch runs each op
    as its own pass, so it moves several times the kernel's 28 bytes per parameter.
    """
    skip = skipped_on_host(found_inf)
    if skip:
        return
    keep = None if skip is not None else found_inf == 0  # masks the writes on an accelerator
    compute = arithmetic_dtype(param.dtype)
    g = grad.to(compute) * scale
    writes = [(grad, g)] if write_grad else []  # the unscaled, clipped gradient, before the L2 term
    p = param.to(compute)
    if decoupled:
        p = p * (1.0 - lr * weight_decay)
    else:
        g = g + weight_decay * p
    m = exp_avg.to(compute).lerp(g, 1.0 - beta1) if beta1 != 1.0 else exp_avg.to(compute)
    v = exp_avg_sq.to(compute) * beta2 + (1.0 - beta2) * g * g
    # the bias corrections in float64, as the kernel takes them (and torch's fused AdamW)
    steps = step.to(torch.float64)
    step_size = (lr.to(torch.float64) / (1.0 - beta1 ** steps)).to(compute)
    bias2_sqrt = (1.0 - beta2 ** steps).sqrt().to(compute)
    p = p - step_size * m / (v.sqrt() / bias2_sqrt + eps)
    for dst, src in (*writes, (param, p), (exp_avg, m), (exp_avg_sq, v)):
        dst.copy_(src if keep is None else torch.where(keep, src, dst.to(compute)))
