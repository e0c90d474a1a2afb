"""Data-parallel training throughput of one configuration (a worker for benchmarks/scaling.py).

Trains an MLP whose gradients are large next to its compute (5.2M parameters, 21 MB of float32
gradients per step at 16 samples per rank), so the network between hosts sets the pace, and
prints one JSON line on rank 0: samples/s over the timed steps and the final parameters' digest.

    torchrun --standalone --nproc-per-node 2 benchmarks/ddp_throughput.py --variant smddp
Variants: gloo, gloo-fp16-hook (torch's fp16_compress_hook), smddp (set SMDDP_ALGORITHM /
SMDDP_INTER_NODE_WIRE_DTYPE for flat, hierarchical, compressed), smddp-compiled (smddp_lite.compile;
--wire-dtype for its gradient wire dtype, --shard-optimizer-state for the sharded step), gloo-fsdp and smddp-fsdp (FSDP2: fully_shard on each
layer and the model, --param-dtype for its MixedPrecisionPolicy; parameters are all-gathered
before use and gradients reduce-scattered). ``--optimizer`` picks SGD with momentum (the default)
or AdamW. ``no-sync`` is the lab's limit: the same processes, model, optimizer and batches, each
rank training alone with no gradient sync (a gloo group only times and reports, outside the
steps). On simulated hosts (benchmarks/multinode) the report also gives the bytes the hosts
sent each other per timed step, read from each host's eth0 counters.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time

import torch
import torch.distributed as dist

import smddp_lite


def make_model(width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
                               torch.nn.ReLU(), torch.nn.Linear(width, 256))


def make_optimizer(name: str, module: torch.nn.Module) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(module.parameters(), lr=1e-3, weight_decay=0.01)
    return torch.optim.SGD(module.parameters(), lr=0.01, momentum=0.9)


def host_bytes_sent(counts: bool) -> int:
    """Bytes this simulated host has sent on its link so far; 0 off the lab, or where ``counts``
    is False (all but the host's first rank, so that a sum over ranks counts each host once)."""
    path = "/sys/class/net/eth0/statistics/tx_bytes"
    if not counts or "SIM_HOSTS_FILE" not in os.environ or not os.path.exists(path):
        return 0
    with open(path) as f:
        return int(f.read())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", required=True, choices=["no-sync", "gloo", "gloo-fp16-hook", "smddp",
                                                                 "smddp-compiled", "gloo-fsdp", "smddp-fsdp"])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=16, help="samples per rank per step")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--wire-dtype", default=None, help="smddp-compiled: gradient wire dtype")
    parser.add_argument("--param-dtype", default=None, help="*-fsdp: parameter and gradient-reduction dtype")
    parser.add_argument("--optimizer", choices=["sgd", "adamw"], default="sgd")
    parser.add_argument("--shard-optimizer-state", action="store_true", help="smddp-compiled: the sharded step")
    parser.add_argument("--save-params", help="rank 0 writes the final parameters here (torch.save)")
    args = parser.parse_args()

    backend = "gloo" if args.variant.startswith("gloo") or args.variant == "no-sync" else "smddp"
    smddp_lite.init(backend=backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    hosts = [None] * world
    dist.all_gather_object(hosts, socket.gethostname())  # where the launcher put each rank
    first_of_host = hosts.index(socket.gethostname()) == rank
    module = make_model(args.width)
    if args.variant.endswith("-fsdp"):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        dtype = getattr(torch, args.param_dtype) if args.param_dtype else None
        policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype)
        for layer in module:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mp_policy=policy)
        model = fully_shard(module, mp_policy=policy)
        optimizer = make_optimizer(args.optimizer, module)
    elif args.variant == "no-sync":
        model, optimizer = module, make_optimizer(args.optimizer, module)
    elif args.variant == "smddp-compiled":
        model, optimizer = smddp_lite.compile(module, make_optimizer(args.optimizer, module), wire_dtype=args.wire_dtype,
                                              shard_optimizer_state=args.shard_optimizer_state)
    else:
        model = torch.nn.parallel.DistributedDataParallel(module)
        if args.variant == "gloo-fp16-hook":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        optimizer = make_optimizer(args.optimizer, module)

    gen = torch.Generator().manual_seed(rank)
    batches = [(torch.randn(args.batch, 256, generator=gen), torch.randn(args.batch, 256, generator=gen))
               for _ in range(args.warmup + args.steps)]
    start = None
    step_ends = []  # rank 0's clock at the end of each timed step: shows stalls a mean would hide
    for step, (x, y) in enumerate(batches):
        if step == args.warmup:
            dist.barrier()
            sent_before = host_bytes_sent(first_of_host)
            start, cpu_start = time.perf_counter(), time.process_time()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if start is not None:
            step_ends.append(time.perf_counter())
    cpu = time.process_time() - cpu_start  # every thread of this rank: compute and communication
    dist.barrier()
    elapsed = time.perf_counter() - start
    sent = torch.tensor([host_bytes_sent(first_of_host) - sent_before], dtype=torch.float64)
    dist.all_reduce(sent)
    cpu_per_step = [None] * world
    dist.all_gather_object(cpu_per_step, round(cpu / args.steps, 5))
    step_times = [b - a for a, b in zip([start] + step_ends, step_ends)]
    # FSDP's parameters are shards (DTensors): every rank takes part in gathering them
    params = torch.cat([(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().reshape(-1)
                        for p in module.parameters()])
    if rank == 0:
        if args.save_params:
            torch.save(params, args.save_params)
        print(json.dumps({"variant": args.variant, "world": world, "samples_per_s": args.batch * world * args.steps / elapsed,
                          "step_s": elapsed / args.steps, "bytes_between_hosts_per_step": float(sent) / args.steps,
                          "optimizer": args.optimizer,
                          "step_times_s": [round(t, 5) for t in step_times], "cpu_s_per_step": cpu_per_step, "loss": loss.item(), "hosts": hosts, "env": {
                              k: v for k, v in os.environ.items() if k.startswith("SMDDP_") and k != "SMDDP_HOSTNAME"}}),
              flush=True)
    if backend == "gloo":
        # torch's gloo worker thread frees a finished call's tensors after its wait returned, and needs
        # the GIL for it; where that falls into interpreter teardown, the rank dies of SIGABRT
        # ("terminate called without an active exception", seen in CI on the no-sync variant)
        time.sleep(0.1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
