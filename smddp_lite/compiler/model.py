"""The model ``compile`` returns: used like a DistributedDataParallel module."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from .graph import ShapeWatch
from .reducer import GradReducer
from .sharding import ParameterGathers


# what DDP broadcasts buffers in: one flat tensor per dtype of up to this many bytes
_BUFFER_BROADCAST_BYTES = 250 << 20


class CompiledModel(torch.nn.Module):
    """Wraps ``module`` (reachable as ``.module``, so ``state_dict`` keys carry the same
    ``module.`` prefix as DDP's) and owns the gradient reducer."""

    def __init__(self, module: torch.nn.Module, reducer: GradReducer, broadcast_buffers: bool = True,
                 gathers: ParameterGathers | None = None, watch_shapes: bool = False, config=None) -> None:
        super().__init__()
        self.module = module
        self.config = config  # the CompileConfig it was made with (SurvivingSync reads what was asked)
        self.reducer = reducer
        self._gathers = gathers
        self.broadcast_buffers = broadcast_buffers and reducer.world_size > 1
        # DDP's rule: a forward broadcasts rank 0's buffers when the forward before it trained
        # (grad enabled, outside no_sync), and the first one does; an evaluation loop under
        # no_grad then runs on the buffers of the last training step, broadcast once
        self._buffers_need_sync = True
        # blocks compiled as graphs: a changing input shape compiles them again
        self._shapes = ShapeWatch() if watch_shapes else None

    def forward(self, *args, **kwargs):
        self.reducer.forget_unfinished_backward()
        if self.broadcast_buffers and self._buffers_need_sync:
            self._sync_buffers()
        self._buffers_need_sync = torch.is_grad_enabled() and self.reducer.sync
        if self._shapes is not None:
            self._shapes.see(args, kwargs)
        return self.module(*args, **kwargs)

    def wait_for_parameters(self) -> None:
        """Sharded step: wait until every rank's updated share is in this rank's parameters.
        Forward and ``state_dict()`` wait for what they read; call this before reading the
        parameters any other way (``model.module.weight``, a ``parameters()`` loop) after a step."""
        if self._gathers is not None:
            self._gathers.wait_all()

    def _sync_buffers(self) -> None:
        """Rank 0's buffers on every rank (running statistics that each rank updated from its own
        batch), in as few broadcasts as DDP makes."""
        buffers = [b for b in self.module.buffers() if b.numel()]
        if buffers:
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(tuple(buffers)):
                dist._broadcast_coalesced(self.reducer.group, buffers, _BUFFER_BROADCAST_BYTES, 0)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally (no communication) for the backward passes inside;
        the first backward after it reduces the sum, as DDP's ``no_sync`` does."""
        previous, self.reducer.sync = self.reducer.sync, False
        try:
            yield
        finally:
            self.reducer.sync = previous
