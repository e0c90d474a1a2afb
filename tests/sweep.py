"""The acceptance sweep: every collective x every dtype torch has x every reduction x blocking or
async (and the in-place forms), run the same way on any backend.

Where conformance.py checks known-good calls for exact results, this asks the drop-in question:
does smddp accept every call that torch's own backends accept, with their result, and refuse only
what they refuse? ``run`` executes on each rank and returns {call id: outcome}; an outcome is
``["ok", digest of the outputs, verdict]`` or ``["raised", exception type, message, the built-in
types it is caught as]``. The verdict compares the outputs with the reference computed here
("right", "wrong: ..." or "no reference"). The reference for what gloo refuses and NCCL accepts
(AVG of integers, PREMUL_SUM) is NCCL's: integer AVG truncates toward zero; PREMUL_SUM multiplies
each input by the factor, then sums. A bool SUM is an "any", as NCCL's (MAX on bytes).

Inputs are small integers that every dtype (float8 included) holds exactly, and so do their sums
and products over 3 ranks: results do not depend on reduction order, and two backends that agree
give the same bytes. ``run(device="cuda")`` makes the same calls on CUDA tensors; outputs are
digested and judged on the host, so a CUDA sweep compares with a CPU one byte for byte.
"""

from __future__ import annotations

import hashlib
from typing import Callable, Iterator

import torch
import torch.distributed as dist

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
          torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.uint16, torch.uint32,
          torch.uint64, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2]
OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "product": dist.ReduceOp.PRODUCT,
       "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX, "band": dist.ReduceOp.BAND,
       "bor": dist.ReduceOp.BOR, "bxor": dist.ReduceOp.BXOR, "premul_sum": None}
