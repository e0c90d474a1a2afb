"""Mechanism of the sharded step: which share of each bucket a rank owns, and the gathers that
bring every rank's updated share back.

Each bucket's flat buffers are padded to a multiple of the world size and cut into equal,
contiguous shares, rank r owning the r-th. Gradients are reduce-scattered into the owner's share
(in place, so ``.grad`` views over it read the reduced gradient), the owner updates its share of
the parameters and of the optimizer state, and an all-gather (in place again: each rank's input
is its share of the output) puts every rank's updated share into every rank's parameters. The
bytes on the wire are an all_reduce's; the state and the update are 1/world of it.

The gathers run while the step updates later buckets and while the next forward runs: a module's
forward first waits for the gathers of the buckets holding its own parameters.

With a bfloat16 wire the gradients cross in 16 bits, and gathering float32 parameters would send
1.5x the bytes of the all_reduce it replaces. So the updates cross in bfloat16 instead: the owner
rounds its share's update (new - old) to bfloat16, puts its share back to the old values, and
every rank, the owner too, adds the gathered rounded updates to the old parameters. The ranks stay
bitwise identical; each update carries bfloat16's 8 bits of mantissa (the gradients it came from
carried as many), while the parameters and the optimizer state keep float32. A float16 wire does
not do this (an update below float16's range, lr x weight decay x a small weight, would vanish).
"""

from __future__ import annotations

import dataclasses
import itertools
from datetime import timedelta

import torch
import torch.distributed as dist

from ..backend import agreement, numerics
from .buckets import Bucket

# torch 2.13 deprecates the *_into_tensor / *_tensor names (a FutureWarning on every call)
ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# how long a rank waits for the others to reach a collective that a script may call on one rank
# alone (a checkpoint written by rank 0 only): long enough for ranks that arrive seconds apart,
# short enough that the mistake is told instead of waiting out the group's timeout
ARRIVAL_WAIT_S = 120.0
_arrivals = itertools.count()


def check_every_rank_calls(what: str, world: int, rank: int) -> None:
    """Raise a clear error where ``what`` (a collective) is called on some ranks only: each rank
    posts its arrival in the job's store and waits ``ARRIVAL_WAIT_S`` for the others'."""
    wait_s = ARRIVAL_WAIT_S
    store = dist.distributed_c10d._get_default_store()
    prefix = f"smddp_lite/arrivals/{next(_arrivals)}"
    try:
        agreement.exchange_in_store(store, prefix, rank, world, what, timedelta(seconds=wait_s))
    except (dist.DistStoreError, RuntimeError):
        missing = agreement.absent(store, prefix, range(world))
        raise RuntimeError(
            f"smddp_lite (rank {rank}/{world}): {what} is a collective with shard_optimizer_state=True (each rank "
            f"holds only its share of the state), and rank(s) {missing} did not call it within {wait_s:.0f} s. Call it "
            "on every rank (each gets the full state), then write it from one: state = optimizer.state_dict(); "
            "if rank == 0: torch.save(state, path)") from None


@dataclasses.dataclass(frozen=True)
class Shard:
    """The share of every bucket that ``rank`` of ``world`` owns."""

    rank: int
    world: int

    def bounds(self, b: Bucket) -> tuple[int, int]:
        size = b.padded_numel // self.world
        return self.rank * size, (self.rank + 1) * size

    def of(self, b: Bucket, flat: torch.Tensor) -> torch.Tensor:
        lo, hi = self.bounds(b)
        return flat[lo:hi]

    @staticmethod
    def part(shard: "Shard | None", b: Bucket, flat: torch.Tensor) -> torch.Tensor:
        """The part of a bucket-sized buffer a rank reduces and updates: all of it when unsharded
        (``shard`` None), else its share."""
        return flat if shard is None else shard.of(b, flat)

    def overlap(self, b: Bucket, i: int) -> tuple[int, int, int] | None:
        """(start in the parameter, start in the share, length) of the part of ``b``'s ``i``-th
        parameter that this share holds, or None."""
        lo, hi = self.bounds(b)
        start, end = b.offsets[i], b.offsets[i] + b.params[i].numel()
        first, last = max(lo, start), min(hi, end)
        return (first - start, first - lo, last - first) if first < last else None


