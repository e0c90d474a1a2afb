"""CUDA tensors on the "smddp" backend: NCCL through cupy where it can, host staging otherwise.

``CudaPaths`` is made on a group's first CUDA call. ``SMDDP_CUDA_TRANSPORT`` decides: "auto"
(NCCL if cupy and libnccl load, else staged with a one-time warning saying what to install),
"nccl" (an error if it cannot load) or "staged". Calls NCCL cannot make are staged either way.
Under "auto" the ranks of a group compare what they chose, once, through the store: a host
without cupy would otherwise stage while the others waited in NCCL.
"""

from __future__ import annotations

import os
import warnings
from datetime import timedelta
from typing import Callable

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
    instead of some staging through host memory while the others wait in NCCL. Four store
    calls per rank where they agree, once per group."""
    if store is None or world_size == 1:
        return
    prefix = where(rank, world_size, "CUDA tensors")
    if store.check(["cuda_path/differ"]):  # a later CUDA call after the refusal: the counts are spent
        raise ValueError(f"{prefix} {store.get('cuda_path/differ').decode()}")
    store.set(f"cuda_path/{rank}", "" if unavailable is None else unavailable)
    store.add("cuda_path/nccl", int(unavailable is None))
    if store.add("cuda_path/arrived", 1) == world_size:
        store.set("cuda_path/all", "1")
    store.wait(["cuda_path/all"], timeout)
    if store.add("cuda_path/nccl", 0) in (0, world_size):
        return
    said = {r: store.get(f"cuda_path/{r}").decode() for r in range(world_size)}
    loaded = [r for r, why in said.items() if not why]
    missing = [r for r, why in said.items() if why]
    message = (f"SMDDP_CUDA_TRANSPORT={setting}: NCCL (through cupy) loaded on {ranks_said(loaded)} but not on "
               f"{ranks_said(missing)} ({ranks_said(missing[:1])}: {said[missing[0]]}), and every rank of a group must "
               "move CUDA tensors the same way. Install cupy and NCCL on every host, or set "
               "SMDDP_CUDA_TRANSPORT=staged on every rank")
    store.set("cuda_path/differ", message)
    raise ValueError(f"{prefix} {message}")


def _warn_staged(rank: int, reason: str) -> None:
    global _warned
    if _warned:
        return
    _warned = True
    message = (f"smddp-lite: CUDA tensors go through host memory (slow) because {reason}. "
               "Set SMDDP_CUDA_TRANSPORT=staged to choose this path and silence this warning.")
    warnings.warn(f"[rank {rank}] {message}", stacklevel=4)