PREMUL_FACTOR = 2.0
BLOCK = 4  # elements per rank's block in the ops that split a tensor by rank


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _make(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int64 values as ``dtype``; complex numbers get them as both parts."""
    if dtype is torch.bool:
        return values != 0
    if dtype.is_complex:
        return torch.complex(values.double(), values.double()).to(dtype)
    if dtype in (torch.uint16, torch.uint32, torch.uint64):  # torch casts into these from few dtypes
        return values.to(torch.int64).to(dtype)
    return values.to(dtype)


def reduce_input(numel: int, rank: int, dtype: torch.dtype) -> torch.Tensor:
    """1 or 2 (True or False for bool), differently patterned per rank so that every pair occurs:
    sums <= 6 and products <= 8 over 3 ranks, exact in every dtype."""
    i = torch.arange(numel)
    return _make((i // (rank + 1)) % 2 + (0 if dtype is torch.bool else 1), dtype)


def moving_input(numel: int, rank: int, dtype: torch.dtype) -> torch.Tensor:
    """0..7, different per rank and element, so a misplaced block shows."""
    return _make((torch.arange(numel) + 5 * rank) % 8, dtype)


def _reduced(op: str, dtype: torch.dtype, inputs: list[torch.Tensor]) -> torch.Tensor | None:
    """The reduction as torch's backends define it (NCCL's for AVG of integers and PREMUL_SUM), or
    None where no backend defines it (so any refusal is right)."""
    world = len(inputs)
    if dtype is torch.bool:
        stacked = torch.stack(inputs)
        defined = {"sum": stacked.any(0), "max": stacked.any(0), "bor": stacked.any(0),
                   "min": stacked.all(0), "product": stacked.all(0), "band": stacked.all(0),
                   "bxor": stacked.sum(0) % 2 == 1}
        return defined.get(op)
    if dtype.is_complex:  # torch splits complex tensors into real pairs for sum-like ops only
        if op not in ("sum", "avg", "premul_sum"):
            return None
        parts = _reduced(op, torch.float32 if dtype is torch.complex64 else torch.float64,
                         [torch.view_as_real(x) for x in inputs])  # a sum of complex numbers sums each part
        return torch.view_as_complex(parts)
    floating = dtype.is_floating_point
    wide = [x.to(torch.float64 if floating else torch.int64) for x in inputs]
    if op in ("band", "bor", "bxor"):
        if floating:
            return None
        combine = {"band": torch.bitwise_and, "bor": torch.bitwise_or, "bxor": torch.bitwise_xor}[op]
    else:
        combine = {"sum": torch.add, "avg": torch.add, "premul_sum": torch.add, "product": torch.mul,
                   "min": torch.minimum, "max": torch.maximum}[op]
    result = wide[0]
    for x in wide[1:]:
        result = combine(result, x)
    if op == "avg":
        result = result / world if floating else torch.div(result, world, rounding_mode="trunc")
    if op == "premul_sum":
        result = result * int(PREMUL_FACTOR)
    return _make(result, dtype) if not floating else result.to(dtype)


def _digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().cpu().contiguous()
        h.update(str(t.dtype).encode() + str(tuple(t.shape)).encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:16]


def _verdict(got: list[torch.Tensor], want: list[torch.Tensor] | None) -> str:
    if want is None:
        return "no reference"
    for k, (g, w) in enumerate(zip(got, want)):
        g = g.cpu()
        if g.shape != w.shape or g.dtype != w.dtype:
            return f"wrong: output {k} is {tuple(g.shape)} {g.dtype}, want {tuple(w.shape)} {w.dtype}"
        same = g.view(torch.uint8) == w.view(torch.uint8) if g.dtype.itemsize == 1 else g == w
        if not bool(same.all()):
            return f"wrong: output {k} is {g.tolist()}, want {w.tolist()}"
    return "right"


def _wait(work, async_op: bool) -> None:
    if async_op:
        work.wait()


def _redop(op: str, dtype: torch.dtype):
    if op == "premul_sum":
        return dist._make_nccl_premul_sum(PREMUL_FACTOR)
    return OPS[op]


# --- the calls: each runs on this rank, on ``device``, and returns (outputs, references or None);
# inputs are made on the CPU and moved, references stay there --------------------------------------

def call_all_reduce(rank, world, dtype, op, async_op, device):
    t = reduce_input(BLOCK * world, rank, dtype).to(device)
    _wait(dist.all_reduce(t, op=_redop(op, dtype), async_op=async_op), async_op)
    want = _reduced(op, dtype, [reduce_input(BLOCK * world, r, dtype) for r in range(world)])
    return [t], None if want is None else [want]


def call_reduce(rank, world, dtype, op, async_op, device):
    t = reduce_input(BLOCK * world, rank, dtype).to(device)
    root = world - 1
    _wait(dist.reduce(t, dst=root, op=_redop(op, dtype), async_op=async_op), async_op)
    if rank != root:
        return [], []  # other ranks' tensors are scratch, as torch documents
    want = _reduced(op, dtype, [reduce_input(BLOCK * world, r, dtype) for r in range(world)])
    return [t], None if want is None else [want]


def call_reduce_scatter(rank, world, dtype, op, async_op, device):
    inputs = list(reduce_input(BLOCK * world, rank, dtype).to(device).split(BLOCK))
    out = torch.empty(BLOCK, dtype=dtype, device=device)
    _wait(dist.reduce_scatter(out, inputs, op=_redop(op, dtype), async_op=async_op), async_op)
    want = _reduced(op, dtype, [reduce_input(BLOCK * world, r, dtype) for r in range(world)])
    return [out], None if want is None else [want[rank * BLOCK:(rank + 1) * BLOCK]]


def call_reduce_scatter_tensor(rank, world, dtype, op, async_op, device, in_place=False):
    src = reduce_input(BLOCK * world, rank, dtype).to(device)
    out = src[rank * BLOCK:(rank + 1) * BLOCK] if in_place else torch.empty(BLOCK, dtype=dtype, device=device)
    _wait(dist.reduce_scatter_tensor(out, src, op=_redop(op, dtype), async_op=async_op), async_op)
    want = _reduced(op, dtype, [reduce_input(BLOCK * world, r, dtype) for r in range(world)])
    return [out.clone()], None if want is None else [want[rank * BLOCK:(rank + 1) * BLOCK]]


def _everyone(world, dtype):
    return [moving_input(BLOCK, r, dtype) for r in range(world)]


def call_broadcast(rank, world, dtype, async_op, device):
    root = world - 1
    t = moving_input(BLOCK, rank, dtype).to(device)
    _wait(dist.broadcast(t, src=root, async_op=async_op), async_op)
    return [t], [moving_input(BLOCK, root, dtype)]


def call_all_gather(rank, world, dtype, async_op, device):
    outs = [torch.empty(BLOCK, dtype=dtype, device=device) for _ in range(world)]
    _wait(dist.all_gather(outs, moving_input(BLOCK, rank, dtype).to(device), async_op=async_op), async_op)
    return outs, _everyone(world, dtype)


def call_all_gather_into_tensor(rank, world, dtype, async_op, device, in_place=False):
    out = torch.empty(BLOCK * world, dtype=dtype, device=device)
    src = out[rank * BLOCK:(rank + 1) * BLOCK] if in_place else torch.empty(BLOCK, dtype=dtype, device=device)
    src.copy_(moving_input(BLOCK, rank, dtype))
    _wait(dist.all_gather_into_tensor(out, src, async_op=async_op), async_op)
    return [out], [torch.cat(_everyone(world, dtype))]


def call_gather(rank, world, dtype, async_op, device):
    root = world - 1
    outs = [torch.empty(BLOCK, dtype=dtype, device=device) for _ in range(world)] if rank == root else None
    _wait(dist.gather(moving_input(BLOCK, rank, dtype).to(device), outs, dst=root, async_op=async_op), async_op)
    return (outs, _everyone(world, dtype)) if rank == root else ([], [])


def call_scatter(rank, world, dtype, async_op, device):
    root = world - 1
    ins = [moving_input(BLOCK, r + 10 * root, dtype).to(device) for r in range(world)] if rank == root else None
    out = torch.empty(BLOCK, dtype=dtype, device=device)
    _wait(dist.scatter(out, ins, src=root, async_op=async_op), async_op)
    return [out], [moving_input(BLOCK, rank + 10 * root, dtype)]


def _a2a_block(sender: int, receiver: int, world: int, dtype) -> torch.Tensor:
    return moving_input(BLOCK * world, sender, dtype)[receiver * BLOCK:(receiver + 1) * BLOCK]


def call_all_to_all(rank, world, dtype, async_op, device):
    ins = [_a2a_block(rank, r, world, dtype).to(device, copy=True) for r in range(world)]
    outs = [torch.empty(BLOCK, dtype=dtype, device=device) for _ in range(world)]
    _wait(dist.all_to_all(outs, ins, async_op=async_op), async_op)
    return outs, [_a2a_block(r, rank, world, dtype) for r in range(world)]


def call_all_to_all_single(rank, world, dtype, async_op, device):
    out = torch.empty(BLOCK * world, dtype=dtype, device=device)
    _wait(dist.all_to_all_single(out, moving_input(BLOCK * world, rank, dtype).to(device), async_op=async_op),
          async_op)
    return [out], [torch.cat([_a2a_block(r, rank, world, dtype) for r in range(world)])]


REDUCING = {"all_reduce": call_all_reduce, "reduce": call_reduce, "reduce_scatter": call_reduce_scatter,
            "reduce_scatter_tensor": call_reduce_scatter_tensor}
MOVING = {"broadcast": call_broadcast, "all_gather": call_all_gather,
          "all_gather_into_tensor": call_all_gather_into_tensor, "gather": call_gather, "scatter": call_scatter,
          "all_to_all": call_all_to_all, "all_to_all_single": call_all_to_all_single}
IN_PLACE = {"reduce_scatter_tensor", "all_gather_into_tensor"}  # the forms whose input lies in the output


def calls() -> Iterator[tuple[str, Callable, dict]]:
    """(call id, function, kwargs) in the one order every rank issues them."""
    for dtype in DTYPES:
        for async_op in (False, True):
            mode = "async" if async_op else "blocking"
            for name, fn in REDUCING.items():
                for op in OPS:
                    kwargs = dict(dtype=dtype, op=op, async_op=async_op)
                    yield f"{name}/{op}/{_name(dtype)}/{mode}", fn, kwargs
                    if name in IN_PLACE:
                        yield f"{name}/{op}/{_name(dtype)}/{mode}/in_place", fn, dict(kwargs, in_place=True)
            for name, fn in MOVING.items():
                yield f"{name}/{_name(dtype)}/{mode}", fn, dict(dtype=dtype, async_op=async_op)
                if name in IN_PLACE:
                    yield f"{name}/{_name(dtype)}/{mode}/in_place", fn, dict(dtype=dtype, async_op=async_op,
                                                                            in_place=True)


def run(backend: str = "smddp", device: str = "cpu") -> dict[str, list]:
    """Worker entry: every call of ``calls`` on this rank, on tensors of ``device`` ("cpu", or
    "cuda": every rank on cuda:0, as one GPU's tests run); {call id: outcome}."""
    import smddp_lite

    if device == "cuda":
        torch.cuda.set_device(0)
        device = "cuda:0"
    smddp_lite.init(backend=backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    report = {}
    for call_id, fn, kwargs in calls():
        try:
            got, want = fn(rank=rank, world=world, device=torch.device(device), **kwargs)
            report[call_id] = ["ok", _digest(got), _verdict(got, want)]
        except Exception as exc:  # a refusal is an outcome to compare, not a failure of the sweep
            caught_as = [kind.__name__ for kind in (ValueError, RuntimeError, TypeError) if isinstance(exc, kind)]
            report[call_id] = ["raised", type(exc).__name__, str(exc).splitlines()[0][:300] if str(exc) else "",
                               caught_as]
    dist.destroy_process_group()
    return report
