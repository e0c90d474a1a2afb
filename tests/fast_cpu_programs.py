"""Programs of test_fast_cpu.py: small CPU all_reduces on the caller's thread (backend/fast_cpu.py).

Each program runs on every rank of a test job (see harness.py) and returns what it observed."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

import smddp_lite

from .rank_helpers import error_of, still_works

DTYPES = (torch.float32, torch.float64, torch.int64, torch.int32, torch.int8, torch.uint8)
OPS = ("SUM", "AVG", "PRODUCT", "MIN", "MAX")


def _took_fast_path() -> int:
    """How many calls the group's fast path has taken: its works are DoneWork."""
    from smddp_lite.backend.fast_cpu import DoneWork

    t = torch.ones(2)
    return int(type(dist.all_reduce(t, async_op=True)) is DoneWork)


def _inputs(dtype: torch.dtype, rank: int, numel: int) -> torch.Tensor:
    """Values that make sums, products and orders differ by rank, with an overflow for floats."""
    gen = torch.Generator().manual_seed(1000 + rank)
    if dtype.is_floating_point:
        t = torch.randn(numel, generator=gen, dtype=torch.float64).to(dtype)
        t[0] = torch.finfo(dtype).max  # the sum overflows to inf, as torch's own add does
        return t
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -100), min(info.max, 100), (numel,), generator=gen, dtype=torch.int64).to(dtype)


def same_bits_as_the_general_route(numels: list[int]) -> dict:
    """Every dtype and op of the fast path, against the same call taken by the general route (a
    non-contiguous view of the same values, which the fast path leaves to it). Which differed,
    whether the fast path ran, and whether numpy warned (torch does not)."""
    smddp_lite.init()
    rank = dist.get_rank()
    wrong = []
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        for numel in numels:
            for dtype in DTYPES:
                for name in OPS:
                    if name == "AVG" and not dtype.is_floating_point:
                        continue
                    op = getattr(dist.ReduceOp, name)
                    fast = _inputs(dtype, rank, numel)
                    if numel % 4 == 0:  # a tensor of several dimensions (a complex one's real view is one)
                        fast = fast.view(-1, 2, 2)
                    general = torch.empty(2 * numel, dtype=dtype)[::2].view_as(fast) if fast.dim() == 1 else \
                        torch.empty(fast.shape + (2,), dtype=dtype)[..., 0]  # strided: the general route
                    general.copy_(fast)
                    dist.all_reduce(fast, op=op)
                    dist.all_reduce(general, op=op)
                    same = torch.equal(fast, general) or (  # NaN (inf - inf) is no NaN's equal
                        dtype.is_floating_point and torch.equal(fast.nan_to_num(), general.nan_to_num()))
                    if not same:
                        wrong.append(f"{numel} x {dtype} {name}: {fast.tolist()[:4]} != {general.tolist()[:4]}")
        # a parameter (a leaf that requires grad), all-reduced by hand: outside autograd, as on the general route
        p = torch.nn.Parameter(torch.full((3,), float(rank)))
        dist.all_reduce(p, op=dist.ReduceOp.AVG)
        if p.tolist() != [sum(range(dist.get_world_size())) / dist.get_world_size()] * 3:
            wrong.append(f"parameter AVG: {p.tolist()}")
    return {"wrong": wrong, "fast": _took_fast_path(), "warnings": [str(w.message) for w in warned]}


def pairs_with_a_peer_on_the_general_route() -> dict:
    """Rank 0's calls qualify and rank 1's (strided views) do not: they pair, call by call."""
    smddp_lite.init()
    rank = dist.get_rank()
    t = torch.full((4,), float(rank + 1)) if rank == 0 else torch.full((8,), float(rank + 1))[::2]
    dist.all_reduce(t)
    b = torch.full((4,), float(rank)) if rank == 0 else torch.full((8,), float(rank))[::2]
    dist.broadcast(b, src=0)
    source = torch.full((2,), float(rank + 1))
    gathered = torch.empty(4) if rank == 0 else torch.empty(8)[::2]
    dist.all_gather_into_tensor(gathered, source)
    later = torch.full((3,), 1.0)
    dist.all_reduce(later)  # the groups' call numbers and steps still agree
    return {"sum": t.tolist(), "broadcast": b.tolist(), "gathered": gathered.tolist(), "later": later.tolist()}


