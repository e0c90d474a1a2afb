"""Work handles and the per-group communication thread that completes them.

A process group whose transport waits on a network runs its collectives, in call order, on one
thread of its own: the CPU analogue of ProcessGroupNCCL's communication stream. ``async_op=True``
callers and DDP's reducer (which launches a bucket's all_reduce from the autograd thread) then
overlap communication with compute. Transports whose work is the CPU's own copying run on the
caller's thread and hand back completed Work. Either way a caller waits on the Work it gets back,
as with every torch backend.
"""

from __future__ import annotations

import queue
import threading
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from .errors import PeerFailureError, SMDDPError


class FutureOnRequest:
    """A Work's future, made only when someone asks for it (DDP does, for every bucket; a plain
    ``dist.all_reduce`` never does) and completed exactly once: by the work's end when it was asked
    for first, else by the request itself. Completing runs ``then`` callbacks inline, so it happens
    outside the lock (a callback that touched the work again would otherwise deadlock).

    The future handed out is the ``then`` child of the one completed here, and ``outcome`` (its
    callback) returns the outputs or raises the failure. ``Future.set_exception`` would not do: it
    is Python's own, and completes the future with the exception as its *value*, which DDP's
    reducer takes for the reduced bucket and crashes on (a peer dying during ``backward()`` killed
    the surviving ranks with SIGSEGV). An exception raised by a ``then`` callback is a real error
    of the future ``then`` returns, which C++ sees."""

    def __init__(self, outcome: Callable[[torch.futures.Future], Any], devices: list | None = None) -> None:
        self._outcome = outcome
        self._devices = devices
        self._completion: torch.futures.Future | None = None
        self._future: torch.futures.Future | None = None
        self._ended = False
        self._claimed = False  # someone has completed (or is completing) the completion
        self._lock = threading.Lock()

    def end(self, complete: Callable[[torch.futures.Future], None]) -> None:
        """The work is over: ``complete(completion)`` now if the future was asked for already."""
        with self._lock:
            self._ended = True
            completion = self._claim()
        if completion is not None:
            complete(completion)

    def get(self, complete: Callable[[torch.futures.Future], None]) -> torch.futures.Future:
        """The future, made now if nobody asked before; ``complete``-d here if the work is over."""
        with self._lock:
            if self._future is None:
                self._completion = torch.futures.Future(devices=self._devices)
                self._future = self._completion.then(self._outcome)
            completion = self._claim() if self._ended else None
        if completion is not None:
            complete(completion)
        return self._future

    def _claim(self) -> torch.futures.Future | None:
        if self._completion is None or self._claimed:
            return None
        self._claimed = True
        return self._completion


def complete_with_none(completion: torch.futures.Future) -> None:
    """The ``complete`` a Work passes to FutureOnRequest: the completion carries no value, since
    its ``then`` callback (``outcome``) gives the future handed out the outputs or the error."""
    completion.set_result(None)


class SMDDPWork(dist._Work):
    """Handle of one collective: ``wait``, ``is_completed``, ``get_future`` and errors on ``wait``.

    Failures are raised from ``wait()`` as ``DistBackendError``, and are errors of the future
    (``FutureOnRequest`` says why that matters to DDP).
    """

    def __init__(self, describe: str, outputs: list[torch.Tensor], timeout: timedelta) -> None:
        super().__init__()
        self._describe = describe
        self._outputs = outputs
        self._timeout_s = timeout.total_seconds()
        self._error: BaseException | None = None
        self._finished = False  # the call is over, and its future, if one was asked for, is complete
        # Held until the collective ends; wait() blocks on it. A plain lock, not an Event (a
        # Condition and its lock): one is made per call, and small calls felt the difference.
        self._running = threading.Lock()
        self._running.acquire()
        self._future = FutureOnRequest(self._outcome)

    def _outcome(self, _completed: torch.futures.Future) -> list[torch.Tensor]:
        if self._error is not None:
            raise as_backend_error(self._error)
        return self._outputs

    # called by the communication thread
    def _finish(self, error: BaseException | None) -> None:
        self._error = error
        self._future.end(complete_with_none)  # runs _outcome: completes the future with the outputs or the error
        # only now: whoever sees the work finished (wait, is_completed) may read its future at once
        self._finished = True
        self._running.release()

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        if not self._finished:
            limit = timeout.total_seconds() or self._timeout_s
            if not self._running.acquire(timeout=limit):
                raise PeerFailureError(
                    f"{self._describe}: not complete after {limit:.0f} s (the process group timeout); a peer "
                    "is stuck, dead or calling a different collective"
                )
            self._running.release()  # taken only to learn that the call ended: the next waiter's turn
        if self._error is not None:
            raise as_backend_error(self._error)
        return True

    def synchronize(self) -> None:
        self.wait()

    def is_completed(self) -> bool:
        return self._finished

    def is_success(self) -> bool:
        return self._finished and self._error is None

    def exception(self):
        return self._error

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return self._outputs

    def get_future(self) -> torch.futures.Future:
        return self._future.get(complete_with_none)

    def result_tensors(self) -> list[torch.Tensor]:
        """The tensors the collective writes (its future's value), without waiting."""
        return self._outputs


def as_backend_error(error: BaseException) -> BaseException:
    if isinstance(error, dist.DistBackendError):
        return error
    wrapped = SMDDPError(str(error))
    wrapped.__cause__ = error
    return wrapped


def run_into(fn: Callable[[], Any], work: SMDDPWork) -> SMDDPWork:
    """Run ``fn`` now and complete ``work`` with its outcome."""
    try:
        fn()
    except BaseException as exc:  # reported through the Work, as on the communication thread
        work._finish(exc)
    else:
        work._finish(None)
    return work


class CommThread:
    """Runs submitted collectives one after another on a daemon thread, or on the caller's
    thread when ``inline`` (see ``Transport.runs_inline``)."""

    def __init__(self, name: str, inline: bool) -> None:
        self._inline = inline
        self._queue: queue.SimpleQueue[tuple[Callable[[], Any], SMDDPWork] | None] = queue.SimpleQueue()
        self._thread = None if inline else threading.Thread(target=self._loop, name=name, daemon=True)
        if self._thread is not None:
            self._thread.start()

    def submit(self, fn: Callable[[], Any], work: SMDDPWork) -> SMDDPWork:
        if self._inline:
            return run_into(fn, work)
        self._queue.put((fn, work))
        return work

    def _loop(self) -> None:
        while (item := self._queue.get()) is not None:
            run_into(*item)

    def stop(self) -> None:
        """Let queued collectives finish, then end the thread."""
        if self._thread is None:
            return
        self._queue.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)
