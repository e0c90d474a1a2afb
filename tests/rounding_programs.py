"""Programs of test_16_bit_rounding.py: where 16-bit sums and means are rounded, inside a host and
between hosts.

Each program runs on every rank of a test job (see harness.py) and returns what it observed."""

from __future__ import annotations

import torch
import torch.distributed as dist

import smddp_lite


def wire_rounding(numel: int = 4096) -> list[float]:
    """One all_reduce whose bfloat16 partial sums round differently from its float32 sum: rank 0
    gives 1, every other rank 2**-8 (with 3 ranks: 1 + 2**-8 is a tie that rounds back to 1 in
    bfloat16, while the float32 sum 1 + 2**-7 is exact in it). Returns the distinct results."""
    smddp_lite.init()
    t = torch.full((numel,), 1.0 if dist.get_rank() == 0 else 2.0**-8)
    dist.all_reduce(t)
    dist.destroy_process_group()
    return sorted(set(t.tolist()))


def reduce_scatter_rounding(dtype: str, numel_per_rank: int = 1024) -> list[float]:
    """One reduce_scatter_tensor whose inputs round differently in bfloat16 than in float32:
    rank 0 gives 1 + 2**-9 (which rounds to 1 in bfloat16), every other rank 2**-8. Returns the
    distinct values of this rank's result."""
    smddp_lite.init()
    world = dist.get_world_size()
    first = 1.0 + 2.0**-9 if dtype == "float32" else 1.0
    inp = torch.full((numel_per_rank * world,), first if dist.get_rank() == 0 else 2.0**-8, dtype=getattr(torch, dtype))
    out = torch.empty(numel_per_rank, dtype=inp.dtype)
    dist.reduce_scatter_tensor(out, inp)
    dist.destroy_process_group()
    return sorted(set(out.float().tolist()))


def _host_shares_rounded(blocks: list[torch.Tensor], ranks_per_host: int, kind: torch.dtype) -> dict:
    """Two references for a 16-bit AVG that crosses hosts in ``kind``, from every rank's
    ``blocks`` (in rank order, hosts of ``ranks_per_host`` consecutive ranks): each host's float32
    sum ("host sums rounded") or mean ("host means rounded") rounded to ``kind`` once, those
    summed in float32 in host order, divided by the ranks (or the hosts) and rounded once."""
    world = len(blocks)
    hosts = range(0, world, ranks_per_host)
    sums = [torch.stack(blocks[k : k + ranks_per_host]).float().sum(0) for k in hosts]
    references = {}
    for name, shares, divisor in (("host_sums_rounded", sums, world),
                                  ("host_means_rounded", [s / ranks_per_host for s in sums], len(sums))):
        total = shares[0].to(kind).float()
        for share in shares[1:]:
            total += share.to(kind)
        references[name] = (total / divisor).to(kind)
    return references


def all_reduce_16_bit_avg(ranks_per_host: int, dtype: str = "bfloat16", numel: int = 1 << 16) -> dict:
    """A 16-bit AVG all_reduce of random values (seeded by rank) on hosts of ``ranks_per_host``
    ranks each, against references this rank computes from every rank's input: the mean in
    float32 rounded once ("widened", what the algorithms layer's float32 copy gives), and the two
    of _host_shares_rounded (a SUM's rounding plus a division before the last rounding; or each
    host's mean rounded, as float16 crosses hosts). Returns whether the result equals each, in how
    many elements each differs from "widened", and in how many the two host references differ."""
    smddp_lite.init()
    rank, world = dist.get_rank(), dist.get_world_size()
    kind = getattr(torch, dtype)
    inputs = [torch.randn(numel, generator=torch.Generator().manual_seed(r)).to(kind) for r in range(world)]
    out = inputs[rank].clone()
    dist.all_reduce(out, op=dist.ReduceOp.AVG)
    references = {"widened": (torch.stack(inputs).float().sum(0) / world).to(kind),
                  **_host_shares_rounded(inputs, ranks_per_host, kind)}
    dist.destroy_process_group()
    return {**{name: bool(torch.equal(out, ref)) for name, ref in references.items()},
            "differ_from_widened_in": {name: int((ref != references["widened"]).sum())
                                       for name, ref in references.items()},
            "means_differ_from_sums_in": int((references["host_means_rounded"] != references["host_sums_rounded"]).sum())}


def without_shared_memory(program: str, **kwargs):
    """``program`` (a function of this module) where /dev/shm cannot serve ranks, as on non-x86
    machines: hosts of several ranks then reduce among them with gloo (select._shm_possible)."""
    from smddp_lite.backend.transports import select

    possible = select._shm_possible
    select._shm_possible = lambda: False
    try:
        return globals()[program](**kwargs)
    finally:
        select._shm_possible = possible


def float16_avg_of_large_values(numel: int = 1 << 18) -> dict:
    """float16 AVG all_reduce and reduce_scatter_tensor of 40000 + 64 x rank on every element:
    any two ranks' sum exceeds float16's largest value (65504), their means do not, and every
    mean of 2 or 4 of them is exact in float16. Returns the set of values each call gave."""
    smddp_lite.init()
    rank, world = dist.get_rank(), dist.get_world_size()
    values = torch.full((numel,), 40000.0 + 64 * rank, dtype=torch.float16)
    reduced = values.clone()
    dist.all_reduce(reduced, op=dist.ReduceOp.AVG)
    scattered = torch.empty(numel // world, dtype=torch.float16)
    dist.reduce_scatter_tensor(scattered, values, op=dist.ReduceOp.AVG)
    dist.destroy_process_group()
    return {"all_reduce": sorted(set(reduced.tolist())), "reduce_scatter": sorted(set(scattered.tolist()))}


def reduce_scatter_16_bit_sums(dtype: str, op: str, numel_per_rank: int = 4096, ranks_per_host: int | None = None) -> dict:
    """A 16-bit reduce_scatter_tensor of random values (seeded by rank), against two references
    this rank computes from every rank's input: summed in float32 and rounded once (after the
    division, for AVG), and summed in the 16-bit dtype itself. Returns whether the result equals
    each, and how many elements the two references differ in (so the check can fail). With
    ``ranks_per_host``, for AVG: also _host_shares_rounded's references (as "float32_once" in
    "differ_from_once_in")."""
    smddp_lite.init()
    rank, world = dist.get_rank(), dist.get_world_size()
    kind = getattr(torch, dtype)
    inputs = [torch.randn(numel_per_rank * world, generator=torch.Generator().manual_seed(r)).to(kind)
              for r in range(world)]
    out = torch.empty(numel_per_rank, dtype=kind)
    dist.reduce_scatter_tensor(out, inputs[rank], op=getattr(dist.ReduceOp, op))
    mine = torch.stack([x.view(world, -1)[rank] for x in inputs])  # (world, n): my block from every rank
    wide = mine.float().sum(0)
    narrow = mine[0].clone()
    for block in mine[1:]:
        narrow += block
    if op == "AVG":
        wide, narrow = wide / world, narrow / world
    once = wide.to(kind)
    shared = _host_shares_rounded(list(mine), ranks_per_host, kind) if ranks_per_host and op == "AVG" else {}
    dist.destroy_process_group()
    return {"float32_once": bool(torch.equal(out, once)), "in_16_bit": bool(torch.equal(out, narrow)),
            "references_differ_in": int((once != narrow).sum()),
            **{name: bool(torch.equal(out, ref)) for name, ref in shared.items()},
            "differ_from_once_in": {name: int((ref != once).sum()) for name, ref in shared.items()}}
