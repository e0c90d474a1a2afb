"""A training step made of small calls: DDP on a small model, plus the per-step loss all_reduce.

Each step runs forward and backward of a small MLP under DistributedDataParallel (its gradients
fit one bucket of a few KiB), the optimizer's step, and an all_reduce (AVG) of the loss, as
training loops log it. Backends alternate in rounds within one job, so machine noise hits them
alike; rank 0 prints the median step time per backend and round, then the medians over rounds.

    torchrun --standalone --nproc-per-node 2 -m benchmarks.small_calls_step --backends smddp,gloo
    torchrun --standalone --nproc-per-node 2 -m benchmarks.small_calls_step \
        --backends smddp:SMDDP_TRANSPORT=shm,gloo --steps 2000 --rounds 5

A backend may carry settings for its group, as in latency.py: ``smddp:SMDDP_TRANSPORT=gloo``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import smddp_lite
from benchmarks.latency import _backend_and_settings, _environment


def group_for(spec: str) -> tuple[str, dist.ProcessGroup]:
    """A group of every rank on ``spec``'s backend, with its settings set while it is made."""
    backend, settings = _backend_and_settings(spec)
    with _environment(settings):
        return spec, dist.new_group(backend=backend)


def step_times(group: dist.ProcessGroup, steps: int, width: int) -> list[float]:
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.ReLU(), torch.nn.Linear(width, 4)),
                process_group=group)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(dist.get_rank())
    x, y = torch.randn(32, 16, generator=gen), torch.randint(0, 4, (32,), generator=gen)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        logged = loss.detach().clone()
        dist.all_reduce(logged, op=dist.ReduceOp.AVG, group=group)
        times.append(time.perf_counter() - start)
    return times[steps // 10:]  # the first tenth warms up


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="smddp,gloo")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--width", type=int, default=64, help="hidden units: 1.4k parameters at 64")
    args = parser.parse_args()
    smddp_lite.init(backend="gloo")
    groups = [group_for(spec) for spec in args.backends.split(",")]
    medians: dict[str, list[float]] = {spec: [] for spec, _ in groups}
    for round_ in range(args.rounds):
        for spec, group in groups:
            dist.barrier()
            median = statistics.median(step_times(group, args.steps, args.width)) * 1e6
            medians[spec].append(median)
            if dist.get_rank() == 0:
                print(f"round {round_ + 1}  {spec:28s} step p50 {median:8.1f} us", flush=True)
    if dist.get_rank() == 0:
        first = statistics.median(medians[groups[0][0]])
        for spec, values in medians.items():
            m = statistics.median(values)
            print(f"median over rounds  {spec:28s} {m:8.1f} us  ({m / first:.2f}x the first)", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
