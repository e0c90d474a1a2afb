"""What ``SurvivingSync`` costs a step when nothing fails, against another source tree's.

Alternating rounds, each a fresh job of 3 local ranks (shared memory) training a 1.05M-parameter
MLP with SGD for ``--steps`` steps after 60 warm-up ones. A round runs with this tree's smddp_lite
first, then with the baseline tree's, from one shell. ``--baseline`` is a checkout of the
commit to compare against (``git worktree add /tmp/base <commit>``, and, since ``backend/``
installs as ``smddp_lite.backend``, ``ln -s ../backend /tmp/base/smddp_lite/backend``).
It prints each round's steps per second (the median over ranks), and the ratio of the
medians::

    python -m benchmarks.surviving_overhead --baseline /tmp/base --rounds 8

With ``--ddp`` the rounds compare, in this tree, a DistributedDataParallel of the same model
with SurvivingSync against the same DDP alone (the option on against off); with
``--python-hook-floor`` too, a third arm runs DDP with torch's own Python all_reduce hook, what
any Python comm hook costs::

    python -m benchmarks.surviving_overhead --ddp --python-hook-floor --rounds 8

With ``--lab 2x2`` (as root) the three DDP arms run in one job on 2 simulated hosts x 2 ranks
(benchmarks/multinode, 1 Gbit/s links), alternating rounds, each arm with its own model and
optimizer from the same start: DDP alone, DDP with torch's Python all_reduce hook, and DDP with
SurvivingSync. A round times ``--steps`` steps of each arm, in an order that rotates::

    python -m benchmarks.surviving_overhead --lab 2x2 --rounds 8 --steps 100

With ``--compiled`` the lab job's two arms are ``smddp_lite.compile``'s step (bfloat16 wire,
AdamW) alone and with SurvivingSync, each with its own model and optimizer from the same start::

    python -m benchmarks.surviving_overhead --lab 2x2 --compiled --rounds 8 --steps 100
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rank(steps: int, ddp: bool = False, surviving: bool = True, python_hook: bool = False) -> float:
    """One rank: steps per second of forward, backward, sync() and SGD; with ``ddp`` the model is
    a DistributedDataParallel, with SurvivingSync or (``surviving=False``) alone, or alone with
    torch's own Python all_reduce hook (``python_hook``)."""
    import torch
    import torch.distributed as dist

    import smddp_lite
    from smddp_lite.surviving import SurvivingSync

    torch.set_num_threads(1)
    smddp_lite.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 512))
    if ddp:
        model = torch.nn.parallel.DistributedDataParallel(model)
    if python_hook:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        model.register_comm_hook(None, allreduce_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    sync = SurvivingSync(model, optimizer) if surviving else None
    x = torch.randn(32, 512)
    warm_up = 60
    for step in range(warm_up + steps):
        if step == warm_up:
            started = time.perf_counter()
        model(x).square().mean().backward()
        if sync is not None:
            sync()
        optimizer.step()
        optimizer.zero_grad()
    elapsed = time.perf_counter() - started
    if sync is not None:
        sync.close()
    dist.destroy_process_group()
    return steps / elapsed


def lab_rank(rounds: int, steps: int, warm_up: int = 20, without_commit: bool = False,
             compiled: bool = False) -> None:
    """One rank of the lab job (under torchrun): every arm's steps per second, round by round,
    printed by rank 0 as one JSON line (a round's rate is the slowest rank's). ``without_commit``
    (an ablation, not a mode to train in): SurvivingSync skips its per-step commit call.
    ``compiled``: the arms are the compiled step alone and with SurvivingSync, not DDP's."""
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    import smddp_lite
    from smddp_lite.surviving import SurvivingSync

    torch.set_num_threads(1)
    smddp_lite.init()
    if without_commit:
        SurvivingSync._commit = lambda self: None
        SurvivingSync._commit_or_failure = lambda self: None
    arms = {}
    for name in ("compiled_alone", "surviving") if compiled else ("ddp_alone", "python_hook", "surviving"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 512))
        if compiled:  # one SurvivingSync per job: the compiled arms make a job of their own
            model, optimizer = smddp_lite.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                                                  wire_dtype=torch.bfloat16)
        else:
            model = torch.nn.parallel.DistributedDataParallel(model)
            if name == "python_hook":
                model.register_comm_hook(None, allreduce_hook)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        arms[name] = (model, optimizer, SurvivingSync(model, optimizer) if name == "surviving" else None)
    x = torch.randn(32, 512, generator=torch.Generator().manual_seed(dist.get_rank()))

    def run(name: str, n: int) -> float:
        model, optimizer, sync = arms[name]
        dist.barrier()
        started = time.perf_counter()
        for _ in range(n):
            model(x).square().mean().backward()
            if sync is not None:
                sync()
            optimizer.step()
            optimizer.zero_grad()
        slowest = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        return n / float(slowest)

    for name in arms:
        run(name, warm_up)
    rates = {name: [] for name in arms}
    names = list(arms)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            rates[name].append(run(name, steps))
    arms["surviving"][2].close()
    if dist.get_rank() == 0:
        print(json.dumps({"rates": rates, "world": dist.get_world_size()}), flush=True)
    dist.destroy_process_group()


