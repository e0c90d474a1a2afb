"""What every rank of test_surviving.py's jobs runs: a small model trained with SurvivingSync,
one of whose ranks fails at a chosen step."""

from __future__ import annotations

import os
import signal
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import smddp_lite
from smddp_lite.surviving import RankDeclaredLostError, SurvivingSync, TooFewRanksError

FEATURES, BATCH, LR = 8, 16, 0.05


def batch(first_rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The samples a rank (numbered as in the job's first group) trains on at a step."""
    g = torch.Generator().manual_seed(1000 * first_rank + step)
    x = torch.randn(BATCH, FEATURES, generator=g)
    return x, x.sum(1, keepdim=True) * 0.5 + 1.0


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(FEATURES, 1)


def train(steps: int, faults: dict, marks: str, group_timeout_s: float = 4.0, min_world_size: int = 1) -> dict:
    """Train ``steps`` steps; ``faults`` maps a rank (as a string) to (kind, step): "sigkill" (killed
    while it syncs), "exit" (os._exit before its sync), "sigstop" (stopped before its sync and
    killed at the end), "sigstop_resume" (stopped, and let go on once the others went on without
    it). Returns, per completed step, the parameters' checksum and the world size, and each
    change; or the error that ended this rank's training, where SurvivingSync raised one of its own."""
    smddp_lite.init(timeout=timedelta(seconds=group_timeout_s))
    rank = dist.get_rank()
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    changes = []

    def changed(c) -> None:
        changes.append({"generation": c.generation, "lost": list(c.lost), "members": list(c.members),
                        "rank": c.rank, "world_size": c.world_size, "step": c.step, "seconds": c.seconds,
                        "at": time.time()})
        stopped = Path(marks, "stopped")
        if c.rank == 0 and "sigstop_resume" in [k for k, _ in faults.values()] and stopped.exists():
            os.kill(int(stopped.read_text()), signal.SIGCONT)

    sync = SurvivingSync(net, min_world_size=min_world_size, on_change=changed)
    kind, fault_step = faults.get(str(rank), (None, -1))
    checksums, worlds = [], []
    try:
        _steps(net, optimizer, sync, rank, steps, kind, fault_step, marks, checksums, worlds)
    except (RankDeclaredLostError, TooFewRanksError) as exc:
        sync.close()
        return {"error": type(exc).__name__, "message": str(exc), "checksums": checksums}
    sync.close()
    stopped = Path(marks, "stopped")
    if stopped.exists() and sync.rank == 0 and "sigstop" in [k for k, _ in faults.values()]:
        os.kill(int(stopped.read_text()), signal.SIGKILL)  # nothing may outlive the job
    dist.destroy_process_group()
    return {"checksums": checksums, "worlds": worlds, "changes": changes, "first_rank": rank}


def _steps(net, optimizer, sync, rank, steps, kind, fault_step, marks, checksums, worlds) -> None:
    for step in range(steps):
        x, y = batch(rank, step)
        torch.nn.functional.mse_loss(net(x), y).backward()
        if step == fault_step:
            Path(marks, f"fault-{rank}").write_text(repr(time.time()))
            if kind == "exit":
                os._exit(3)
            if kind in ("sigstop", "sigstop_resume"):
                Path(marks, "stopped").write_text(str(os.getpid()))
                os.kill(os.getpid(), signal.SIGSTOP)
            if kind == "sigkill":
                threading.Thread(target=os.kill, args=(os.getpid(), signal.SIGKILL), daemon=True).start()
        sync()
        optimizer.step()
        optimizer.zero_grad()
        checksums.append(sum(float(p.detach().double().sum()) for p in net.parameters()))
        worlds.append(sync.world_size)
