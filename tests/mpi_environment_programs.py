"""Programs of test_mpi_environment.py.

Each program runs on every rank of a test job (see harness.py) and returns what it observed."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

import smddp_lite

from .rank_helpers import error_of


def large_messages(numel: int) -> dict:
    """A broadcast, all_reduce and all_gather of ``numel`` float32 each, large enough that MPICH
    would copy them between ranks of a host with process_vm_readv: whether each result is exact
    (until the first error), the error, and MPICH's cross-memory-attach setting as the rank saw it."""
    smddp_lite.init(timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    expected = torch.arange(numel, dtype=torch.float32)
    exact = {}

    def run() -> None:
        b = expected.clone() if rank == 0 else torch.zeros(numel)
        dist.broadcast(b, 0)
        exact["broadcast"] = bool(torch.equal(b, expected))
        a = torch.full((numel,), float(rank + 1))
        dist.all_reduce(a)
        exact["all_reduce"] = bool((a == world * (world + 1) / 2).all())
        g = torch.empty(world * numel)
        dist.all_gather_into_tensor(g, torch.full((numel,), float(rank)))
        exact["all_gather"] = bool((g.view(world, numel) == torch.arange(world, dtype=torch.float32)[:, None]).all())

    error = error_of(run)
    return {"exact": exact, "error": error, "cma": os.environ.get("MPIR_CVAR_CH4_CMA_ENABLE")}
