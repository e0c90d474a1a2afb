"""The model ``compile`` returns: used like a DistributedDataParallel module."""

from __future__ import annotations

import contextlib

import torch

from .reducer import GradReducer


class CompiledModel(torch.nn.Module):
    """Wraps ``module`` (reachable as ``.module``, so ``state_dict`` keys carry the same
    ``module.`` prefix as DDP's) and owns the gradient reducer."""

    def __init__(self, module: torch.nn.Module, reducer: GradReducer) -> None:
        super().__init__()
        self.module = module
        self.reducer = reducer

    def forward(self, *args, **kwargs):
        self.reducer.forget_unfinished_backward()
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally (no communication) for the backward passes inside;
        the first backward after it reduces the sum, as DDP's ``no_sync`` does."""
        previous, self.reducer.sync = self.reducer.sync, False
        try:
            yield
        finally:
            self.reducer.sync = previous
