"""CUDA tensors on the "smddp" backend: NCCL through cupy where it can, host staging otherwise.

``CudaPaths`` is made on a group's first CUDA call. ``SMDDP_CUDA_TRANSPORT`` decides: "auto"
(NCCL if cupy and libnccl load, else staged with a one-time warning saying what to install),
"nccl" (an error if it cannot load) or "staged". Calls NCCL cannot make are staged either way.
Under "auto" and "nccl" the ranks of a group compare, once, through the store, whether NCCL
loaded: under "auto" a host without cupy would otherwise stage while the others waited in NCCL.
(Init has already compared the setting itself across ranks.)
"""

from __future__ import annotations

import os
import warnings
from datetime import timedelta
from typing import Callable

from .. import agreement
from ..errors import ranks_said, where
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
            agree_on_path(store, rank, world_size, timeout, config.cuda_transport, str(exc))
            if config.cuda_transport == "nccl":
                raise ImportError(f"{where(rank, world_size, 'init')} SMDDP_CUDA_TRANSPORT=nccl, but {exc}") from exc
            self.reason = str(exc)
            _warn_staged(rank, self.reason)
            return
        agree_on_path(store, rank, world_size, timeout, config.cuda_transport, None)
        from .nccl_path import NcclPath

        self.nccl = NcclPath(nccl, store, rank, world_size, timeout, blocking, config.debug, on_failure)
        self.reason = "NCCL through cupy"

    def close(self, abort: bool = False) -> None:
        if self.nccl is not None:
            self.nccl.close(abort)


def agree_on_path(store, rank: int, world_size: int, timeout: timedelta, setting: str,
                  unavailable: str | None) -> None:
    """Every rank of the group says whether NCCL loaded (``unavailable`` is None) or not
    (``unavailable`` says why); where they differ, every rank raises the same ``ValueError``
    instead of some staging through host memory while the others wait in NCCL. Four store calls
    per rank (agreement.exchange_in_store), once per group (again if making the paths failed)."""
    if store is None or world_size == 1:
        return
    # the paths are made again at the next CUDA call after one that failed (this refusal, or
    # NCCL's set-up): every rank is then at the same attempt, which compares on keys of its own
    attempt = store.add(f"cuda_path/attempts/{rank}", 1)
    said = agreement.exchange_in_store(store, f"cuda_path/{attempt}", rank, world_size,
                                       "" if unavailable is None else unavailable, timeout)
    if agreement.agreed([not why for why in said]):  # "": NCCL loaded
        return
    loaded = [r for r, why in enumerate(said) if not why]
    missing = [r for r, why in enumerate(said) if why]
    raise ValueError(
        f"{where(rank, world_size, 'CUDA tensors')} SMDDP_CUDA_TRANSPORT={setting}: NCCL (through cupy) loaded on "
        f"{ranks_said(loaded)} but not on {ranks_said(missing)} ({ranks_said(missing[:1])}: {said[missing[0]]}), and "
        "every rank of a group must move CUDA tensors the same way. Install cupy and NCCL on every host, or set "
        "SMDDP_CUDA_TRANSPORT=staged on every rank")


def _warn_staged(rank: int, reason: str) -> None:
    global _warned
    if _warned:
        return
    _warned = True
    message = (f"smddp-lite: CUDA tensors go through host memory (slow) because {reason}. "
               "Set SMDDP_CUDA_TRANSPORT=staged to choose this path and silence this warning.")
    warnings.warn(f"[rank {rank}] {message}", stacklevel=4)
