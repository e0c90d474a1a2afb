"""What every launcher shares: when to use Triton, block size, argument checks."""

from __future__ import annotations

import torch

BLOCK = 2048  # elements per program: 8 KiB of each fp32 stream, enough to hide load latency


def arithmetic_dtype(dtype: torch.dtype) -> torch.dtype:
    """What an update of ``dtype`` parameters computes in, and the dtype of its scalars: float32,
    or float64 for float64 parameters (a float32 learning rate alone is 2e-8 off)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def use_triton(device: torch.device, force: bool | None, dtype: torch.dtype) -> bool:
    """Triton for CUDA tensors; on the CPU only when asked (tests, under TRITON_INTERPRET=1).

    float64 parameters take the reference: the kernels compute in float32, and Triton passes
    Python floats (betas, eps, weight decay) as float32 arguments."""
    if force is not None:
        if force and dtype == torch.float64:
            raise ValueError("the Triton kernels compute in float32; float64 parameters take the reference "
                             "(pass force_triton=None or False)")
        return force
    return device.type == "cuda" and dtype != torch.float64


# torch's fused CPU SGD leaves 16-bit parameters unchanged but for the last few elements
# (torch 2.13: every vectorised chunk is skipped, with or without momentum); its fused Adam and
# AdamW update them. Such updates take the reference instead.
_BROKEN_FUSED_CPU = {"_fused_sgd_": (torch.bfloat16, torch.float16)}


def torch_fused_cpu(device: torch.device, op: str, dtype: torch.dtype) -> bool:
    """Whether torch's own fused CPU kernel ``op`` (torch._fused_adamw_ ...) serves this update
    of ``dtype`` parameters.

    It does the same arithmetic in one pass over memory, where the pure-torch reference makes
    one pass per operation: on a 2-core CPU the reference ran at 0.17-0.28x of torch's fused
    AdamW (benchmarks/optimizer_step.py), so the reference stays the oracle and the fallback.
    """
    # float64 takes the reference: torch's kernels take grad_scale (our unscale and clipping
    # coefficient) only as float32
    return (device.type == "cpu" and hasattr(torch, op) and dtype != torch.float64
            and dtype not in _BROKEN_FUSED_CPU.get(op, ()))


def check_buffers(name: str, flat: dict[str, torch.Tensor], scalars: dict[str, torch.Tensor]) -> int:
    """All streams flat, contiguous, equally long, on one device; scalars 1-element tensors of
    the update's arithmetic dtype (float32, or float64 for float64 parameters)."""
    first = next(iter(flat.values()))
    for key, t in flat.items():
        if t.dim() != 1 or not t.is_contiguous() or t.numel() != first.numel() or t.device != first.device:
            raise ValueError(
                f"{name}: {key} must be a flat contiguous tensor of {first.numel()} elements on {first.device}; "
                f"found shape {tuple(t.shape)} on {t.device} (contiguous={t.is_contiguous()})"
            )
    want = arithmetic_dtype(first.dtype)
    for key, t in scalars.items():
        if t.numel() != 1 or t.dtype != want or t.device != first.device:
            raise ValueError(
                f"{name}: {key} must be a 1-element {str(want).replace('torch.', '')} tensor on {first.device} "
                f"for {str(first.dtype).replace('torch.', '')} parameters; found "
                f"{t.numel()} elements of {t.dtype} on {t.device}"
            )
    return first.numel()


def skipped_on_host(found_inf: torch.Tensor) -> bool | None:
    """On the CPU reading found_inf costs nothing, so the reference can return early; on an
    accelerator that would be a host sync, so the caller masks instead (returns None)."""
    if found_inf.device.type == "cpu":
        return bool(found_inf.item())
    return None
