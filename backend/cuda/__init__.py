"""CUDA tensors on the "smddp" backend: NCCL through cupy where it can, host staging otherwise.

``CudaPaths`` is made on a group's first CUDA call. ``SMDDP_CUDA_TRANSPORT`` decides: "auto"
(NCCL if cupy and libnccl load, else staged with a one-time warning saying what to install),
"nccl" (an error if it cannot load) or "staged". Calls NCCL cannot make are staged either way.
"""

from __future__ import annotations

import os
import warnings
from datetime import timedelta
from typing import Callable

from ..errors import where
from .staged import StagedPath

_warned = False


class CudaPaths:
    """The CUDA side of one process group: ``nccl`` (or None) and ``staged``."""

    def __init__(self, store, rank: int, world_size: int, timeout: timedelta, config,
                 on_failure: Callable[[str], None]) -> None:
        blocking = config.blocking_wait or os.environ.get("TORCH_NCCL_BLOCKING_WAIT", "0") == "1"
        self.staged = StagedPath(rank, world_size, timeout, blocking)
        self.nccl = None
        self.reason = "SMDDP_CUDA_TRANSPORT=staged"
        if config.cuda_transport == "staged":
            return
        from .communicators import load_nccl

        try:
            nccl = load_nccl()
        except ImportError as exc:
            if config.cuda_transport == "nccl":
                raise ImportError(f"{where(rank, world_size, 'init')} SMDDP_CUDA_TRANSPORT=nccl, but {exc}") from exc
            self.reason = str(exc)
            _warn_staged(rank, self.reason)
            return
        from .nccl_path import NcclPath

        self.nccl = NcclPath(nccl, store, rank, world_size, timeout, blocking, config.debug, on_failure)
        self.reason = "NCCL through cupy"

    def close(self, abort: bool = False) -> None:
        if self.nccl is not None:
            self.nccl.close(abort)


def _warn_staged(rank: int, reason: str) -> None:
    global _warned
    if _warned:
        return
    _warned = True
    message = (f"smddp-lite: CUDA tensors go through host memory (slow) because {reason}. "
               "Set SMDDP_CUDA_TRANSPORT=staged to choose this path and silence this warning.")
    warnings.warn(f"[rank {rank}] {message}", stacklevel=4)
