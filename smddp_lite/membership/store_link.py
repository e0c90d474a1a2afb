"""A bound on how long a request to the job's store may go unacknowledged by its host.

A TCPStore client waits for a reply with no end: its timeout bounds connecting and the waits
for keys, not a reply that never comes (tried on torch 2.13: an ``add`` to a store whose host
cannot be reached waits past any timeout). A rank cut off from the store by the network would
then sit in its next store request for good, the heartbeat's and the backend's alike, and never
say why. The kernel can bound it: with TCP_USER_TIMEOUT set on the client's socket, data that
the store's host has not acknowledged within the bound closes the connection, and the request
raises. An idle connection is not touched, nor one to a host that acknowledges (a slow store
is not a cut-off one).

The clients' sockets are found as this process's TCP sockets connected to the store's port:
torch does not expose them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket

import torch.distributed as dist

_log = logging.getLogger("smddp_lite")
_FD_DIR = "/proc/self/fd"
# Linux's value, where this Python's socket module does not name it
_TCP_USER_TIMEOUT = getattr(socket, "TCP_USER_TIMEOUT", 18)


def bound_unacknowledged_requests(store: dist.Store, seconds: float) -> int:
    """Set TCP_USER_TIMEOUT to ``seconds`` on every socket of this process connected to
    ``store``'s port (where ``store`` is, or wraps, a TCPStore); returns how many."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    if not isinstance(store, dist.TCPStore):
        return 0
    bounded = 0
    with contextlib.suppress(OSError):  # no /proc: nothing to bound
        for name in os.listdir(_FD_DIR):
            with contextlib.suppress(OSError):  # closed since it was listed
                if os.readlink(f"{_FD_DIR}/{name}").startswith("socket:"):
                    bounded += _bound(int(name), store.port, seconds)
    if bounded == 0:
        _log.debug("smddp: found no socket to the store's port %d to bound", store.port)
    return bounded


def _bound(fd: int, port: int, seconds: float) -> bool:
    held = socket.socket(fileno=fd)
    try:
        if held.type != socket.SOCK_STREAM or held.family not in (socket.AF_INET, socket.AF_INET6):
            return False
        peer = held.getpeername()
        if peer[1] != port:
            return False
        held.setsockopt(socket.IPPROTO_TCP, _TCP_USER_TIMEOUT, int(seconds * 1000))
        return True
    except OSError:  # a listening socket (no peer), or one that ended
        return False
    finally:
        held.detach()  # the descriptor stays its owner's
