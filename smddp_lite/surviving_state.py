"""The job's state, sent by one member to each replacement only, peer to peer, as one flat
tensor per dtype.

What a replacement needs to train the next step as the others do: the parameters and buffers,
the optimizer's state and SurvivingSync's own counters. The tensors travel as one flat tensor per
(dtype, place) with ``send``/``recv``, so the survivors, which hold all of it already, take part
in nothing, and a 1 GB model with its AdamW state moves at the transport's bandwidth rather than
as hundreds of small calls. The rest (the optimizer's ``state_dict`` with each tensor replaced by
its place in the flats, the step, the sampler's state) is a small pickle sent first.
"""

from __future__ import annotations

import io
import math
import pickle
from typing import Any, NamedTuple

import torch
import torch.distributed as dist


class _Slot(NamedTuple):
    """Where a tensor of the optimizer's state lies: its flat, offset, shape, and whether it
    lived on the CPU (Adam's step counts do) rather than with the parameters. Sent as a plain
    tuple."""

    flat: int
    at: int
    shape: tuple[int, ...]
    on_cpu: bool


class _PlainUnpickler(pickle.Unpickler):
    """Reads only plain data (numbers, strings, lists, tuples, dicts): the header names no class
    or function, so one that does was not written by ``send`` and is refused, never imported."""

    def find_class(self, module: str, name: str) -> None:
        raise pickle.UnpicklingError(
            f"SurvivingSync: the job's state header names {module}.{name}; it carries plain data only. The "
            "sender is not a SurvivingSync of this version: run one version of smddp-lite in a job.")


def _layout(tensors: list[torch.Tensor]) -> tuple[list[torch.dtype], list[int], list[tuple[int, int]]]:
    """One flat per dtype, in the order the dtypes first appear: the flats' dtypes and sizes, and
    each tensor's (flat index, offset)."""
    order: dict[torch.dtype, int] = {}
    sizes: list[int] = []
    where = []
    for t in tensors:
        i = order.setdefault(t.dtype, len(order))
        if i == len(sizes):
            sizes.append(0)
        where.append((i, sizes[i]))
        sizes[i] += t.numel()
    return list(order), sizes, where


def _flats_of(tensors: list[torch.Tensor], device: torch.device) -> tuple[list[torch.Tensor], list[tuple]]:
    """``tensors`` packed into one flat per dtype on ``device``, and each one's place."""
    dtypes, sizes, where = _layout(tensors)
    flats = [torch.empty(n, dtype=d, device=device) for d, n in zip(dtypes, sizes)]
    for t, (i, at) in zip(tensors, where):
        flats[i][at:at + t.numel()].copy_(t.detach().reshape(-1))
    return flats, where


def _replace_tensors(value: Any, found: list[torch.Tensor]) -> Any:
    """``value`` with each tensor replaced by its index in ``found`` (appended to it)."""
    if isinstance(value, torch.Tensor):
        found.append(value)
        return ("__smddp_tensor__", len(found) - 1)
    if isinstance(value, dict):
        return {k: _replace_tensors(v, found) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_replace_tensors(v, found) for v in value)
    return value


def _restore_tensors(value: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(value, tuple) and len(value) == 2 and value[0] == "__smddp_tensor__":
        return tensors[value[1]]
    if isinstance(value, dict):
        return {k: _restore_tensors(v, tensors) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_restore_tensors(v, tensors) for v in value)
    return value


def send(to: list[int], model_tensors: list[torch.Tensor], optimizer: torch.optim.Optimizer | None,
         extras: dict) -> None:
    """Send the state to each rank of ``to`` (ranks of the current group)."""
    device = model_tensors[0].device
    optimizer_tensors: list[torch.Tensor] = []
    optimizer_state = _replace_tensors(optimizer.state_dict(), optimizer_tensors) if optimizer is not None else None
    flats, where = _flats_of(model_tensors + optimizer_tensors, device)
    slots = [tuple(_Slot(i, at, tuple(t.shape), t.device.type == "cpu"))
             for t, (i, at) in zip(optimizer_tensors, where[len(model_tensors):])]
    header = pickle.dumps({"extras": extras, "optimizer": optimizer_state, "slots": slots,
                           "flats": [(str(f.dtype).removeprefix("torch."), f.numel()) for f in flats]})
    header_bytes = torch.frombuffer(bytearray(header), dtype=torch.uint8).to(device)
    size = torch.tensor([header_bytes.numel()], dtype=torch.int64, device=device)
    for rank in to:
        dist.send(size, rank)
        dist.send(header_bytes, rank)
        for flat in flats:
            dist.send(flat, rank)


def receive(src: int, model_tensors: list[torch.Tensor], optimizer: torch.optim.Optimizer | None) -> dict:
    """Receive the state from ``src``: write it into ``model_tensors`` and ``optimizer``; returns
    the extras."""
    device = model_tensors[0].device
    size = torch.zeros(1, dtype=torch.int64, device=device)
    dist.recv(size, src)
    header_bytes = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.recv(header_bytes, src)
    header = _PlainUnpickler(io.BytesIO(header_bytes.cpu().numpy().tobytes())).load()
    flats = [torch.empty(n, dtype=_dtype(name), device=device) for name, n in header["flats"]]
    for flat in flats:
        dist.recv(flat, src)
    where = _layout(model_tensors)[2]
    with torch.no_grad():
        for t, (i, at) in zip(model_tensors, where):
            t.copy_(flats[i][at:at + t.numel()].view_as(t))
    if optimizer is not None and header["optimizer"] is not None:
        slots = [_Slot(*slot) for slot in header["slots"]]
        tensors = [flats[s.flat][s.at:s.at + math.prod(s.shape)].view(s.shape).clone() for s in slots]
        tensors = [t.cpu() if s.on_cpu else t for t, s in zip(tensors, slots)]
        optimizer.load_state_dict(_restore_tensors(header["optimizer"], tensors))
    return header["extras"]


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"SurvivingSync: the job's state header names dtype {name!r}, which this torch does not have")
    return dtype
