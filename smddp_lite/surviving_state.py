"""The job's state, sent by one member to each replacement only, peer to peer, as one stream of
bytes in chunks.

What a replacement needs to train the next step as the others do: the parameters and buffers,
the optimizer's state and SurvivingSync's own counters. The survivors, which hold all of it
already, take part in nothing. The tensors' bytes travel in order, in chunks of CHUNK_BYTES
through two staging buffers on each side: the sender packs the next chunk while the last one is
on the wire, and the receiver writes each chunk straight into the tensors it belongs to
(its own parameters, the optimizer state it allocates once) while the next one arrives. No
copy of the whole state is made on either side, and a 1 GB model with its AdamW state moves at
close to the transport's bandwidth rather than as hundreds of small calls or a packing pass.
The rest (the optimizer's ``state_dict`` with each tensor replaced by its place in the
stream, the step, the sampler's state) is a small pickle sent first.
"""

from __future__ import annotations

import bisect
import io
import pickle
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

CHUNK_BYTES = 32 << 20  # large enough that a call's overhead is nothing, small enough to pipeline


class _Slot(NamedTuple):
    """One tensor of the optimizer's state: its dtype's name, shape, and whether it lived on the
    CPU (Adam's step counts do) rather than with the parameters. Sent as a plain tuple."""

    dtype: str
    shape: tuple[int, ...]
    on_cpu: bool


class _PlainUnpickler(pickle.Unpickler):
    """Reads only plain data (numbers, strings, lists, tuples, dicts): the header names no class
    or function, so one that does was not written by ``send`` and is refused, never imported."""

    def find_class(self, module: str, name: str) -> None:
        raise pickle.UnpicklingError(
            f"SurvivingSync: the job's state header names {module}.{name}; it carries plain data only. The "
            "sender is not a SurvivingSync of this version: run one version of smddp-lite in a job.")


