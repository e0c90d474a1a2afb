"""torch.distributed.checkpoint on the "smddp" backend: a DDP + AdamW run saved, then resumed in
the compiled step (``smddp_lite.compile``) with its optimizer state.

    torchrun --standalone --nproc-per-node 2 -m smddp_lite.examples.dcp_resume
"""

from __future__ import annotations

import shutil
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel as DDP

import smddp_lite
from smddp_lite.examples import _outcome


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3))


def batches(steps: int):
    gen = torch.Generator().manual_seed(1 + dist.get_rank())  # each rank its own data
    for _ in range(steps):
        x = torch.randn(8, 16, generator=gen)
        yield x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long()


def train(model, optimizer, data) -> list[float]:
    losses = []
    for x, y in data:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean, op=dist.ReduceOp.AVG)
        losses.append(mean.item())
    return losses


def main() -> None:
    args = _outcome.arguments(__doc__)
    smddp_lite.init(backend=args.backend)
    where = [tempfile.mkdtemp(prefix="dcp-example-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(where, src=0)  # one checkpoint directory, rank 0's
    data = list(batches(2 * args.steps))

    # a plain DDP + AdamW run, saved half-way
    model = DDP(make_model())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = train(model, optimizer, data[: args.steps])
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=where[0])
    uninterrupted = train(model, optimizer, data[args.steps:])

    # resumed in the compiled step: weights and AdamW's moments come from the checkpoint
    fresh = make_model()
    compiled, compiled_optimizer = smddp_lite.compile(fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-2))
    model_state, optimizer_state = get_state_dict(compiled.module, compiled_optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=where[0])
    set_state_dict(compiled.module, compiled_optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"])
    resumed = train(compiled, compiled_optimizer, data[args.steps:])
    if dist.get_rank() == 0:
        shutil.rmtree(where[0])
        print(f"DCP on {args.backend}: resumed loss {resumed[0]:.5f} -> {resumed[-1]:.5f}, "
              f"uninterrupted {uninterrupted[0]:.5f} -> {uninterrupted[-1]:.5f}")
    _outcome.write(args.out, losses + resumed, compiled.module, uninterrupted=losses + uninterrupted)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
