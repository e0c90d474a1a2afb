"""A SageMaker training script written as for AWS's data-parallel library, running on smddp-lite.

Only the import line differs from an SMDDP script: ``import smddp_lite.torch_smddp`` where it
had ``import smdistributed.dataparallel.torch.torch_smddp``. It runs unchanged under both of
SageMaker's distributions, ``torch_distributed`` (torchrun on every host) and ``smdistributed
dataparallel`` (the toolkit's mpirun). SageMaker passes the hyperparameters as arguments, the
"training" channel as ``SM_CHANNEL_TRAINING`` and the model folder as ``SM_MODEL_DIR``.

The channel holds ``train.csv``: rows of features, the last column the class. Without the
channel (``--make-data DIR`` writes one) it trains on data it generates itself.

    python -m smddp_lite.examples.sagemaker_train --make-data data/   # a channel's content
    docs/docker.md: the SageMaker Python SDK call that runs this script on 2 instances
"""

from __future__ import annotations

import argparse
import os
import random
import socket

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import smddp_lite.torch_smddp  # noqa: F401  (was: import smdistributed.dataparallel.torch.torch_smddp)

FEATURES, CLASSES = 16, 4


def make_data(folder: str, rows: int = 4096, seed: int = 1234) -> str:
    """A learnable task as CSV: each row's class is the largest of a fixed linear map of it."""
    rng = random.Random(seed)
    weights = [[rng.gauss(0, 1) for _ in range(FEATURES)] for _ in range(CLASSES)]
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "train.csv")
    with open(path, "w") as f:
        for _ in range(rows):
            x = [rng.gauss(0, 1) for _ in range(FEATURES)]
            scores = [sum(w * v for w, v in zip(row, x)) for row in weights]
            f.write(",".join(f"{v:.5f}" for v in x) + f",{scores.index(max(scores))}\n")
    return path


def load(channel: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    path = os.path.join(channel, "train.csv") if channel else None
    if path is None or not os.path.exists(path):
        raise FileNotFoundError(f"expected the training channel's train.csv at {path} (SM_CHANNEL_TRAINING="
                                f"{channel!r}); write one with --make-data DIR and pass DIR as the channel")
    table = torch.from_numpy(np.loadtxt(path, delimiter=",", dtype=np.float32, ndmin=2))
    return table[:, :-1], table[:, -1].long()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64, help="per rank")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--model-dir", default=os.environ.get("SM_MODEL_DIR", "model"))
    parser.add_argument("--train", default=os.environ.get("SM_CHANNEL_TRAINING"))
    parser.add_argument("--fail-on-rank", type=int, default=-1,
                        help="this rank raises at its first step (to see how a failing job ends)")
    parser.add_argument("--make-data", metavar="DIR", help="write a channel's train.csv to DIR and exit")
    args = parser.parse_args()
    if args.make_data:
        print(make_data(args.make_data))
        return

    dist.init_process_group(backend="smddp")
    rank, world = dist.get_rank(), dist.get_world_size()
    host = os.environ.get("SM_CURRENT_HOST", socket.gethostname())
    print(f"rank {rank}/{world} on {host}: backend {dist.get_backend()}", flush=True)
    x, y = load(args.train)
    x, y = x[rank::world], y[rank::world]

    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(FEATURES, 64), torch.nn.ReLU(), torch.nn.Linear(64, CLASSES)))
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    steps = max(1, len(x) // args.batch_size)
    if rank == 0:
        print(f"training on {world} ranks, backend {dist.get_backend()}, {steps} steps per epoch", flush=True)
    losses = []
    for epoch in range(1, args.epochs + 1):
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(epoch))
        total = torch.zeros(())
        for step in range(steps):
            if rank == args.fail_on_rank:
                raise RuntimeError(f"rank {rank} fails on purpose (--fail-on-rank {rank})")
            idx = order[step * args.batch_size:(step + 1) * args.batch_size]
            loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            total += loss.detach()
        mean = total / steps
        dist.all_reduce(mean, op=dist.ReduceOp.AVG)
        losses.append(mean.item())
        if rank == 0:
            print(f"epoch {epoch}/{args.epochs}: loss {losses[-1]:.4f}", flush=True)
    if rank == 0:
        os.makedirs(args.model_dir, exist_ok=True)
        torch.save(model.module.state_dict(), os.path.join(args.model_dir, "model.pt"))
        verdict = "went down" if losses[-1] < losses[0] else "did NOT go down"
        print(f"done: loss {losses[0]:.4f} -> {losses[-1]:.4f} ({verdict}); model in {args.model_dir}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
