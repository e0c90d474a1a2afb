"""Programs of test_launch.py: the ways a job starts, and groups made again.

Each program runs on every rank of a test job (see harness.py) and returns what it observed."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

import smddp_lite


def init_explicit(method: str, port: int = 0, path: str = "") -> dict:
    """init with an explicit init_method and rank/world size (no torchrun variables)."""
    rank, world = int(os.environ["TEST_RANK"]), int(os.environ["TEST_WORLD_SIZE"])
    url = f"tcp://127.0.0.1:{port}" if method == "tcp" else f"file://{path}"
    smddp_lite.init(init_method=url, rank=rank, world_size=world)
    return _summary()


def init_auto() -> dict:
    """smddp_lite.init() with whatever the launcher provided (torchrun variables or MPI)."""
    smddp_lite.init()
    return _summary()


def mpi_subgroups_on_simulated_hosts(per_host: int = 2) -> dict:
    """Under mpiexec, ranks on simulated hosts of ``per_host`` (SMDDP_HOSTNAME from the MPI
    rank): the default group is hierarchical, and a group inside one host (tensor parallel, HSDP's
    shard group) and one across hosts take MPI. Each group's transport and all_reduce sum."""
    os.environ["SMDDP_HOSTNAME"] = f"sim-host-{int(os.environ['PMI_RANK']) // per_host}"
    smddp_lite.init(timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    report = {"default": dist.group.WORLD.transport.name}
    for name, members in (("in_host", [0, 1]), ("across_hosts", [1, 2, 3])):
        group = dist.new_group(members)
        if rank in members:
            t = torch.full((3,), float(rank + 1))
            dist.all_reduce(t, group=group)
            report[name] = {"transport": group.transport.name, "sum": t.tolist()}
    dist.destroy_process_group()
    return report


def _summary() -> dict:
    t = torch.full((4,), float(dist.get_rank() + 1))
    dist.all_reduce(t)
    result = {"rank": dist.get_rank(), "world": dist.get_world_size(), "backend": dist.get_backend(),
              "sum": t.tolist(), "env_rank": os.environ.get("RANK")}
    dist.destroy_process_group()
    return result


def large_all_reduce(numel: int) -> dict:
    """A float32 all_reduce of ``numel`` elements, checked element by element against the exact
    sum (small integers: every partial sum is exact): the count of wrong elements."""
    smddp_lite.init()
    rank, world = dist.get_rank(), dist.get_world_size()
    pattern = torch.arange(numel, dtype=torch.float32).remainder_(1000)
    t = pattern + rank
    dist.all_reduce(t)
    want = pattern * world + sum(range(world))
    wrong = int((t != want).sum())
    dist.destroy_process_group()
    return wrong


def made_again(times: int = 3) -> dict:
    """init, an all_reduce and a send/recv, destroy; again, on the same store (torchrun's agent
    store, or mpiexec's): each incarnation of the group must not meet the keys the last one left
    (the shared-memory segment's name, rendezvous addresses, the pair links')."""
    rank = world = None
    got = []
    for k in range(times):
        smddp_lite.init(timeout=timedelta(seconds=30))
        rank, world = dist.get_rank(), dist.get_world_size()
        total = torch.full((5,), float(rank + 10 * k))
        dist.all_reduce(total)
        after, before = (rank + 1) % world, (rank - 1) % world
        out = torch.empty(5)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.full((5,), float(rank + 10 * k)), after),
                                        dist.P2POp(dist.irecv, out, before)])
        for w in works:
            w.wait()
        got.append([float(total[0]), float(out[0])])
        dist.destroy_process_group()
    want = [[float(sum(range(world)) + 10 * k * world), float(before + 10 * k)] for k in range(times)]
    return {"got": got, "want": want}


def subgroup_made_again() -> dict:
    """torch names subgroups by a counter that destroy_process_group resets: after a new init, the
    second subgroup's name (and store prefix) is the first one's, here for a group of another
    size (2 ranks, then all 4). Each must count its incarnations apart."""
    sums = []
    for members in ([0, 1], [0, 1, 2, 3]):
        smddp_lite.init(timeout=timedelta(seconds=30))
        rank = dist.get_rank()
        group = dist.new_group(members)
        t = torch.ones(3)
        if rank in members:
            dist.all_reduce(t, group=group)
        sums.append(float(t[0]))
        dist.destroy_process_group()
    return {"sums": sums}
