"""Programs of test_compiled_ddp.py: ``torch.compile(DistributedDataParallel(model))`` on "smddp"
beside the same on gloo, in one job.

torch compiles a DDP model two ways: its default DDPOptimizer splits the graph at DDP's bucket
boundaries and leaves the reducer's hooks to run between the pieces, and compiled autograd
(``optimize_ddp="python_reducer"``) traces DDP's all_reduces into the backward graph as functional
collectives on the group. Both reach the backend from compiled code, where torch's tracer meets
the backend's Python frames (backend/compile_boundary.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import smddp_lite

from .rank_helpers import let_gloo_workers_finish, train_side_by_side

MODES = ("ddp_optimizer", "python_reducer")


def _model() -> torch.nn.Module:
    """An MLP of 4.9 MB in float32: with DDPOptimizer's smallest bucket cap (1 MB, DDP's first
    bucket) its gradients fill 4 buckets, so the graph is split and a step makes several calls."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(33, 768), torch.nn.ReLU(), torch.nn.Linear(768, 768), torch.nn.ReLU(),
                               torch.nn.Linear(768, 768), torch.nn.ReLU(), torch.nn.Linear(768, 5))


def compiled_ddp_beside_gloo(mode: str, steps: int = 6) -> dict:
    """The model wrapped in DDP, compiled in ``mode`` and trained on "smddp" and on a gloo group
    side by side."""
    import torch._dynamo
    from torch.nn.parallel import DistributedDataParallel as DDP

    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: expected one of {MODES}")
    torch._dynamo.config.optimize_ddp = mode
    smddp_lite.init()
    gloo = dist.new_group(backend="gloo")
    variants = {name: torch.compile(DDP(_model(), process_group=group, bucket_cap_mb=1))
                for name, group in (("smddp", dist.group.WORLD), ("gloo", gloo))}
    with torch._dynamo.config.patch(compiled_autograd=mode == "python_reducer"):
        losses = train_side_by_side(variants, dist.get_rank(), steps)
    sums = {name: [float(p.detach().double().sum()) for p in model.parameters()] for name, model in variants.items()}
    transport = dist.group.WORLD.transport.name
    let_gloo_workers_finish()
    dist.destroy_process_group()
    return {"losses": losses, "parameter_sums": sums, "transport": transport}
