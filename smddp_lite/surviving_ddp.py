"""DistributedDataParallel under ``SurvivingSync``: DDP keeps its buckets and their overlap with
backward, through a comm hook that never raises and keeps what a redo needs.

The hook averages each bucket into a buffer of its own (divided by the world size as it is
copied, ``numerics.share_of_mean``, then an asynchronous all_reduce), two sets of buffers by step
parity, because a survivor one step ahead must still hold the average that the others missed. A failed call is recorded, never raised:
its future completes with the bucket's own gradients, so backward ends and ``sync()`` can settle
the step. The bucket's gradients before the average stay where the redo finds them: in DDP's
bucket, which it copies into ``param.grad`` from our buffer and does not overwrite, or, with
``gradient_as_bucket_view`` (where ``param.grad`` is the bucket), in a copy the hook keeps.

Rank 0's count of waiting replacements rides as one element more of bucket 0's average. Where
the module has buffers to send (or bucket 0 is not float32 or float64), bucket 0's hook launches
one small float64 call instead: the count and rank 0's module buffers (the others send zeros),
which replaces DDP's broadcast of buffers at the next forward (a broadcast there would raise
from forward on a loss). Redone after a loss,
the buckets go in bucket order with that call after bucket 0, as the hooks launch them, so that
a survivor one step behind (whose hooks run the next backward) meets the redo call for call.
"""

from __future__ import annotations

import sys
from typing import Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from .backend import numerics
from .surviving_control import RankZeroControl


