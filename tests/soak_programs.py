"""Programs of test_soak.py.

Each program runs on every rank of a test job (see harness.py) and returns what it observed."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import smddp_lite


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def soak(rounds: int = 1200, checkpoints: int = 10, compare_from: int = 4, lines_from: int = 2) -> dict:
    """Every kind of collective, round after round, with this rank's memory read at checkpoints:
    the Python heap (tracemalloc, after a full garbage collection) and the resident set. Whatever a
    call leaves behind (a handle, a future, a store key, a buffer) grows them in step with the calls.
    ``growth`` lists the source lines whose live blocks grew most between checkpoint
    ``lines_from`` and the last (a snapshot grows the heap itself for a while, so it is taken
    before ``compare_from``, where the heap's growth is measured from), so a leak in one kind of call shows even where the total hides it. Values are checked
    as it goes, so a leak fixed by corrupting results does not pass."""
    import gc
    import tracemalloc

    smddp_lite.init()
    rank, world = dist.get_rank(), dist.get_world_size()
    n = 256 * world
    values = torch.empty(n)
    wide = torch.empty(1 << 16, dtype=torch.bfloat16)  # 16-bit: the widening paths and their buffers
    gathered, scattered = torch.empty(n * world), torch.empty(n)
    mine, blocks = torch.empty(n), torch.empty(n * world)
    wrong = []
    # torch 2.13 deprecates the *_into_tensor / *_tensor names, and every deprecation warning adds to
    # the warnings registry, which would read as growth here
    all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
    reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)

    def one_round(i: int) -> None:
        values.fill_(rank + 1)
        dist.all_reduce(values)
        wide.fill_(rank + 1)
        dist.all_reduce(wide, op=dist.ReduceOp.AVG)
        all_gather(gathered, values)
        reduce_scatter(scattered, gathered)
        dist.broadcast(values, src=i % world)
        chained = dist.all_reduce(values, async_op=True).get_future().then(lambda f: f.value()[0][0].item())
        total = world * (world + 1) // 2
        got = (chained.wait(), float(wide[-1]), float(scattered[0]))
        if got != (total * world, (world + 1) / 2, total * world):
            wrong.append((i, got))
        # the ops added on 2026-11-24: gather, scatter, an uneven all_to_all (sizes change every
        # round, as MoE routing's do) and a ring of isend/irecv through the pair links
        root = i % world
        mine.fill_(rank)
        dist.gather(mine, list(blocks.chunk(world)) if rank == root else None, dst=root)
        dist.scatter(mine, list(blocks.chunk(world)) if rank == root else None, src=root)
        sends = [(rank + q + i) % 3 for q in range(world)]
        receives = [(q + rank + i) % 3 for q in range(world)]
        routed = torch.empty(sum(receives))
        dist.all_to_all_single(routed, torch.full((sum(sends),), float(rank)), receives, sends)
        ring = torch.empty(4)
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.full((4,), float(rank)), (rank + 1) % world),
                                            dist.P2POp(dist.irecv, ring, (rank - 1) % world)]):
            work.wait()
        want_routed = torch.cat([torch.full((c,), float(q)) for q, c in enumerate(receives)])
        if float(mine[0]) != rank or not torch.equal(routed, want_routed) or float(ring[0]) != (rank - 1) % world:
            wrong.append((i, "gather/scatter/all_to_all/send", float(mine[0]), float(ring[0])))
        if i % 50 == 0:
            dist.barrier()

    for i in range(100):  # warm-up: buffers, first-call caches
        one_round(i)
    gc.collect()
    tracemalloc.start()
    heap, resident, reference = [], [], None
    for c in range(checkpoints):
        for i in range(rounds // checkpoints):
            one_round(i)
        gc.collect()
        heap.append(tracemalloc.get_traced_memory()[0])
        resident.append(_resident_bytes())
        if c == lines_from:
            reference = tracemalloc.take_snapshot()
    diffs = tracemalloc.take_snapshot().compare_to(reference, "lineno")
    tracemalloc.stop()
    growth = [{"blocks": d.count_diff, "bytes": d.size_diff,
               "where": f"{d.traceback[0].filename.rsplit('/', 2)[-1]}:{d.traceback[0].lineno}"}
              for d in sorted(diffs, key=lambda d: -d.count_diff)[:3]]
    dist.destroy_process_group()
    return {"heap": heap, "resident": resident, "wrong": wrong[:5], "growth": growth}