class ParameterGathers:
    """The in-flight all-gathers of updated parameter shares, one per bucket, and the forward
    pre-hooks and state_dict pre-hook on the model that wait for them."""

    def __init__(self, buckets: list[Bucket], shard: Shard, group, module: torch.nn.Module,
                 compiled: list[torch.nn.Module] = ()) -> None:
        """``compiled``: modules whose forward is torch.compile'd (``graph.compile_graphs``),
        innermost first. The wait for the parameters inside each is hooked on it, where it runs
        eagerly around the graph (a hook inside would be traced, and a wait breaks the graph); a
        parameter of a block waits at its block, not at the enclosing model."""
        self.buckets, self.shard, self.group = buckets, shard, group
        self._works: list = [None] * len(buckets)
        # buckets whose updates cross in bfloat16: their share's parameters before the update
        self._before = [torch.empty_like(shard.of(b, b.param_flat))
                        if b.wire_flat is not None and b.wire_flat.dtype == torch.bfloat16 else None
                        for b in buckets]
        bucket_of = {id(p): b.index for b in buckets for p in b.params}
        self._hooks = []
        waiters, claimed, inside = [], set(), set()
        for unit in compiled:
            owned = [p for p in unit.parameters() if id(p) not in claimed]
            claimed.update(id(p) for p in owned)
            inside.update(id(m) for m in unit.modules())
            waiters.append((unit, owned))
        waiters += [(m, [p for p in m._parameters.values() if p is not None])
                    for m in module.modules() if id(m) not in inside]
        for m, owned in waiters:
            mine = sorted({bucket_of[id(p)] for p in owned if id(p) in bucket_of})
            if mine:
                self._hooks.append(m.register_forward_pre_hook(self._waiter(mine)))
        self._hooks.append(module.register_state_dict_pre_hook(lambda *_: self.wait_all()))

    def _waiter(self, indices: list[int]):
        def wait_for_own_parameters(module, args) -> None:
            self.wait(indices)

        return wait_for_own_parameters

    def before_update(self, b: Bucket) -> None:
        """Called before ``b``'s share is updated: keep the old values its update is taken from."""
        if self._before[b.index] is not None:
            self._before[b.index].copy_(self.shard.of(b, b.param_flat))

    def launch(self, b: Bucket) -> None:
        """Called once ``b``'s share is updated: send it (or its rounded update) to every rank."""
        mine = self.shard.of(b, b.param_flat)
        before = self._before[b.index]
        if before is None:
            self._works[b.index] = ALL_GATHER(b.param_flat, mine, group=self.group, async_op=True)
            return
        update = self.shard.of(b, b.wire_flat)
        mine.sub_(before)
        update.copy_(mine)
        mine.copy_(before)  # every share holds the old values until the rounded updates are added
        self._works[b.index] = ALL_GATHER(b.wire_flat, update, group=self.group, async_op=True)

    def in_flight(self) -> list[int]:
        """Indices of the buckets whose gathers nobody has waited for yet."""
        return [i for i, work in enumerate(self._works) if work is not None]

    def wait(self, indices) -> None:
        for i in indices:
            work = self._works[i]
            if work is not None:
                self._works[i] = None
                work.wait()
                if self._before[i] is not None:
                    b = self.buckets[i]
                    numerics.add_widened_(b.param_flat, b.wire_flat)

    def wait_all(self) -> None:
        self.wait(range(len(self._works)))

    def detach(self) -> None:
        """The model was compiled again: finish what is in flight and remove the hooks."""
        self.wait_all()
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
