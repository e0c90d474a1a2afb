"""What the ranks of test_launcher.py's jobs run under ``python -m smddp_lite.launch``: one epoch
of a small model trained with SurvivingSync and an ElasticSampler, one rank of which may fail
once at a chosen step.

Run as ``python -m tests.launcher_programs MARKS STEPS [FAULT]``: the epoch has STEPS steps at
the first world size; FAULT is ``rank:step:kind[:ddp]`` (kind: sigkill, exit; ``ddp``: the model
is a DistributedDataParallel, made after ``smddp_lite.init()``), or ``all:start:exit``
(every process fails at once). Each process writes MARKS/<pid>.json at its end: its id, first
step, checksums, world sizes, when it started and when its first sync ended; and appends the
sample indices of every step it trained (its sync done) to MARKS/<pid>.samples."""

from __future__ import annotations

import time

STARTED_AT = time.time()  # before torch's import: a replacement's start, as its launcher sees it

import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import smddp_lite  # noqa: E402

from .surviving_programs import FEATURES, LR, model, step_done  # noqa: E402

STEP_S = 0.1  # the compute each step stands for, so that a replacement has steps left to join
PER_RANK = 4  # samples per rank and step


def dataset(size: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(size, FEATURES, generator=torch.Generator().manual_seed(7))
    return x, x.sum(1, keepdim=True) * 0.5 + 1.0


def main(marks: str, steps: int, fault: str = "") -> None:
    who, at, kind, wrap = (fault.split(":") + ["", "", "", ""])[:4]
    if who == "all":
        sys.exit(3)
    net = model()
    if wrap == "ddp":  # a replacement's init() makes a group of one to make DDP on
        smddp_lite.init()
        net = torch.nn.parallel.DistributedDataParallel(net, bucket_cap_mb=1e-5)
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    xs, ys = dataset(steps * PER_RANK * int(os.environ["WORLD_SIZE"]))
    sampler = smddp_lite.ElasticSampler(len(xs), PER_RANK, seed=3)
    sync = smddp_lite.SurvivingSync(net, optimizer, sampler=sampler)
    first_step, checksums, worlds, first_sync_at = sync.step, [], [], None
    # the fault happens once in the job: a replacement in the same place does not repeat it
    faulting = who == os.environ["RANK"] and first_step == 0
    trained = Path(marks, f"{os.getpid()}.samples").open("a")
    for indices in sampler:  # one epoch
        # DDP averages during backward: its rank fails before it, the others' before their sync
        if faulting and sync.step == int(at) and wrap == "ddp":
            _fail(kind)
        if indices:  # the epoch's last step may leave a rank no sample: it adds a zero gradient
            torch.nn.functional.mse_loss(net(xs[indices]), ys[indices]).backward()
        time.sleep(STEP_S)
        if faulting and sync.step == int(at):
            _fail(kind)
        sync()
        trained.write(json.dumps(indices) + "\n")
        trained.flush()
        first_sync_at = first_sync_at or time.time()
        step_done(net, optimizer, sync, checksums, worlds)
    sync.close()
    dist.destroy_process_group()
    Path(marks, f"{os.getpid()}.json").write_text(json.dumps(
        {"id": sync.first_rank, "first_step": first_step, "checksums": checksums, "worlds": worlds,
         "started_at": STARTED_AT, "first_sync_at": first_sync_at}))


def _fail(kind: str) -> None:
    if kind == "exit":
        os._exit(5)
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), *sys.argv[3:])
