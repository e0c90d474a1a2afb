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
    args = parser.parse_args()
    if args.ddp == bool(args.baseline):
        parser.error("give --baseline TREE or --ddp")
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
