"""Programs of test_multinode.py: collectives between simulated hosts.

Each program runs on every rank of a test job (see harness.py) and returns what it observed."""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist

import smddp_lite

from .rank_helpers import bytes_sent


def link_bytes(cases: list[dict], numel: int = 1 << 20, calls: int = 4) -> list[dict]:
    """Each case of ``cases`` in turn, in one group: ``calls`` reduce_scatter_tensor (``op``
    "reduce_scatter"), all_gather_into_tensor ("all_gather") or all_reduce ("all_reduce") calls on
    a message of ``numel`` elements of the case's ``dtype`` (the reduce_scatter's input, the
    all_gather's output), of small integers, exact in every dtype; ``redop`` "avg" averages (the
    means are exact too). Returns, per case, the bytes this rank's host sent on its link per call,
    over the message's bytes, and whether every result was exact."""
    smddp_lite.init()
    reports = [_link_bytes_of(numel=numel, calls=calls, **case) for case in cases]
    dist.destroy_process_group()
    return reports


def _link_bytes_of(op: str, dtype: str, numel: int, calls: int, redop: str = "sum") -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    wanted, block = getattr(torch, dtype), numel // world
    pattern = torch.arange(numel, dtype=torch.int64).remainder_(7)
    if op == "all_reduce":
        inp, out = (pattern + rank).to(wanted), torch.empty(numel, dtype=wanted)
        want = pattern * world + sum(range(world))
        if redop == "avg":
            want = want / world
        reduce_op = dist.ReduceOp.AVG if redop == "avg" else dist.ReduceOp.SUM

        def run() -> None:
            out.copy_(inp)
            dist.all_reduce(out, op=reduce_op)
    elif op == "reduce_scatter":
        inp, out = (pattern + rank).to(wanted), torch.empty(block, dtype=wanted)
        want = pattern[rank * block : (rank + 1) * block] * world + sum(range(world))
        if redop == "avg":
            want = want / world
        reduce_op = dist.ReduceOp.AVG if redop == "avg" else dist.ReduceOp.SUM
        run = lambda: dist.reduce_scatter_tensor(out, inp, op=reduce_op)  # noqa: E731
    else:
        inp, out = (pattern[rank * block : (rank + 1) * block]).to(wanted), torch.empty(numel, dtype=wanted)
        want = pattern
        run = lambda: dist.all_gather_into_tensor(out, inp)  # noqa: E731
    run()  # warm-up: connections (and a new dtype's buffers) made before counting
    exact = bool((out.double() == want.double()).all())
    # The counter is the host's, shared by its ranks: each reading sits between two barriers, so
    # that no rank of the host sends a call's bytes before, or after, another rank reads it.
    dist.barrier()
    before = bytes_sent()
    dist.barrier()
    for _ in range(calls):
        out.zero_()
        run()
        exact = exact and bool((out.double() == want.double()).all())
    dist.barrier()  # every call's bytes have left every host (each peer has received them)
    sent = bytes_sent() - before  # three barriers add a few hundred bytes, acknowledgements under 1%
    dist.barrier()
    return {"op": op, "dtype": dtype, "redop": redop,
            "sent_per_message_byte": sent / calls / (numel * torch.tensor([], dtype=wanted).element_size()),
            "exact": exact}


def broadcasts_from_every_root(numels: list[int], dtype: str = "float32", late_s: float = 0.0) -> dict:
    """A broadcast of each size in ``numels`` from every rank (the root's values depend on the
    root; the others pass garbage): the calls whose result was not the root's tensor. The root
    enters its largest broadcast ``late_s`` late: the others wait that long for its data."""
    smddp_lite.init(timeout=timedelta(seconds=60))
    rank, world, kind = dist.get_rank(), dist.get_world_size(), getattr(torch, dtype)
    wrong = []
    for root in range(world):
        for numel in numels:
            want = (torch.arange(numel, dtype=torch.float64) * (root + 1) % 251).to(kind)
            t = want.clone() if rank == root else torch.full((numel,), -7.0, dtype=kind)
            if rank == root and numel == max(numels):
                time.sleep(late_s)
            dist.broadcast(t, src=root)
            if not torch.equal(t, want):
                wrong.append(f"root {root}, {numel} elements")
    dist.destroy_process_group()
    return {"wrong": wrong}


def routes_under_auto() -> dict:
    """Calls on simulated hosts under SMDDP_ALGORITHM=auto: which path each took (rank 0's
    SMDDP_DEBUG log), a count summed in float32 (exact in float32, not in bfloat16), and a small
    and a large broadcast from the last rank (on the second host, not its first rank)."""
    import logging

    smddp_lite.init()
    rank, world = dist.get_rank(), dist.get_world_size()
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("smddp_lite").addHandler(handler)
    count = torch.tensor([1000.0 + rank + 0.5])  # 4 ranks: 4008.0, which bfloat16 rounds
    dist.all_reduce(count)
    gathered = torch.empty(world * 3)
    dist.all_gather_into_tensor(gathered, torch.full((3,), float(rank)))
    halves = torch.ones(64, dtype=torch.bfloat16)
    dist.all_reduce(halves)
    sent = {n: torch.arange(n, dtype=torch.float32) * (world - 1) for n in (64, 65537)}  # 65537: parts of 2 uneven
    broadcasts = {n: sent[n].clone() if rank == world - 1 else torch.zeros(n) for n in sent}
    for received in broadcasts.values():
        dist.broadcast(received, src=world - 1)
    logging.getLogger("smddp_lite").removeHandler(handler)
    dist.destroy_process_group()
    return {"routes": [s for s in said if " runs " in s], "count": count.item(),
            "gathered": gathered.tolist(), "halves": halves.float().unique().tolist(),
            "broadcasts_arrived": [torch.equal(broadcasts[n], sent[n]) for n in sent]}
