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


class SMDDPWork(dist._Work):
    """Handle of one collective: ``wait``, ``is_completed``, ``get_future`` and errors on ``wait``.

    Failures are raised from ``wait()`` as ``DistBackendError``, and set on the future as an error
    that C++ sees. ``Future.set_exception`` would not do: it is Python's own, and completes the
    future with the exception as its *value*, which DDP's reducer takes for the reduced bucket
    and crashes on (a peer dying during ``backward()`` killed the surviving ranks with SIGSEGV).
    An exception raised by a ``then`` callback is a real error of the future ``then`` returns, so
    the future users get is that of a callback which raises the failure, or returns the outputs.
    """

    def __init__(self, describe: str, outputs: list[torch.Tensor], timeout: timedelta) -> None:
        super().__init__()
        self._describe = describe
        self._outputs = outputs
        self._timeout_s = timeout.total_seconds()
        self._error: BaseException | None = None
        self._ended = False  # the call is over (under _lock: decides who completes the future)
        self._finished = False  # ... and its future, if one was asked for, is complete
        # Held until the collective ends; wait() blocks on it. A plain lock, not an Event (a
        # Condition and its lock): one is made per call, and small calls felt the difference.
        self._running = threading.Lock()
        self._running.acquire()
        # The future is made when asked for (DDP asks for every bucket; a plain dist.all_reduce
        # never does): ``_completed`` is completed by ``_finish``, and the future handed out is
        # its ``then`` child. ``_lock`` decides which of the two threads completes it.
        self._completed: torch.futures.Future | None = None
        self._future: torch.futures.Future | None = None
        self._lock = threading.Lock()

    def _outcome(self, _completed: torch.futures.Future) -> list[torch.Tensor]:
        if self._error is not None:
            raise as_backend_error(self._error)
        return self._outputs

    # called by the communication thread
    def _finish(self, error: BaseException | None) -> None:
        self._error = error
        with self._lock:
            self._ended = True
            completed = self._completed
        if completed is not None:
            completed.set_result(None)  # runs _outcome: completes the future with the outputs or the error
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
        with self._lock:
            made_now = self._future is None
            if made_now:
                self._completed = torch.futures.Future()
                self._future = self._completed.then(self._outcome)
            ended = self._ended
        if made_now and ended:  # _finish ran before anyone asked: complete it here
            self._completed.set_result(None)
        return self._future

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
