"""Which ranks of a group run on this machine, and whether their processes still live.

Gloo names a peer whose connection closed only by its socket address (``[127.0.0.1]:23427``), which
says nothing about which rank it was, and MPI says nothing at all when a peer's process ends. Ranks
on one machine can tell: each publishes its pid under the machine's name at start, and the
survivors look for pids that are gone (gloo after a failure, MPI while it waits).
"""

from __future__ import annotations

import os
import socket
import time


def alive(pid: int) -> bool:
    """False for a pid that is gone or a zombie (a dead child its parent has not reaped)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except (OSError, IndexError):
        return False


def _machine() -> str:
    """This machine as pids see it: its name and its pid namespace (containers on one host may
    share a name and still number processes apart)."""
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = ""
    return f"{socket.gethostname()}/{namespace}"


class LocalPeers:
    """The pids of the ranks that share this machine. Made (which publishes this rank's pid)
    before the group's rendezvous, ``learn`` after it, when every rank has published; then
    ``dead`` says which have ended."""

    # a process that ended closes its sockets a moment before it becomes a zombie
    _SETTLE_S, _LOOK_EVERY_S = 0.5, 0.05

    def __init__(self, store, shown_rank: int) -> None:
        self._store, self._prefix = store, f"local_peers/{_machine()}"
        self._pids: dict[int, int] = {}
        number = store.add(f"{self._prefix}/count", 1)
        store.set(f"{self._prefix}/{number}", f"{shown_rank} {os.getpid()}")

    def learn(self) -> None:
        count = self._store.add(f"{self._prefix}/count", 0)
        for number in range(1, count + 1):
            rank, pid = self._store.get(f"{self._prefix}/{number}").decode().split()
            if int(pid) != os.getpid():
                self._pids[int(rank)] = int(pid)

    def dead(self, settle: bool = True) -> list[int]:
        """The ranks on this machine whose process has ended, in order; empty if none has. With
        ``settle`` (after a failure, not in a polling loop) it waits a moment for one that is ending."""
        deadline = time.monotonic() + (self._SETTLE_S if settle else 0.0)
        while True:
            gone = sorted(rank for rank, pid in self._pids.items() if not alive(pid))
            if gone or time.monotonic() >= deadline:
                return gone
            time.sleep(self._LOOK_EVERY_S)
