"""Error text in one shape everywhere: who (rank, world size, host), which op, what was expected,
what was found, and how to fix it."""

from __future__ import annotations

import functools
import socket

import torch.distributed as dist

from . import sagemaker_host

_HOST = sagemaker_host.current_host() or socket.gethostname()


@functools.lru_cache(maxsize=None)  # a handful of (rank, size, op) per group; made on every call's Work
def where(rank: int, world_size: int, op: str) -> str:
    """The prefix every smddp error starts with, e.g. ``[smddp rank 1/2 host a] all_reduce:``."""
    return f"[smddp rank {rank}/{world_size} host {_HOST}] {op}:"


def ranks_said(ranks: list[int]) -> str:
    """``rank 3``, ``ranks 0-2, 5``: ranks in runs, for messages that name several."""
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    words = ", ".join(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in runs)
    return f"rank{'s' if len(ranks) > 1 else ''} {words}"


class SMDDPError(dist.DistBackendError):
    """A collective failed or was refused. A ``DistBackendError``, so code that handles torch's own
    backend errors handles ours."""


class InvalidCallError(ValueError, RuntimeError):
    """A call refused for its arguments (a dtype or op it cannot take, tensors of the wrong sizes),
    on this rank, before any of its data moved. Both a ValueError, as torch's Python layer raises
    for bad arguments, and a RuntimeError, as torch's gloo and nccl backends raise for the same
    calls: code written against any of them catches it."""


class CollectiveMismatchError(SMDDPError):
    """Ranks called different collectives, or the same one with different sizes or dtypes."""


class RecoverableMismatchError(CollectiveMismatchError):
    """A mismatch that every rank found in one table they all gathered (split sizes, or
    ``SMDDP_CHECK_COLLECTIVES``' signatures) before any data moved: each rank raises it at the
    same point of the same call, nothing is left posted, and the group stays usable."""


class PeerFailureError(SMDDPError):
    """A peer died, aborted, or did not arrive within the process group's timeout."""


class PeerRefusedError(PeerFailureError):
    """A peer refused the call this rank was waiting in (bad input on that rank); the message
    carries that rank's own error."""


class SegmentRefusedError(SMDDPError):
    """A rank refused the shared-memory segment that the rendezvous store named, because it is not
    a segment this transport makes (see docs/security.md): a store value never redirects a write."""
