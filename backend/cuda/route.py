"""Which way a call on CUDA tensors goes, decided before it runs: NCCL where the group has it and
its table (support.py) holds the call, else through host memory (staged.py).

The process group's router asks ``cuda_device`` on every call (CPU calls pass straight on) and
``staging_reason`` once per CUDA call, from the call's arguments as c10d passes them. Nothing is
numbered, checked or enqueued before the answer, so the staged route runs the call from its
start, under the number it would have had on NCCL.
"""

from __future__ import annotations

import torch

from .. import numerics
from ..ops import RedOp
from .support import REDUCES, NCCL_FORMS, NcclSupport


def cuda_device(args: tuple) -> tuple[torch.device | None, list[torch.Tensor]]:
    """The CUDA device of the call's tensors (None for CPU calls) and the tensors. Tensors on
    several devices are refused: a collective runs on one. (Plain loops: this runs on every
    call, CPU ones too.)"""
    tensors = []
    for a in args:  # c10d passes tensors, lists of them, or lists of lists (allgather's outputs)
        if isinstance(a, torch.Tensor):
            tensors.append(a)
        elif isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, torch.Tensor):
                    tensors.append(b)
                elif isinstance(b, (list, tuple)):
                    tensors.extend(b)
    for t in tensors:
        if t.is_cuda:
            break
    else:
        return None, tensors
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        found = ", ".join(sorted(str(d) for d in devices))
        raise ValueError(f"tensors are on several devices ({found}); a collective takes tensors on one "
                         "device: move them with .to(device) first")
    return devices.pop(), tensors


def gathers_unevenly(outputs, inputs) -> bool:
    """An all_gather whose outputs differ in size from the input (NCCL allows them; gloo does
    not): the CPU path carries it as an uneven all_to_all, which checks the sizes across ranks,
    and NCCL's all_gather takes equal blocks only, so on CUDA it goes through host memory."""
    inputs = [inputs] if isinstance(inputs, torch.Tensor) else list(inputs) if isinstance(inputs, (list, tuple)) else []
    return bool(inputs) and isinstance(inputs[0], torch.Tensor) and any(
        isinstance(out, torch.Tensor) and out.numel() != inputs[0].numel() for out in outputs)


def staging_reason(support: NcclSupport | None, op: str, args: tuple, kwargs: dict,
                   tensors: list[torch.Tensor]) -> str | None:
    """Why the call ``op(*args, **kwargs)`` on CUDA ``tensors`` goes through host memory, or
    None where NCCL runs it. Arguments the call itself will refuse (an unreadable reduce op)
    go to NCCL: the call's checks refuse them there before anything is enqueued."""
    if support is None:
        return "NCCL is not in use"
    red = None
    if NCCL_FORMS.get(op) is REDUCES:
        try:
            red = _reduce_op(args, kwargs)
        except (TypeError, ValueError, AttributeError):
            return None
    elif op == "all_gather" and gathers_unevenly(_inner_list(_arg(args, kwargs, 0, "output_tensors")),
                                                 _arg(args, kwargs, 1, "input_tensors")):
        return "all_gather: outputs of different sizes"
    return support.staging_reason(op, {_reduced_dtype(t.dtype) for t in tensors}, red)


def _reduce_op(args: tuple, kwargs: dict) -> RedOp:
    """The op a reducing call reduces with, from its options (the last positional argument or
    ``opts``; torch's defaults are SUM). A PREMUL_SUM reaches NCCL as the SUM of premultiplied
    inputs."""
    opts = kwargs.get("opts")
    if opts is None:
        opts = next((a for a in args if hasattr(a, "reduceOp")), None)
    if opts is None:
        return RedOp.SUM
    return numerics.reduction(opts.reduceOp)[0]


def _reduced_dtype(dtype: torch.dtype) -> torch.dtype:
    """Complex tensors are reduced as their real views (numerics.complex_as_real)."""
    return dtype.to_real() if dtype.is_complex else dtype


def _arg(args: tuple, kwargs: dict, index: int, name: str):
    return args[index] if len(args) > index else kwargs.get(name)


def _inner_list(tensor_lists) -> list:
    """The one list of ``[[t0, t1, ...]]`` (c10d's list-of-lists form), or the list itself; []
    for anything else, which the call's own checks then refuse."""
    if not isinstance(tensor_lists, (list, tuple)):
        return []
    if tensor_lists and isinstance(tensor_lists[0], (list, tuple)):
        return list(tensor_lists[0])
    return list(tensor_lists)

