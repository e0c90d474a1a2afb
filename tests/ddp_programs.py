"""Programs of test_ddp.py: DDP over smddp against DDP over torch's gloo.

Each program runs on every rank of a test job (see harness.py) and returns what it observed."""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist

import smddp_lite

from .rank_helpers import let_gloo_workers_finish, parity_batches, parity_model


def ddp_parity(steps: int = 12) -> dict:
    """The same model trained with DDP on "smddp" and on "gloo", side by side in one job."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    smddp_lite.init()
    rank = dist.get_rank()
    gloo = dist.new_group(backend="gloo")

    variants = {
        "smddp": DDP(parity_model(), process_group=dist.group.WORLD, bucket_cap_mb=0.01),
        "gloo": DDP(parity_model(), process_group=gloo, bucket_cap_mb=0.01),
        "smddp_fp16_hook": DDP(parity_model(), process_group=dist.group.WORLD, bucket_cap_mb=0.01),
        "gloo_fp16_hook": DDP(parity_model(), process_group=gloo, bucket_cap_mb=0.01),
    }
    variants["smddp_fp16_hook"].register_comm_hook(dist.group.WORLD, default_hooks.fp16_compress_hook)
    variants["gloo_fp16_hook"].register_comm_hook(gloo, default_hooks.fp16_compress_hook)
    optims = {k: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for k, m in variants.items()}
    losses = {k: [] for k in variants}
    for step, (x, y) in enumerate(parity_batches(rank, steps)):
        for name, ddp in variants.items():
            optims[name].zero_grad()
            if step % 4 == 3:  # gradient accumulation: one micro-batch under no_sync
                with ddp.no_sync():
                    torch.nn.functional.cross_entropy(ddp(x[:8]), y[:8]).backward()
                x_step, y_step = x[8:], y[8:]
            else:
                x_step, y_step = x, y
            loss = torch.nn.functional.cross_entropy(ddp(x_step), y_step)
            loss.backward()
            optims[name].step()
            losses[name].append(loss.item())

    def max_diff(a: str, b: str) -> float:
        pa, pb = variants[a].parameters(), variants[b].parameters()
        return max(float((p - q).abs().max()) for p, q in zip(pa, pb))

    result = {
        "plain": max_diff("smddp", "gloo"),
        "fp16_hook": max_diff("smddp_fp16_hook", "gloo_fp16_hook"),
        "losses": losses["smddp"],
    }
    let_gloo_workers_finish()
    dist.destroy_process_group()
    return result


def ddp_uneven_inputs(base_steps: int = 5, divide_by_initial_world_size: bool = True) -> dict:
    """Ranks with different numbers of batches (the last, short epoch of a sharded dataset),
    trained under DDP's ``join()``: ranks that run out shadow the others' all_reduces instead of
    leaving them waiting. The same on "smddp" and on "gloo", one after the other in one job;
    returns each one's seconds and final parameters' largest difference."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    smddp_lite.init(timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    gloo = dist.new_group(backend="gloo")
    steps = base_steps + 3 * rank  # rank r has 3r more batches than rank 0
    batches = list(parity_batches(rank, steps))
    result = {}
    models = {}
    for name, group in (("smddp", dist.group.WORLD), ("gloo", gloo)):
        ddp = DDP(parity_model(), process_group=group, bucket_cap_mb=0.01)
        optim = torch.optim.SGD(ddp.parameters(), lr=0.05)
        started = time.monotonic()
        with ddp.join(divide_by_initial_world_size=divide_by_initial_world_size):
            for x, y in batches:
                optim.zero_grad()
                torch.nn.functional.cross_entropy(ddp(x), y).backward()
                optim.step()
        result[f"{name}_seconds"] = time.monotonic() - started
        models[name] = ddp.module
    let_gloo_workers_finish()
    del ddp, optim
    result["max_diff"] = max(float((p - q).abs().max())
                             for p, q in zip(models["smddp"].parameters(), models["gloo"].parameters()))
    # every rank must end with the same parameters (DDP's shadow all_reduces kept them in step)
    flat = torch.cat([p.detach().reshape(-1) for p in models["smddp"].parameters()])
    everyone = torch.empty(dist.get_world_size() * flat.numel())
    dist.all_gather_into_tensor(everyone, flat)
    result["ranks_agree"] = bool((everyone.view(dist.get_world_size(), -1) == flat).all())
    dist.destroy_process_group()
    return result
