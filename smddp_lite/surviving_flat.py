"""A plain module's gradients under ``SurvivingSync``: averaged after backward, in ``sync()``, one
call per dtype, into buffers of their own.

Each dtype's gradients are divided by the world size as they are copied into a flat buffer
(``numerics.share_of_mean``) and summed across ranks. ``param.grad`` keeps the rank's own
gradients until the step commits, so a redo after a loss finds them where backward left them;
only then are the averages written back (``unpack``). Two sets of buffers by step parity: a
survivor one step ahead still holds the average the others missed, and sends it to them.

Rank 0's count of waiting replacements rides as one element more of a float32 or float64
average (exact up to 2**24), or in a float32 tensor of its own where the model has neither, so
every member learns of a newcomer in the same step at no cost of a call. DDP takes this path
too for the step a replacement joins (its first bucket layout differs from the others').
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .backend import numerics


class FlatAverages:
    """The flat buffers of ``params``' averages, two steps' worth, and the calls that fill them."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.params = params
        by_dtype: dict[torch.dtype, int] = {}
        for p in params:
            by_dtype[p.dtype] = by_dtype.get(p.dtype, 0) + p.numel()
        self._carrier = next((d for d in (torch.float32, torch.float64) if d in by_dtype), None)
        device = params[0].device
        self._averages = [{dtype: torch.zeros(n + (dtype == self._carrier), dtype=dtype, device=device)
                           for dtype, n in by_dtype.items()} for _ in range(2)]
        self._control = None if self._carrier else torch.zeros(1, dtype=torch.float32, device=device)

    def average(self, step: int, tickets: int) -> int:
        """Average every gradient over the group into ``step``'s buffers, with rank 0's
        ``tickets`` riding along (the others give 0); returns rank 0's count."""
        averages = self._averages[step % 2]
        offsets = dict.fromkeys(averages, 0)
        world = dist.get_world_size()
        for p in self.params:
            flat = averages[p.dtype]
            at = offsets[p.dtype]
            view = flat[at:at + p.numel()]
            if p.grad is None:
                view.zero_()
            else:
                numerics.share_of_mean(p.grad.reshape(-1), world, out=view)
            offsets[p.dtype] = at + p.numel()
        control = self._control_of(averages)
        control.fill_(tickets if dist.get_rank() == 0 else 0)
        for flat in averages.values():
            dist.all_reduce(flat)
        if self._control is not None:
            dist.all_reduce(self._control)
        return int(control.item())

    def _control_of(self, averages: dict[torch.dtype, torch.Tensor]) -> torch.Tensor:
        return averages[self._carrier][-1:] if self._carrier else self._control

    def averages(self, step: int) -> list[torch.Tensor]:
        """What a survivor ahead sends the ones behind: ``step``'s averages."""
        return list(self._averages[step % 2].values()) + ([self._control] if self._control is not None else [])

    def unpack(self, step: int) -> int:
        """The step committed: ``step``'s averages into every ``param.grad``; returns rank 0's count."""
        averages = self._averages[step % 2]
        offsets = dict.fromkeys(averages, 0)
        for p in self.params:
            at = offsets[p.dtype]
            average = averages[p.dtype][at:at + p.numel()].view_as(p)
            if p.grad is None:
                p.grad = average.clone()
            else:
                p.grad.copy_(average)
            offsets[p.dtype] = at + p.numel()
        return int(self._control_of(averages).item())
