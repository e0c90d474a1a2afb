"""The sockets of one gloo group, so that its teardown after a loss does not wait out the timeout.

A gloo call that a survivor abandons (its peer died, or a peer left the call after learning of
a death) keeps running on the group's worker thread: it waits to send to, or receive from, a
peer that is alive but has left the call, for as long as the group's timeout (torch's default
is 30 minutes). Destroying the group joins that thread, so the survivor sits in
``destroy_process_group`` and every other survivor waits for it in the next group's rendezvous.
Neither ``ProcessGroupGloo.abort()`` nor its timeout setters reach a wait already running (tried
on torch 2.13). What does: shutting down the group's own sockets. Gloo's event loop then sees
the connection end and fails the pending wait at once, here and on the peers it was paired with.

Gloo does not name its sockets, so they are found as the sockets this process gained while the
group was made (gloo connects every pair eagerly, inside the constructor). Groups are made one
at a time under a lock, and the sockets of the rendezvous store (which another thread, such as
a heartbeat, may open meanwhile) are left out by their address.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from typing import Callable, TypeVar

import torch.distributed as dist

_log = logging.getLogger("smddp_lite")
_MAKING = threading.Lock()
_FD_DIR = "/proc/self/fd"

Group = TypeVar("Group")


def _sockets() -> dict[int, str]:
    """This process's open sockets: fd -> its ``socket:[inode]`` name (empty where /proc is not)."""
    found = {}
    with contextlib.suppress(OSError):
        for name in os.listdir(_FD_DIR):
            with contextlib.suppress(OSError):
                target = os.readlink(f"{_FD_DIR}/{name}")
                if target.startswith("socket:"):
                    found[int(name)] = target
    return found


def _store_address(store) -> tuple[str, int] | None:
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    if isinstance(store, dist.TCPStore):
        return store.host, store.port
    return None


def _talks_to(fd: int, address: tuple[str, int] | None) -> bool:
    if address is None:
        return False
    try:
        probe = socket.socket(fileno=fd)
    except OSError:  # closed since it was listed
        return False
    try:
        peer = probe.getpeername()
    except OSError:  # a listening socket, or not TCP
        return False
    finally:
        probe.detach()  # the fd stays gloo's (or its owner's)
    return isinstance(peer, tuple) and peer[1] == address[1]


class GlooSockets:
    """The sockets one gloo group opened; ``shut_down()`` ends every wait pending on them."""

    def __init__(self, sockets: dict[int, str]) -> None:
        self._sockets = sockets

    @classmethod
    def opened_while(cls, make: Callable[[], Group], store) -> tuple[Group, "GlooSockets"]:
        """``make()`` (a constructor of a gloo group on ``store``), and the sockets it opened."""
        store_at = _store_address(store)
        with _MAKING:
            before = _sockets()
            group = make()
            after = _sockets()
        gained = {fd: name for fd, name in after.items()
                  if before.get(fd) != name and not _talks_to(fd, store_at)}
        return group, cls(gained)

    def shut_down(self) -> None:
        """Shut down (not close: gloo still owns the descriptors and closes them when the group
        goes) each socket that is still the one gloo opened."""
        now = _sockets()
        for fd, name in self._sockets.items():
            if now.get(fd) != name:  # closed already, and the number reused by something else
                continue
            try:
                held = socket.socket(fileno=fd)
            except OSError:  # gloo closed it since (a peer's end went first)
                continue
            try:
                # not the listener: gloo's loop aborts the process when its accept() fails
                if not held.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                    held.shutdown(socket.SHUT_RDWR)
            except OSError as exc:  # already ended
                _log.debug("smddp: shutting down gloo socket %d: %r", fd, exc)
            finally:
                held.detach()
        self._sockets = {}