def mismatch_is_named() -> dict:
    """Rank 0 all-reduces 2 floats on the fast path, rank 1 4 floats: both raise, naming both
    calls, and the group's next call says it can no longer be used."""
    smddp_lite.init()
    rank = dist.get_rank()
    t = torch.ones(2 if rank == 0 else 4)
    return {"error": error_of(lambda: dist.all_reduce(t)), "after": error_of(still_works)}


def recorded() -> dict:
    """The flight recorder holds a fast call, with its sizes, completed."""
    smddp_lite.init()
    from smddp_lite.backend import flight_recorder

    t = torch.ones(3)
    dist.all_reduce(t)
    process = flight_recorder._PROCESS
    entry, _, started, completed = process.ring.held(process.next_record_id)[-1]
    return {"name": entry[4], "sizes": [[list(shape), str(dtype)] for shape, dtype in entry[5]], "started": started is not None, "completed": completed is not None,
            "fast": _took_fast_path()}


def mismatch_on_the_general_route() -> dict:
    """As mismatch_is_named, every call on the general route (strided views)."""
    smddp_lite.init()
    rank = dist.get_rank()
    t = torch.ones(4 if rank == 0 else 8)[::2]
    return {"error": error_of(lambda: dist.all_reduce(t)), "after": error_of(still_works)}


def barriers_pair_across_routes() -> dict:
    """Barriers on the fast path between all_reduces on both routes keep the ranks' calls paired,
    and a rank that is late holds the others in the barrier."""
    import time

    from smddp_lite.backend.fast_cpu import DoneWork

    smddp_lite.init()
    rank = dist.get_rank()
    fast = type(dist.barrier(async_op=True)) is DoneWork
    if rank == 1:
        time.sleep(0.3)
    start = time.monotonic()
    dist.barrier()
    waited = time.monotonic() - start
    t = torch.ones(8)[::2]  # general route
    dist.all_reduce(t)
    dist.barrier()
    return {"fast": fast, "waited": waited, "sum": t.tolist()}


def moves_as_the_general_route() -> dict:
    """broadcast and all_gather_into_tensor of every kind of dtype (reduced ones, and bool, int16,
    complex, which move as bytes), on the fast path and on the general route (strided copies),
    every rank's values distinct; in-place all_gather too. Which differed, and whether both fast
    calls took the path."""
    from smddp_lite.backend.fast_cpu import DoneWork

    smddp_lite.init()
    rank, world = dist.get_rank(), dist.get_world_size()
    wrong = []
    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.bool, torch.int16, torch.complex64):
        mine = (torch.arange(6) + 10 * rank).to(dtype)
        for root in range(world):
            fast, general = mine.clone(), torch.empty(12, dtype=dtype)[::2]
            general.copy_(mine)
            dist.broadcast(fast, src=root)
            dist.broadcast(general, src=root)
            want = (torch.arange(6) + 10 * root).to(dtype)
            if not (torch.equal(fast, want) and torch.equal(general, want)):
                wrong.append(f"broadcast {dtype} from {root}: {fast.tolist()} / {general.tolist()}")
        out = torch.empty(world * 6, dtype=dtype)
        dist.all_gather_into_tensor(out, mine)
        in_place = torch.empty(world * 6, dtype=dtype)
        in_place[rank * 6:(rank + 1) * 6] = mine
        dist.all_gather_into_tensor(in_place, in_place[rank * 6:(rank + 1) * 6])
        slow = torch.empty(world * 6 * 2, dtype=dtype)[::2]
        dist.all_gather_into_tensor(slow, mine)
        want = torch.cat([(torch.arange(6) + 10 * r).to(dtype) for r in range(world)])
        for name, got in (("fast", out), ("in place", in_place), ("general", slow)):
            if not torch.equal(got, want):
                wrong.append(f"all_gather {dtype} {name}: {got.tolist()}")
    t = torch.ones(2)
    paths = [type(dist.broadcast(t, src=0, async_op=True)) is DoneWork,
             type(dist.all_gather_into_tensor(torch.empty(2 * world), t, async_op=True)) is DoneWork]
    return {"wrong": wrong, "fast": paths}
