"""``smddp_lite.compile``'s step under ``SurvivingSync``: the compiled model keeps its buckets,
their overlap with backward and its fused optimizer step; the survivors regroup it instead of
compiling again.

The model's ``GradReducer`` keeps what a redo needs (``keep_local_gradients``): each bucket is
averaged in a wire buffer of its own, the 16-bit wire where one was asked for, so ``.grad`` holds
this rank's gradients until every bucket's average arrived, and a failed call is recorded
instead of raised, so backward ends. ``sync()`` then commits the step with one small call that
also carries rank 0's word (``surviving_control``): the count of waiting replacements and rank
0's module buffers, which the compiled model no longer broadcasts at forward; only then are the
averages copied into ``.grad``, over the rank's own gradients. After a loss the
survivors make the new group, point the reducer at it (its group and divisor) and average the
kept gradients again; clipping's norms are taken again from the new averages.

A survivor one step behind (its commit failed where another's completed) holds the step's
averages already, in its wire buffers: every member entered the commit, so every member's
averages had arrived. It needs only the commit's tensor, which the survivor ahead sends it.

The compile's bucket layout does not depend on the world size (without sharding or an 8-bit
wire, which are refused here), so a replacement compiled alone meets the members bucket for
bucket from the step it joins.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from .config import QUANTIZED_WIRE_DTYPES
from .surviving_control import RankZeroControl


class CompiledSteps:
    """What SurvivingSync plugs into a compiled model, used as it uses ``DDPBuckets``."""

    def __init__(self, model, tickets: Callable[[], int]) -> None:
        config = model.config
        refuse_compile_settings(config)
        self.model, self.reducer, self.tickets = model, model.reducer, tickets
        # empty: every step's buckets are reduced by the reducer, replacements' included
        self.flat_steps: set[int] = set()
        wire = getattr(torch, config.wire_dtype) if config.wire_dtype else None
        self.reducer.keep_local_gradients(wire)
        # rank 0's buffers ride in the commit: the forward broadcast is turned off. From the
        # compile's setting, not the model's (off in a replacement compiled alone)
        buffers = [b for b in model.module.buffers() if b.numel()] if config.broadcast_buffers else []
        model.broadcast_buffers = False
        device = next(model.module.parameters()).device
        self.control = RankZeroControl(buffers, device)

    def finish(self) -> BaseException | None:
        """After backward: the step's first failed call, or None when every average arrived."""
        failure, self.reducer.failure = self.reducer.failure, None
        return failure

    def commit_tensor(self, step: int) -> torch.Tensor:
        return self.control.fill(step, self.tickets())

    def arrived(self, step: int) -> int:
        """The step committed: its averages into ``.grad``; returns rank 0's ticket count."""
        self.reducer.take_averages()
        return self.control.arrived(step)

    def reduce_again(self, step: int) -> None:
        """Average this step's kept gradients in the current group; the ticket count comes with
        the commit that follows."""
        self.reducer.reduce_again()

    def averages(self, step: int) -> list[torch.Tensor]:
        """What a survivor ahead sends the ones behind: only the commit's tensor (they hold the averages)."""
        return [self.control.of(step)]

    def unpack(self, step: int) -> int:
        return self.arrived(step)

    def layout(self) -> list[tuple[int, str, str]]:
        """Each bucket's size, dtype and wire dtype, which a replacement's must match."""
        return [(b.numel, str(b.dtype).replace("torch.", ""), str(b.wire_flat.dtype).replace("torch.", ""))
                for b in self.reducer.buckets]

    def newcomers_at(self, step: int) -> None:
        """Replacements train ``step`` through the same buckets: nothing to arrange."""

    def regrouped(self, admitted: bool) -> None:
        self.reducer.regroup(dist.group.WORLD, dist.get_world_size())


def refuse_compile_settings(config) -> None:
    """The compile settings whose state a loss would take with it, each refused with the way out."""
    said = "SurvivingSync cannot keep this smddp_lite.compile model going after a loss:"
    if config.shard_optimizer_state:
        raise ValueError(f"{said} shard_optimizer_state=True keeps each part of the optimizer state on one rank "
                         "only, which a loss takes with it. Compile without it (every rank then holds the state).")
    if config.wire_dtype in QUANTIZED_WIRE_DTYPES:
        raise ValueError(f"{said} the {config.wire_dtype} wire lays its blocks out by the world size, which a "
                         "loss changes. Use wire_dtype=torch.bfloat16 (or float16).")
