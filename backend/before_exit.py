"""What this library's background threads need at the interpreter's exit, before it ends.

CPython ends its daemon threads where they next take the GIL once finalization has begun (3.11:
the thread exits through ``pthread_exit``, whose unwinding runs C++ destructors). A thread that
is then inside a C++ call that released the GIL, such as a TCPStore request or a gloo wait,
unwinds through pybind11's ``gil_scoped_release`` destructor, which may not throw: the process
aborts ("terminate called without an active exception", SIGABRT), and a launcher reports a
finished job as failed. The threads that poll (the flight recorder's watcher, SurvivingSync's
heartbeat, the CUDA watchdog) are in such a call a few milliseconds of every poll, so a script
that ends without ``destroy_process_group`` aborted now and then on a busy machine
(tests/test_exit.py).

``stop_at_exit`` registers a thread owner's stop; at exit (atexit runs before finalization)
every owner still alive is stopped and its thread joined. Then, where gloo groups were made,
a short wait with the GIL released lets gloo's worker threads free the tensors of their last
calls, which takes the GIL too.
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from typing import Callable

# gloo's worker thread frees a finished call's tensors just after the caller's wait returns
GLOO_SETTLE_S = 0.05

_lock = threading.Lock()
_stops: list[weakref.WeakMethod] = []
_gloo_used = False


def stop_at_exit(stop: Callable[[], None]) -> None:
    """Call ``stop`` (a bound method, which must end and join its thread) at the interpreter's
    exit, unless its object is gone by then. It must be safe to call twice: an owner closed
    earlier is stopped again."""
    with _lock:
        _stops[:] = [kept for kept in _stops if kept() is not None]
        _stops.append(weakref.WeakMethod(stop))


def gloo_used() -> None:
    """Say that this process made a gloo group, so the exit waits for gloo's worker threads."""
    global _gloo_used
    _gloo_used = True


def _at_exit() -> None:
    with _lock:
        stops = [kept() for kept in reversed(_stops)]
        _stops.clear()
    for stop in stops:
        if stop is not None:
            try:
                stop()
            except Exception:  # the process is ending: a thread that will not stop is left as it was
                pass
    if _gloo_used:
        time.sleep(GLOO_SETTLE_S)


atexit.register(_at_exit)
