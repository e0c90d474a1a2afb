"""The sharded compiled step against ZeRO-1 as torch ships it and the unsharded compiled step.

Variants, run alternately in one job on the same batches (each rank its own):
- ``ddp``: DDP + torch.optim.AdamW(fused=True), the state on every rank (the memory baseline);
- ``zero``: DDP + torch's ZeroRedundancyOptimizer(AdamW, fused=True): each rank updates the whole
  parameters torch assigns it, then every parameter is broadcast from its owner; ``zero-default``
  the same with AdamW's default (foreach) implementation;
- ``compiled``: ``smddp_lite.compile`` (all_reduce of each bucket, the fused update everywhere);
- ``sharded``: ``smddp_lite.compile(..., shard_optimizer_state=True)`` (reduce-scatter, the fused
  update of this rank's share, all-gather back).
Every variant runs on the "smddp" backend, so the transport is the same for all. Printed on rank
0 as one JSON line: per variant, the median optimizer step (for ``sharded``, until the gathered
parameters are in place; for ``zero``, its broadcasts included), the median whole training step
(forward, backward, step, zero_grad, timed over blocks of steps in a row, as a training loop runs
them), the optimizer state bytes each rank holds, and the largest
parameter difference from ``compiled`` at the end. With one variant alone it also reports the
rank's peak resident memory (``ru_maxrss``), which only a job of its own can attribute.

    torchrun --standalone --nproc-per-node 3 benchmarks/sharded_step.py
    torchrun --standalone --nproc-per-node 3 benchmarks/sharded_step.py --variants sharded   # its peak memory
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time

import torch
import torch.distributed as dist

import smddp_lite

VARIANTS = ("ddp", "zero-default", "zero", "compiled", "sharded")


def make_model(width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
                               torch.nn.ReLU(), torch.nn.Linear(width, 256))


def build(variant: str, width: int):
    """(module, model to call, optimizer, wait for parameters, state bytes of this rank)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    module = make_model(width)
    adamw = dict(lr=1e-3, weight_decay=0.01)
    if variant in ("ddp", "zero", "zero-default"):
        model = torch.nn.parallel.DistributedDataParallel(module)
        # torch's fused AdamW: on CPU 3-6x its default (foreach) step here, the strongest torch has
        fused = {} if variant == "zero-default" else {"fused": True}
        if variant.startswith("zero"):
            opt = ZeroRedundancyOptimizer(module.parameters(), optimizer_class=torch.optim.AdamW, **fused, **adamw)
        else:
            opt = torch.optim.AdamW(module.parameters(), **fused, **adamw)
        local = opt.optim if variant.startswith("zero") else opt  # the rank's own torch optimizer

        def state_bytes() -> int:
            return sum(t.numel() * t.element_size() for entry in local.state.values()
                       for t in entry.values() if torch.is_tensor(t))

        return module, model, opt, lambda: None, state_bytes
    model, opt = smddp_lite.compile(module, torch.optim.AdamW(module.parameters(), **adamw),
                                    shard_optimizer_state=variant == "sharded")
    return module, model, opt, model.wait_for_parameters, opt.state_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--width", type=int, default=2048, help="hidden width: 2048 gives 5.2M parameters")
    parser.add_argument("--batch", type=int, default=16, help="samples per rank per step")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--block", type=int, default=4, help="training steps per variant in a row, in the loop timing")
    args = parser.parse_args()
    variants = args.variants.split(",")
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variant(s) {unknown}; choose from {', '.join(VARIANTS)}")

    smddp_lite.init()
    rank, world = dist.get_rank(), dist.get_world_size()
    runs = {v: build(v, args.width) for v in variants}
    gen = torch.Generator().manual_seed(rank)
    # fresh batches throughout: a second pass over the same ones makes this model's AdamW runs
    # sensitive to the last bit (torch's own foreach and fused AdamW part by 1e-3 within 20 steps
    # of the second pass), and the check against "compiled" would then measure nothing
    batches = [(torch.randn(args.batch, 256, generator=gen), torch.randn(args.batch, 256, generator=gen))
               for _ in range(2 * (args.warmup + args.steps))]
    timed_steps, loop = batches[:args.warmup + args.steps], batches[args.warmup + args.steps:]
    times: dict[str, dict[str, list[float]]] = {v: {"step": [], "optimizer": []} for v in variants}
    # the optimizer step alone, alternating step by step so that a drift of the machine hits each
    # variant alike; the sharded one waits for its gathers, so its figure is their whole cost
    for i, (x, y) in enumerate(timed_steps):
        for v in variants:
            _, model, opt, wait, _ = runs[v]
            torch.nn.functional.mse_loss(model(x), y).backward()
            dist.barrier()
            start = time.perf_counter()
            opt.step()
            wait()
            if i >= args.warmup:
                times[v]["optimizer"].append(time.perf_counter() - start)
            opt.zero_grad()
    # the training loop as a user runs it, in blocks of --block steps per variant (alternating
    # block by block): the sharded step's gathers overlap what follows them, and the next
    # forward waits for each layer's own; the block's time ends once its last gathers are in
    for i in range(0, len(loop), args.block):
        for v in variants:
            _, model, opt, wait, _ = runs[v]
            dist.barrier()
            start = time.perf_counter()
            for x, y in loop[i:i + args.block]:
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
                opt.zero_grad()
            wait()
            if i > 0:  # the first block warms the loop up
                times[v]["step"].append((time.perf_counter() - start) / len(loop[i:i + args.block]))
    report = {"world": world, "width": args.width, "parameters": sum(p.numel() for p in make_model(args.width).parameters()),
              "batch_per_rank": args.batch, "steps": args.steps, "torch": torch.__version__, "variants": {}}
    reference = runs["compiled"][0] if "compiled" in runs else None
    for v in variants:
        module, _, opt, wait, state_bytes = runs[v]
        wait()
        stats = torch.tensor([statistics.median(times[v]["optimizer"]), statistics.median(times[v]["step"]),
                              float(state_bytes())], dtype=torch.float64)
        slowest = stats.clone()
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # a step ends when its slowest rank's ends
        diff = (max(float((p - q).detach().abs().max()) for p, q in zip(module.parameters(), reference.parameters()))
                if reference is not None else None)
        report["variants"][v] = {"optimizer_step_ms": round(1e3 * float(slowest[0]), 2),
                                 "train_step_ms": round(1e3 * float(slowest[1]), 2),
                                 "state_bytes_per_rank_max": int(slowest[2]),
                                 "max_param_diff_vs_compiled": diff}
    if len(variants) == 1:
        peak = torch.tensor([float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)])  # KiB on Linux
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        report["variants"][variants[0]]["peak_rss_mib_max"] = round(float(peak) / 1024, 1)
    if rank == 0:
        print(json.dumps(report), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
