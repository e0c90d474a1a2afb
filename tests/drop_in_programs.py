"""Programs of test_drop_in.py: smddp where a script used gloo.

Each program runs on every rank of a test job (see harness.py) and returns what it observed."""

from __future__ import annotations

import torch
import torch.distributed as dist

import smddp_lite

from .rank_helpers import error_of


def integer_averages() -> dict:
    """AVG of integer tensors (a metric counter averaged by a training framework's DDP strategy,
    which torch's nccl accepts): all_reduce, reduce and reduce_scatter of int8, uint8, int32 and
    int64, against the sum divided by the group's size and truncated toward zero, as NCCL does.
    Values include negative sums and sums that are no multiple of the size. Which were wrong."""
    smddp_lite.init()
    rank, world = dist.get_rank(), dist.get_world_size()
    wrong = []
    for dtype in (torch.int8, torch.uint8, torch.int32, torch.int64):
        signed = dtype is not torch.uint8
        base = torch.arange(6 * world) % 7 - (3 if signed else 0)  # -3..3 (0..6 unsigned)

        def mine(r: int) -> torch.Tensor:
            return (base + r).to(dtype)

        total = sum(mine(r).to(torch.int64) for r in range(world))
        want = torch.div(total, world, rounding_mode="trunc").to(dtype)
        t = mine(rank)
        dist.all_reduce(t, op=dist.ReduceOp.AVG)
        if not torch.equal(t, want):
            wrong.append(f"all_reduce {dtype}: {t.tolist()} != {want.tolist()}")
        t = mine(rank)
        dist.reduce(t, dst=world - 1, op=dist.ReduceOp.AVG)
        if rank == world - 1 and not torch.equal(t, want):
            wrong.append(f"reduce {dtype}: {t.tolist()} != {want.tolist()}")
        out = torch.empty(6, dtype=dtype)
        dist.reduce_scatter_tensor(out, mine(rank), op=dist.ReduceOp.AVG)
        if not torch.equal(out, want[rank * 6 : (rank + 1) * 6]):
            wrong.append(f"reduce_scatter {dtype}: {out.tolist()} != {want[rank * 6 : (rank + 1) * 6].tolist()}")
    dist.destroy_process_group()
    return {"wrong": wrong}


def all_gather_coalesced_layout(backend: str = "smddp") -> dict:
    """``dist.all_gather_coalesced`` of two inputs of different shapes (torch requires one dtype)
    on ``backend``: what each rank's output lists hold (indexed by rank, then by input)."""
    import warnings

    warnings.filterwarnings("ignore", message=".*all_gather_coalesced.* will be deprecated")  # torch's own
    smddp_lite.init(backend=backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    inputs = [torch.full((2, 3), float(rank)), torch.arange(4.0) + 10 * rank]
    outputs = [[torch.empty_like(t) for t in inputs] for _ in range(world)]
    dist.all_gather_coalesced(outputs, inputs)
    report = {"outputs": [[t.tolist() for t in outs] for outs in outputs]}
    report["wrong_count"] = error_of(lambda: dist.all_gather_coalesced(outputs[:1], inputs))
    dist.destroy_process_group()
    return report


def warnings_of_compile() -> dict:
    """Every warning raised while compiling a model and running two steps, with the file that
    raised it: none may come from this project's modules."""
    import warnings

    smddp_lite.init()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        compiled, opt = smddp_lite.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-3), max_grad_norm=1.0)
        for _ in range(2):
            compiled(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
    dist.destroy_process_group()
    return {"warnings": [f"{w.filename}:{w.lineno}: {w.category.__name__}: {w.message}" for w in caught]}