def in_the_lab(args) -> dict:
    from benchmarks.scaling import run_job

    hosts, per_host = (int(n) for n in args.lab.split("x"))
    outputs = run_job(hosts, per_host, ["surviving_overhead.py", "lab-rank", "--rounds", str(args.rounds),
                                        "--steps", str(args.steps)] + ["--without-commit"] * args.without_commit
                      + ["--compiled"] * args.compiled,
                      {}, args.rate, "torchrun", 3000, f"surviving overhead on {args.lab}")
    report = next(json.loads(line) for line in outputs[0].splitlines() if line.startswith("{"))
    rates = report["rates"]
    base = "compiled_alone" if args.compiled else "ddp_alone"
    alone = statistics.median(rates[base])
    for r in range(args.rounds):
        print(f"round {r}: " + ", ".join(f"{name} {rates[name][r]:.2f}" for name in rates) + " steps/s", flush=True)
    summary = {name: statistics.median(values) / alone for name, values in rates.items()}
    # the paired ratio: each round's arms ran back to back, so a round's load is shared
    floor = "compiled_alone" if args.compiled else "python_hook"
    summary[f"surviving_vs_{floor}"] = statistics.median(rates["surviving"]) / statistics.median(rates[floor])
    summary[f"paired_surviving_vs_{floor}"] = [s / h for s, h in zip(rates["surviving"], rates[floor])]
    return {"lab": args.lab, "rate": args.rate, "steps": args.steps, **report, "ratios_of_medians": summary}


def _round(tree: str, steps: int, **kind) -> float:
    """A job of 3 ranks whose smddp_lite (and test harness) come from ``tree``."""
    code = ("import json, sys; from tests import harness; "
            f"results = harness.launch('surviving_overhead:rank', 3, env={{'SMDDP_TRANSPORT': 'shm'}}, "
            f"pooled=False, timeout=600, steps={steps}, **{kind!r}); print(json.dumps([r.value for r in results]))")
    # this module by a top-level name, which neither tree's own packages shadow
    env = dict(os.environ, PYTHONPATH=f"{tree}{os.pathsep}{os.path.join(ROOT, 'benchmarks')}")
    done = subprocess.run([sys.executable, "-c", code], cwd=tree, env=env, capture_output=True, text=True, check=True)
    return statistics.median(json.loads(done.stdout.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", help="a checkout of the commit to compare against")
    parser.add_argument("--ddp", action="store_true", help="DDP with SurvivingSync against DDP alone, in this tree")
    parser.add_argument("--python-hook-floor", action="store_true",
                        help="with --ddp: a third arm, DDP with torch's Python all_reduce hook")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--lab", metavar="HOSTSxRANKS", help="the three DDP arms in one job in the lab (root)")
    parser.add_argument("--rate", default="1gbit", help="the lab's link rate")
    parser.add_argument("--without-commit", action="store_true",
                        help="with --lab: an ablation, SurvivingSync without its per-step commit call")
    parser.add_argument("--compiled", action="store_true",
                        help="with --lab: the compiled step (bfloat16 wire) alone and with SurvivingSync")
    if sys.argv[1:2] == ["lab-rank"]:  # one rank of the lab job, under torchrun
        known = parser.parse_args(sys.argv[2:])
        return lab_rank(known.rounds, known.steps, without_commit=known.without_commit, compiled=known.compiled)
    args = parser.parse_args()
    if args.lab:
        print(json.dumps(in_the_lab(args)))
        return
    if args.ddp == bool(args.baseline):
        parser.error("give --baseline TREE, --ddp or --lab")
    this, base, floor = [], [], []
    for n in range(args.rounds):
        if args.ddp:
            this.append(_round(ROOT, args.steps, ddp=True, surviving=True))
            base.append(_round(ROOT, args.steps, ddp=True, surviving=False))
            if args.python_hook_floor:
                floor.append(_round(ROOT, args.steps, ddp=True, surviving=False, python_hook=True))
                print(f"round {n}: DDP with torch's Python hook {floor[-1]:.2f} steps/s "
                      f"({floor[-1] / base[-1]:.3f}x DDP alone)", flush=True)
        else:
            this.append(_round(ROOT, args.steps))
            base.append(_round(os.path.abspath(args.baseline), args.steps))
        print(f"round {n}: this tree {this[-1]:.2f} steps/s, baseline {base[-1]:.2f} steps/s "
              f"({this[-1] / base[-1]:.3f}x)", flush=True)
    results = {"this": this, "baseline": base, "ratio_of_medians": statistics.median(this) / statistics.median(base),
               "paired_ratios": [t / b for t, b in zip(this, base)]}
    if floor:
        results.update(python_hook=floor, python_hook_ratio_of_medians=statistics.median(floor) / statistics.median(base))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
