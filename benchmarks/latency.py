"""Per-call latency distribution of a small all_reduce, for several backends side by side.

nccl-tests style means hide the tail; this prints p50/p90/p99/max of single calls, alternating
backends in rounds so that machine noise hits them alike.

    torchrun --standalone --nproc-per-node 2 benchmarks/latency.py --backends smddp,gloo
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

import smddp_lite


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="smddp,gloo")
    parser.add_argument("--bytes", type=int, default=256, help="message size (float32)")
    parser.add_argument("--calls", type=int, default=3000, help="timed calls per backend")
    parser.add_argument("--rounds", type=int, default=6, help="alternations between backends")
    args = parser.parse_args()

    backends = args.backends.split(",")
    smddp_lite.init(backend=backends[0])
    groups = {b: dist.group.WORLD if i == 0 else dist.new_group(backend=b) for i, b in enumerate(backends)}
    tensor = torch.ones(max(1, args.bytes // 4))
    samples: dict[str, list[float]] = {b: [] for b in backends}
    for _ in range(args.rounds):
        for backend, group in groups.items():
            for _ in range(50):  # warm-up after switching
                dist.all_reduce(tensor, group=group)
            for _ in range(args.calls // args.rounds):
                start = time.perf_counter()
                dist.all_reduce(tensor, group=group)
                samples[backend].append(time.perf_counter() - start)
    if dist.get_rank() == 0:
        print(f"# all_reduce of {tensor.numel() * 4} B float32 on {dist.get_world_size()} ranks, "
              f"{args.calls} calls per backend in {args.rounds} alternating rounds (rank 0's view)")
        print(f"# {'backend':<8} {'p50 us':>8} {'p90 us':>8} {'p99 us':>8} {'max us':>8} {'mean us':>8}")
        for backend, values in samples.items():
            us = torch.tensor(values, dtype=torch.float64) * 1e6
            q = [float(us.quantile(p)) for p in (0.5, 0.9, 0.99)]
            print(f"  {backend:<8} {q[0]:8.1f} {q[1]:8.1f} {q[2]:8.1f} {float(us.max()):8.1f} {float(us.mean()):8.1f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