class DDPBuckets:
    """The comm hook SurvivingSync registers on a DDP model, and what it kept of each step."""

    def __init__(self, ddp: DistributedDataParallel, tickets: Callable[[], int], step: Callable[[], int]) -> None:
        refuse_ddp_settings(ddp)
        self.ddp, self.tickets, self.step = ddp, tickets, step  # step(): the sync the hooks reduce for
        self.view = bool(ddp.gradient_as_bucket_view)
        # the steps (of the last two) whose buckets are not reduced: SurvivingSync averages them flat
        self.flat_steps: set[int] = set()
        self.failure: BaseException | None = None  # the first failed call of this step
        self._params: dict[int, list[torch.Tensor]] = {}  # bucket index -> its parameters, in bucket order
        self._grads: dict[int, torch.Tensor] = {}  # bucket index -> its gradients before the average
        self._kept: dict[int, torch.Tensor] = {}  # with bucket views: the copy of them the hook keeps
        self._averages: list[dict[int, torch.Tensor]] = [{}, {}]  # by step parity, then bucket index
        # rank 0's buffers ride in the control call: DDP's own broadcast of them is turned off
        self.buffers = [b for b in ddp.module.buffers()] if ddp.forward_sync_buffers else []
        ddp.forward_sync_buffers = False
        self.control = RankZeroControl(self.buffers, next(ddp.module.parameters()).device)
        self._control_work: dist.Work | None = None
        ddp.register_comm_hook(None, self._hook)

    # during backward ------------------------------------------------------------------------------
    # unannotated: DDP checks a hook's annotations as objects, which this module's are not (strings)
    def _hook(self, _state, bucket):
        i, grads = bucket.index(), bucket.buffer()
        known = self._grads.get(i)
        # a new layout (DDP rebuilt its buckets): the old buckets are held here, so new ones lie elsewhere
        if known is None or known.data_ptr() != grads.data_ptr() or known.numel() != grads.numel():
            if i == 0:  # bucket 0's hook runs first: a new layout, whose bucket count may differ
                for kept in (self._params, self._grads, self._kept, *self._averages):
                    kept.clear()
            self._params[i], self._grads[i] = list(bucket.parameters()), grads
            for averages in self._averages:
                averages.pop(i, None)
            self._kept.pop(i, None)
        if self.view:
            kept = self._kept.get(i)
            if kept is None or kept.shape != grads.shape:
                kept = self._kept[i] = torch.empty_like(grads)
            kept.copy_(grads)
        step = self.step()
        if step in self.flat_steps or self.failure is not None:
            return _completed(grads)  # DDP leaves the gradients as they are; sync() settles the step
        try:
            average, part = self._prepare(step, i, grads)
            future = dist.all_reduce(average, async_op=True).get_future()
            if i == 0 and not self._rides(0, grads):
                self._control_work = dist.all_reduce(self.fill_control(step), async_op=True)
        except dist.DistError as failure:  # the group already failed on this rank
            self.failure = self.failure or failure
            return _completed(grads)

        def arrived(done: torch.futures.Future) -> torch.Tensor:
            try:
                done.value()
            except Exception as failure:  # a lost rank: recorded, settled by sync()
                self.failure = self.failure or failure
                return grads
            return part

        return future.then(arrived)

    def _rides(self, i: int, grads: torch.Tensor) -> bool:
        """Whether the ticket count rides as one element more of this bucket's average, which
        saves the control call: bucket 0, no buffers to send, and a type exact for counts."""
        return i == 0 and not self.buffers and grads.dtype in (torch.float32, torch.float64)

    def _average_buffer(self, step: int, i: int, grads: torch.Tensor) -> torch.Tensor:
        averages = self._averages[step % 2]
        average = averages.get(i)
        size = grads.numel() + self._rides(i, grads)
        if average is None or average.numel() != size or average.dtype != grads.dtype:
            average = averages[i] = torch.empty(size, dtype=grads.dtype, device=grads.device)
        return average

    def _prepare(self, step: int, i: int, grads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Bucket ``i``'s gradients over the world size in ``step``'s buffer, and the ticket count
        where it rides there; returns what is reduced and the part of it that is the bucket."""
        average = self._average_buffer(step, i, grads)
        part = average[:grads.numel()]
        numerics.share_of_mean(grads, dist.get_world_size(), out=part)
        if average.numel() > grads.numel():
            average[-1] = self.tickets() if dist.get_rank() == 0 else 0
        return average, part

    def fill_control(self, step: int) -> torch.Tensor:
        return self.control.fill(step, self.tickets())

    # in sync() ------------------------------------------------------------------------------------
    def finish(self) -> BaseException | None:
        """After backward: wait for the control call; the step's first failure, or None when every
        bucket's average arrived (DDP then wrote them into ``param.grad``)."""
        work, self._control_work = self._control_work, None
        if work is not None:  # waited for even after a failure: nothing of the step stays in flight
            try:
                work.wait()
            except dist.DistError as failure:
                self.failure = self.failure or failure
        return self.failure

    def arrived(self, step: int) -> int:
        """Apply rank 0's buffers from ``step``'s control call; returns rank 0's ticket count."""
        if self._rides(0, self._grads[0]):
            return int(self._averages[step % 2][0][-1].item())
        return self.control.arrived(step)

    def send_buffers(self, step: int) -> None:
        """In a step averaged flat: rank 0's buffers to every rank, in a call of their own."""
        if self.buffers:
            dist.all_reduce(self.fill_control(step))
            self.control.arrived(step)

    def reduce_again(self, step: int) -> None:
        """Average this step's buckets in the current group from the gradients kept, in the order
        the hooks launch them, into ``param.grad`` (``arrived`` then reads the control call)."""
        self.failure = None
        for i in sorted(self._params):
            grads = self._kept[i] if self.view else self._grads[i]
            average, part = self._prepare(step, i, grads)
            dist.all_reduce(average)
            if i == 0 and not self._rides(0, grads):
                dist.all_reduce(self.fill_control(step))
            self._write(i, part)

    def restore_local_gradients(self) -> None:
        """Write this rank's own gradients of the step, kept where ``reduce_again`` finds them,
        back into ``param.grad``: a redo in a group with replacements averages them flat."""
        self.failure = None
        for i in sorted(self._params):
            self._write(i, self._kept[i] if self.view else self._grads[i])

    def averages(self, step: int) -> list[torch.Tensor]:
        """What a survivor ahead sends the ones behind: ``step``'s averages and its control call."""
        buckets = sorted(self._params)
        return [self._average_buffer(step, i, self._grads[i]) for i in buckets] + [self.control.of(step)]

    def unpack(self, step: int) -> int:
        """Write ``step``'s averages (received from a survivor ahead) into ``param.grad``."""
        self.failure = None
        for i in sorted(self._params):
            self._write(i, self._averages[step % 2][i])
        return self.arrived(step)

    def _write(self, i: int, average: torch.Tensor) -> None:
        at = 0
        with torch.no_grad():
            for p in self._params[i]:
                p.grad.copy_(average[at:at + p.numel()].view_as(p.grad))
                at += p.numel()

    def commit_tensor(self, step: int) -> torch.Tensor | None:
        """None: the commit carries nothing of DDP's, whose count and buffers rode in the step's own calls."""

    def layout(self) -> None:
        """None: a replacement's DDP makes its layout at its first forward, from the others'."""

    def newcomers_at(self, step: int) -> None:
        """Replacements make their first bucket layout at their next forward: ``step`` is averaged flat."""
        self.flat_steps.add(step)

    def regrouped(self, admitted: bool) -> None:
        """Point DDP at the new default group. After an admission every rank also rebuilds its
        buckets at the next forward, as DDP's own ``_update_process_group`` arranges, so that the
        replacement's first layout meets the others'; after a loss the layout stays, which a
        survivor's redo must meet."""
        group = dist.group.WORLD
        if admitted:
            self.ddp._update_process_group(group)
        else:
            self.ddp.process_group = group
            self.ddp.reducer._update_process_group(group)


def _completed(value: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(value)
    return future


def refuse_wrappers_that_cannot_survive(model: object) -> None:
    """SurvivingSync takes a plain module or a DDP model: what holds state it cannot settle after a
    loss is refused with the reason, never trained into a wrong answer."""
    name = type(model).__name__
    # looked up, not imported: a model of a module not imported yet cannot be given, and a
    # replacement's import time counts (FSDP's is about a second)
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is not None and isinstance(model, (fsdp.FSDPModule, fsdp.FullyShardedDataParallel)):
        raise TypeError(
            f"SurvivingSync cannot keep an FSDP model ({name}) going after a loss: each rank holds a shard of "
            "the parameters that no survivor has. Use DistributedDataParallel, or a plain module with "
            "SurvivingSync, or train FSDP with checkpoints and restarts.")


def refuse_ddp_settings(ddp: DistributedDataParallel) -> None:
    """The DDP settings whose state a redo could not rebuild, each refused with the way out."""
    said = "SurvivingSync cannot keep this DistributedDataParallel going after a loss:"
    if ddp.process_group is not dist.group.WORLD:
        raise ValueError(f"{said} it runs on a subgroup, which a loss does not remake. Make DDP on the "
                         "default group (no process_group argument).")
    if ddp.find_unused_parameters:
        raise ValueError(f"{said} find_unused_parameters=True reduces a map of used parameters that a redo cannot "
                         "rebuild. Make DDP without it; parameters without a gradient then average zeros.")
    if ddp._comm_hooks:
        raise ValueError(f"{said} it already has a comm hook ({ddp._comm_hooks[0][0].__qualname__}); SurvivingSync "
                         "reduces the buckets through a hook of its own. Drop the other hook.")
    if ddp.mixed_precision is not None:
        raise ValueError(f"{said} mixed_precision reduces a copy of the parameters in low precision that a redo "
                         "cannot reach. Use torch.autocast for the forward instead.")
    if ddp._delay_all_reduce_all_params:
        raise ValueError(f"{said} delay_all_reduce_named_params reduces every parameter outside the buckets. "
                         "Make DDP without it.")
