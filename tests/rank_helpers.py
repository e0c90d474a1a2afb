"""What the programs of several test files share: how a rank reports an error, waits for its peers, and
trains the small model the parity programs compare.

Each program runs on every rank of a test job (see harness.py) and returns what it observed."""

from __future__ import annotations

import time
from typing import Callable

import torch
import torch.distributed as dist


def error_of(fn) -> dict:
    """Run ``fn``; return the exception it raised (type, message, seconds until it raised)."""
    start = time.monotonic()
    try:
        fn()
    except Exception as exc:
        return {"type": type(exc).__name__, "message": str(exc), "seconds": time.monotonic() - start,
                "backend_error": isinstance(exc, dist.DistBackendError),
                "classes": [c.__name__ for c in type(exc).__mro__]}
    return {"type": None, "message": "", "seconds": time.monotonic() - start, "backend_error": False}


def still_works() -> bool:
    t = torch.ones(5)
    dist.all_reduce(t)
    return bool((t == dist.get_world_size()).all())


def stay_until_peers_report(store, peers) -> None:
    """Keep this rank alive until each of ``peers`` set ``test-reported/<rank>``: the peers must
    learn of this rank's refusal from the group, not from its sockets closing as it exits.
    Polls: a blocking ``wait`` would hold the store client, which the communication thread
    needs to post the refusal (a TCPStore client serves one request at a time)."""
    keys = [f"test-reported/{r}" for r in peers]
    deadline = time.monotonic() + 60
    while not store.check(keys) and time.monotonic() < deadline:
        time.sleep(0.01)


def let_gloo_workers_finish() -> None:
    """Call before freeing what holds torch's own gloo group (a DDP, FSDP or pipeline model over
    it, or destroying the groups). Its worker thread frees a finished call's tensors after the
    wait returns and needs the GIL for it, while freeing the group (~ProcessGroupGloo) joins that
    thread holding the GIL: under load (1 run in about 25) a rank hung there at a program's
    return (py-spy). Sleeping lets the worker run first. A deadlock inside torch, not smddp."""
    time.sleep(0.1)


def bytes_sent(interface: str = "eth0") -> int:
    """Bytes this process's network namespace has sent on ``interface`` (/proc/net/dev is the
    reader's namespace: on a simulated host, its link to the others)."""
    for line in open("/proc/net/dev"):
        name, _, counters = line.partition(":")
        if name.strip() == interface:
            return int(counters.split()[8])  # receive has 8 columns, then transmit bytes
    raise RuntimeError(f"no interface {interface} in /proc/net/dev: run this on a simulated host")


def parity_model() -> torch.nn.Module:
    """The small MLP the parity programs train, the same weights on every rank and call."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(33, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64),
                               torch.nn.ReLU(), torch.nn.Linear(64, 5))


def parity_batches(rank: int, steps: int):
    """``steps`` batches of 16 samples, each rank its own shard of data, labelled by a fixed
    random teacher (a learnable task)."""
    teacher = torch.randn(33, 5, generator=torch.Generator().manual_seed(7))
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        x = torch.randn(16, 33, generator=gen)
        yield x, (x @ teacher).argmax(1)


def train_side_by_side(variants: dict, rank: int, steps: int, momentum: float = 0.9,
                        before_step: Callable[[str, torch.nn.Module], None] | None = None) -> dict[str, list[float]]:
    """Train each of ``variants`` (name: model) with its own SGD on the same batches; returns
    each one's losses. ``before_step(name, model)`` runs between backward and step."""
    optims = {k: torch.optim.SGD(m.parameters(), lr=0.05, momentum=momentum) for k, m in variants.items()}
    losses = {k: [] for k in variants}
    for x, y in parity_batches(rank, steps):
        for name, model in variants.items():
            optims[name].zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            if before_step is not None:
                before_step(name, model)
            optims[name].step()
            losses[name].append(loss.item())
    return losses
