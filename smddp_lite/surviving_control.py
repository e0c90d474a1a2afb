"""The small call of a step that carries rank 0's word to every rank: the count of replacements
waiting (so every member learns of them in the same step) and rank 0's module buffers (BatchNorm's
running statistics), which replace the wrapper's own broadcast of them at the next forward: a
broadcast there would raise from forward on a loss, where nothing could settle it.

Two tensors by step parity, as the averages are kept: a survivor one step ahead still holds the
one the others missed, and sends it to them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class RankZeroControl:
    """float64 ``[ticket count, rank 0's buffers...]``, summed across ranks (the others send zeros)."""

    def __init__(self, buffers: list[torch.Tensor], device: torch.device) -> None:
        self.buffers = buffers
        size = 1 + sum(b.numel() for b in buffers)
        self._tensors = [torch.zeros(size, dtype=torch.float64, device=device) for _ in range(2)]

    def of(self, step: int) -> torch.Tensor:
        return self._tensors[step % 2]

    def fill(self, step: int, tickets: int) -> torch.Tensor:
        """``step``'s tensor, with this rank's part written in: rank 0's count and buffers, zeros elsewhere."""
        control = self.of(step)
        if dist.get_rank() == 0:
            control[0] = tickets
            at = 1
            for b in self.buffers:
                control[at:at + b.numel()].copy_(b.detach().reshape(-1))
                at += b.numel()
        else:
            control.zero_()
        return control

    def arrived(self, step: int) -> int:
        """Take rank 0's buffers from ``step``'s summed tensor; returns rank 0's ticket count."""
        control, at = self.of(step), 1
        with torch.no_grad():
            for b in self.buffers:
                b.copy_(control[at:at + b.numel()].view_as(b))
                at += b.numel()
        return int(control[0].item())