class _Stream:
    """Tensors seen as one run of bytes, in order: chunks of it are packed from (or unpacked
    into) the tensors in place. Each tensor must be contiguous."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.views = [t.detach().view(-1).view(torch.uint8) for t in tensors]
        self.begins = []
        self.bytes = 0
        for v in self.views:
            self.begins.append(self.bytes)
            self.bytes += v.numel()

    def chunks(self, size: int) -> list[tuple[int, int]]:
        return [(at, min(at + size, self.bytes)) for at in range(0, self.bytes, size)]

    def _pieces(self, start: int, end: int):
        """(tensor's bytes, within the chunk) pairs that together cover bytes [start, end)."""
        i = bisect.bisect_right(self.begins, start) - 1
        while i < len(self.views) and self.begins[i] < end:
            begin, view = self.begins[i], self.views[i]
            lo, hi = max(start, begin), min(end, begin + view.numel())
            if hi > lo:
                yield view[lo - begin:hi - begin], slice(lo - start, hi - start)
            i += 1

    def pack(self, start: int, end: int, into: torch.Tensor) -> None:
        for part, where in self._pieces(start, end):
            into[where].copy_(part)

    def unpack(self, start: int, end: int, chunk: torch.Tensor) -> None:
        for part, where in self._pieces(start, end):
            part.copy_(chunk[where])


def _staging(stream: _Stream, chunk_bytes: int, device: torch.device) -> list[torch.Tensor]:
    return [torch.empty(min(chunk_bytes, stream.bytes), dtype=torch.uint8, device=device) for _ in range(2)]


def _contiguous(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t if t.is_contiguous() else t.contiguous() for t in tensors]


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
    slots = [tuple(_Slot(_name(t.dtype), tuple(t.shape), t.device.type == "cpu")) for t in optimizer_tensors]
    # the few CPU tensors (step counts) travel with the parameters' device
    stream = _Stream(_contiguous(model_tensors) + [t.to(device) for t in _contiguous(optimizer_tensors)])
    chunk_bytes = CHUNK_BYTES
    header = pickle.dumps({"extras": extras, "optimizer": optimizer_state, "slots": slots, "bytes": stream.bytes,
                           "chunk_bytes": chunk_bytes, "model": [(_name(t.dtype), t.numel()) for t in model_tensors]})
    header_bytes = torch.frombuffer(bytearray(header), dtype=torch.uint8).to(device)
    size = torch.tensor([header_bytes.numel()], dtype=torch.int64, device=device)
    for rank in to:
        dist.send(size, rank)
        dist.send(header_bytes, rank)
    staging, sent = _staging(stream, chunk_bytes, device), [[], []]
    for k, (start, end) in enumerate(stream.chunks(chunk_bytes)):
        for work in sent[k % 2]:  # that buffer's last chunk has left
            work.wait()
        chunk = staging[k % 2][:end - start]
        stream.pack(start, end, chunk)
        sent[k % 2] = [dist.isend(chunk, rank) for rank in to]
    for works in sent:
        for work in works:
            work.wait()


class Received(NamedTuple):
    """What ``receive`` took: the sender's extras, and the bytes that came (header and state)."""

    extras: dict
    bytes: int


def receive(src: int, model_tensors: list[torch.Tensor], optimizer: torch.optim.Optimizer | None) -> Received:
    """Receive the state from ``src``: write it into ``model_tensors`` and ``optimizer``."""
    device = model_tensors[0].device
    size = torch.zeros(1, dtype=torch.int64, device=device)
    dist.recv(size, src)
    header_bytes = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.recv(header_bytes, src)
    header = _PlainUnpickler(io.BytesIO(header_bytes.cpu().numpy().tobytes())).load()
    ours = [(_name(t.dtype), t.numel()) for t in model_tensors]
    if [tuple(m) for m in header["model"]] != ours:
        raise ValueError(
            f"SurvivingSync: the job's model is {_said(header['model'])}, this replacement's is {_said(ours)}: a "
            "replacement must build the same model (the same parameters and buffers, in the same order) as the "
            "job's ranks")
    slots = [_Slot(*slot) for slot in header["slots"]]
    on_device = [torch.empty(s.shape, dtype=_dtype(s.dtype), device=device) for s in slots]
    targets = [t if t.is_contiguous() else torch.empty_like(t, memory_format=torch.contiguous_format)
               for t in model_tensors]
    stream = _Stream(targets + on_device)
    if stream.bytes != header["bytes"]:
        raise ValueError(f"SurvivingSync: the job's state is {header['bytes']} bytes, this replacement expected "
                         f"{stream.bytes}: run one version of smddp-lite in a job")
    chunks, staging = stream.chunks(header["chunk_bytes"]), _staging(stream, header["chunk_bytes"], device)
    arriving = [None, None]
    with torch.no_grad():
        if chunks:
            arriving[0] = dist.irecv(staging[0][:chunks[0][1] - chunks[0][0]], src)
        for k, (start, end) in enumerate(chunks):
            if k + 1 < len(chunks):  # the next chunk arrives while this one is unpacked
                after = chunks[k + 1]
                arriving[(k + 1) % 2] = dist.irecv(staging[(k + 1) % 2][:after[1] - after[0]], src)
            arriving[k % 2].wait()
            stream.unpack(start, end, staging[k % 2][:end - start])
        for t, target in zip(model_tensors, targets):
            if target is not t:
                t.copy_(target)
    if optimizer is not None and header["optimizer"] is not None:
        tensors = [t.cpu() if s.on_cpu else t for t, s in zip(on_device, slots)]
        optimizer.load_state_dict(_restore_tensors(header["optimizer"], tensors))
    return Received(header["extras"], 8 + header_bytes.numel() + stream.bytes)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _said(layout: list) -> str:
    total = sum(n for _, n in layout)
    return f"{len(layout)} tensors of {total} elements"


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"SurvivingSync: the job's state header names dtype {name!r}, which this torch does not have")
    return dtype
