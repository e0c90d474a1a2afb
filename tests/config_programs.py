"""Programs of test_config.py.

Each program runs on every rank of a test job (see harness.py) and returns what it observed."""

from __future__ import annotations

import torch
import torch.distributed as dist

import smddp_lite


def scratch_kept(numel: int = 1 << 21) -> dict:
    """A bfloat16 all_reduce and reduce_scatter of ``numel`` elements (widened to float32 on the
    gloo transport): what the group keeps afterwards, and whether the results are right."""
    smddp_lite.init()
    world = dist.get_world_size()
    t = torch.ones(numel, dtype=torch.bfloat16)
    dist.all_reduce(t)
    out = torch.empty(numel // world, dtype=torch.bfloat16)
    dist.reduce_scatter_tensor(out, torch.ones(numel, dtype=torch.bfloat16))
    group = dist.group.WORLD
    kept = group.collectives.scratch.kept_bytes() + group.transport._scratch.kept_bytes()
    right = bool((t == world).all()) and bool((out == world).all())
    dist.destroy_process_group()
    return {"kept": kept, "right": right}


def sum_of_ranks() -> int:
    """``init_process_group(backend="smddp")`` as a user's script calls it, then one all_reduce."""
    dist.init_process_group(backend="smddp")
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    dist.destroy_process_group()
    return int(t.item())
