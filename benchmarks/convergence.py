"""Does an 8-bit wire with error feedback train as float32 DDP does? Loss curves over many steps.

A classifier (64 -> 256 -> 256 -> 10, 85k parameters) learns the labels a fixed random teacher
network gives Gaussian inputs, on data this script generates: each rank its own batches of 64,
AdamW (lr 1e-3, weight decay 0.01), for ``--steps`` steps. Per seed (the student's weights and
every rank's batches), every variant trains from the same start on the same batches:

- ``ddp-float32``: DDP + torch.optim.AdamW, float32 gradients (the reference);
- ``compiled-bfloat16``: ``smddp_lite.compile(..., wire_dtype=torch.bfloat16)``;
- ``compiled-int8``, ``compiled-float8_e4m3fn``: the 8-bit wire with error feedback.

Every ``--eval-every`` steps, the loss on 4096 held-out samples. One job per seed (a torchrun of
2 ranks); the driver runs them, then writes a table of the final held-out loss per seed and
variant, the float32 runs' spread, and a plot of the curves::

    python -m benchmarks.convergence --seeds 0,1,2 --steps 2000 --out benchmarks/results/<date>-convergence-8-bit-wire
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

VARIANTS = ("ddp-float32", "compiled-bfloat16", "compiled-int8", "compiled-float8_e4m3fn")


def _teacher_and_held_out(torch):
    gen = torch.Generator().manual_seed(1234)  # the task is the same for every seed
    teacher = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 10))
    with torch.no_grad():
        for p in teacher.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 1.5 / p.shape[-1] ** 0.5)
        x = torch.randn(4096, 64, generator=gen)
        return teacher, x, teacher(x).argmax(1)


def train(seed: int, steps: int, eval_every: int, variants: list[str]) -> None:
    """One seed, every variant in turn; rank 0 prints one JSON line of the curves."""
    import torch
    import torch.distributed as dist

    import smddp_lite

    smddp_lite.init()
    rank = dist.get_rank()
    teacher, held_x, held_y = _teacher_and_held_out(torch)
    curves = {}
    for variant in variants:
        torch.manual_seed(seed)
        module = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                     torch.nn.ReLU(), torch.nn.Linear(256, 10))
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3, weight_decay=0.01)
        if variant == "ddp-float32":
            model = torch.nn.parallel.DistributedDataParallel(module)
        else:
            model, optimizer = smddp_lite.compile(module, optimizer, bucket_cap_mb=0.25, first_bucket_mb=0.05,
                                                  wire_dtype=getattr(torch, variant.split("-", 1)[1]))
        data = torch.Generator().manual_seed(seed * 1000 + rank)
        held_out = []
        for step in range(1, steps + 1):
            x = torch.randn(64, 64, generator=data)
            with torch.no_grad():
                y = teacher(x).argmax(1)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
            if step % eval_every == 0 or step == 1:
                with torch.no_grad():
                    held_out.append((step, float(torch.nn.functional.cross_entropy(module(held_x), held_y))))
        curves[variant] = held_out
    if rank == 0:
        print("CURVES " + json.dumps({"seed": seed, "curves": curves}), flush=True)
    dist.destroy_process_group()


def drive(args) -> None:
    runs = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.ranks),
               "-m", "benchmarks.convergence", "--job", "--seed", str(seed), "--steps", str(args.steps),
               "--eval-every", str(args.eval_every), "--variants", args.variants]
        out = subprocess.run(cmd, capture_output=True, text=True, check=False, env=dict(os.environ, OMP_NUM_THREADS="1"))
        line = next((ln for ln in out.stdout.splitlines() if ln.startswith("CURVES ")), None)
        if out.returncode or line is None:
            sys.exit(f"seed {seed} failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
        runs.append(json.loads(line[len("CURVES "):]))
        print(f"seed {seed}: " + ", ".join(f"{v} {c[-1][1]:.4f}" for v, c in runs[-1]["curves"].items()), flush=True)
    variants = list(runs[0]["curves"])
    final = {v: [run["curves"][v][-1][1] for run in runs] for v in variants}
    reference = final["ddp-float32"]
    spread = max(reference) - min(reference)
    lines = [f"{args.ranks} ranks, {args.steps} steps, seeds {args.seeds}: held-out loss at the last step", "",
             "| variant | " + " | ".join(f"seed {run['seed']}" for run in runs) + " | mean | mean - float32's mean |",
             "|---|" + "---:|" * (len(runs) + 2)]
    for v in variants:
        mean = statistics.fmean(final[v])
        lines.append(f"| {v} | " + " | ".join(f"{x:.4f}" for x in final[v]) +
                     f" | {mean:.4f} | {mean - statistics.fmean(reference):+.4f} |")
    lines += ["", f"float32 DDP's run-to-run spread (largest - smallest final loss): {spread:.4f}"]
    for v in variants[1:]:
        gap = abs(statistics.fmean(final[v]) - statistics.fmean(reference))
        lines.append(f"- {v}: its mean is {gap:.4f} from float32's, {'within' if gap <= spread else 'outside'} "
                     "that spread")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out + ".json", "w") as f:
            json.dump({"ranks": args.ranks, "steps": args.steps, "runs": runs}, f)
        with open(args.out + ".md", "w") as f:
            f.write(text)
        _plot(runs, variants, args.out + ".png")


def _plot(runs, variants, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot (pip install -e '.[bench]')")
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for v in variants:
        steps = [s for s, _ in runs[0]["curves"][v]]
        per_step = list(zip(*[[loss for _, loss in run["curves"][v]] for run in runs]))
        ax.plot(steps, [statistics.fmean(x) for x in per_step], label=v)
        ax.fill_between(steps, [min(x) for x in per_step], [max(x) for x in per_step], alpha=0.2)
    ax.set_xlabel("step")
    ax.set_ylabel("held-out cross-entropy (mean of seeds; band: min-max)")
    ax.set_yscale("log")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--out", default=None, help="path prefix of the .md, .json and .png written")
    parser.add_argument("--job", action="store_true", help=argparse.SUPPRESS)  # one seed, under torchrun
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        train(args.seed, args.steps, args.eval_every, args.variants.split(","))
    else:
        drive(args)


if __name__ == "__main__":
    main()
