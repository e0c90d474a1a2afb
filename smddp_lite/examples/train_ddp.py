"""A short data-parallel training run on the "smddp" backend, on data it generates itself.

Each rank trains a small MLP, wrapped in DistributedDataParallel, on its own shard of a
synthetic classification task (labels come from a fixed random "teacher" network, so the task
is learnable and the loss must go down). Rank 0 prints progress.

    torchrun --standalone --nproc-per-node 2 -m smddp_lite.examples.train_ddp
    mpiexec -n 2 python -m smddp_lite.examples.train_ddp --steps 100
    torchrun --standalone --nproc-per-node 2 -m smddp_lite.examples.train_ddp --backend gloo
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import smddp_lite


def synthetic_shard(rank: int, world: int, samples: int, features: int, classes: int):
    """This rank's shard of a dataset every rank generates identically from one seed."""
    gen = torch.Generator().manual_seed(1234)
    teacher = torch.nn.Sequential(torch.nn.Linear(features, 64), torch.nn.Tanh(), torch.nn.Linear(64, classes))
    for p in teacher.parameters():
        p.data = torch.randn(p.shape, generator=gen)
    x = torch.randn(samples, features, generator=gen)
    with torch.no_grad():
        y = teacher(x).argmax(1)
    return x[rank::world], y[rank::world]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="smddp", help="torch.distributed backend (default: smddp)")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=64, help="per rank")
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()

    smddp_lite.init(backend=args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = synthetic_shard(rank, world, samples=16384, features=32, classes=8)

    torch.manual_seed(0)  # identical initial weights everywhere (DDP also broadcasts rank 0's)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                    torch.nn.ReLU(), torch.nn.Linear(256, 8)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    if rank == 0:
        print(f"training on {world} ranks, backend {dist.get_backend()}, "
              f"{sum(p.numel() for p in model.parameters())} parameters", flush=True)

    first = last = None
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        idx = torch.randint(0, len(x), (args.batch_size,), generator=torch.Generator().manual_seed(step * world + rank))
        loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss, op=dist.ReduceOp.AVG)  # the loss over all ranks' batches
        first = first if first is not None else mean_loss.item()
        last = mean_loss.item()
        if rank == 0 and (step % 10 == 0 or step == 1):
            rate = step * args.batch_size * world / (time.perf_counter() - start)
            print(f"step {step:4d}/{args.steps}  loss {last:.4f}  {rate:8.0f} samples/s", flush=True)

    if rank == 0:
        verdict = "went down" if last < first else "did NOT go down"
        print(f"done: loss {first:.4f} -> {last:.4f} ({verdict})", flush=True)
    dist.destroy_process_group()
    if last >= first:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
