"""Telling peers that a rank refused a call, for transports that cannot tell them themselves.

A rank that refuses a collective (bad input on that rank alone: a dtype, a device, a size) raises
before it enters the transport, but its peers may already be inside the call. Shared memory has a
flag for that (shm_segment.py). Gloo and MPI have none: a peer would wait for the process group's
timeout, 30 minutes by default. So the refusing rank writes one key, named by the call's index,
into the group's store, and a rank waiting in gloo, MPI or (under the hierarchical transport)
shared memory looks for the key of its own call every ``POLL_S`` and raises with the refusing
rank's message. Keys are written only on refusals, and looked up only by waits that have already
lasted ``POLL_S``, so a collective that completes in time never touches the store.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from ..errors import PeerFailureError

POLL_S = 0.05
"""How often a waiting rank looks for a refusal of its call (each look is one store round trip)."""


class RefusalBoard:
    """The keys of one process group's refused calls, in that group's store."""

    def __init__(self, store) -> None:
        self._store = dist.PrefixStore("smddp-refused", store)

    def post(self, call: int, rank: int, reason: str) -> None:
        """Rank ``rank`` refused call ``call`` because of ``reason`` (its own error text)."""
        self._store.set(str(call), f"rank {rank} refused this call: {reason}")

    def refusal(self, call: int) -> str | None:
        """What a refusing rank said of call ``call``, or None if no rank refused it, or if the
        store cannot be reached (its host died: the transport reports that peer's failure itself,
        naming it, which a store error would not)."""
        key = str(call)
        try:
            if not self._store.check([key]):
                return None
            return self._store.get(key).decode(errors="replace")
        except (RuntimeError, OSError):  # DistStoreError and socket errors
            return None

    def raise_if_refused(self, call: int, prefix: str) -> None:
        """Raise PeerFailureError (its text after ``prefix``, errors.where's) on this waiting
        rank if a peer refused call ``call``."""
        said = self.refusal(call)
        if said is not None:
            raise PeerFailureError(
                f"{prefix} {said}. The call cannot complete without that rank, and this "
                "rank is left inside it, so this process group can no longer be used; fix the input on that "
                "rank and restart the job (or destroy and re-create the group)."
            )


POLL = timedelta(seconds=POLL_S)
