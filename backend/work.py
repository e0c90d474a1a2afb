"""Work handles and the per-group communication thread that completes them.

A process group whose transport waits on a network runs its collectives, in call order, on one
thread of its own: the CPU analogue of ProcessGroupNCCL's communication stream. ``async_op=True``
callers and DDP's reducer (which launches a bucket's all_reduce from the autograd thread) then
overlap communication with compute. Transports whose work is the CPU's own copying run on the
caller's thread and hand back completed Work. Either way a caller waits on the Work it gets back,
as with every torch backend.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
import weakref
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from .errors import PeerFailureError, SMDDPError

_SIGNAL_SLICE_S = 0.2  # the main thread's wait for a call, between looks for a Ctrl-C (Work.wait)


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
        # A Work's own method, held weakly: the future's callback held the Work, which holds
        # this, a cycle that only the garbage collector frees (every call's tensors stayed alive
        # until it ran: 32 MB more per all_reduce of 32 MB in a loop), and not at all once
        # torch's C++ future holds a link of it. The callback runs only while the Work completes
        # the future (end, get), so the Work is alive whenever it runs.
        self._outcome = _held_weakly(outcome)
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


def _held_weakly(fn: Callable[[torch.futures.Future], Any]) -> Callable[[torch.futures.Future], Any]:
    if not hasattr(fn, "__self__"):
        return fn
    method = weakref.WeakMethod(fn)

    def call(completed: torch.futures.Future) -> Any:
        bound = method()
        if bound is None:  # cannot happen while a Work completes its own future; said if it does
            raise SMDDPError("the work this future belongs to was freed before it completed the future")
        return bound(completed)

    return call


_ORPHANS: collections.deque = collections.deque(maxlen=64)
"""Works that Python let go of before anyone waited for them or asked for their future, kept
for a while: C++ may still hold them (below). A bounded deque, so works nobody ever asks about
(a fire-and-forget all_reduce, DDP's Join notification when the world size is static) cannot
pile up; a work that C++ asks for is ended within the same training step."""


class KeptWhileCppMayAsk:
    """For Work handles written in Python. Python code may hand a Work to C++ and drop its own
    reference: DDP under ``Join(divide_by_initial_world_size=False)`` gives the reducer the
    forward pass's all_reduce, and backward waits for it and reads its future. Once the Python
    object is gone, C++ calls reach the C++ base class instead of these methods: its wait()
    blocked for ever (the job hung), its getFuture() raised "not implemented". Works returned
    to C++ by a process group method are kept alive by torch itself; this covers the other way.

    A work is therefore kept when Python lets go of it (it revives itself in ``__del__``, which
    runs once) among the last ``_ORPHANS``, until its future is asked for (the last thing the
    reducer asks), unless its future was asked for before or Python code waited for it. C++
    always passes wait() a timeout and Python code rarely does: a wait() without one is Python's.
    (The reducer waits while the communication thread still holds the work, whose release of it
    after the call was then the work's end: a wait alone does not tell who waited.)"""

    _asked = False  # Python code waited, or the future was asked for: nobody needs it later
    _orphaned = False

    def _timeout_of(self, timeout: timedelta | None) -> timedelta:
        """wait()'s timeout (zero: the group's), noting a wait without one as Python code's."""
        if timeout is None:
            self._asked_for()
            return timedelta(0)
        return timeout

    def _asked_for(self, future_too: bool = False) -> None:
        self._asked = True
        if future_too and self._orphaned:
            self._orphaned = False
            for i, kept in enumerate(_ORPHANS):
                if kept is self:
                    del _ORPHANS[i]
                    break

    def __del__(self) -> None:
        if not self._asked:
            try:
                _ORPHANS.append(self)
                self._orphaned = True
            except (AttributeError, NameError, TypeError):  # at interpreter shutdown: nobody will ask
                pass


def complete_with_none(completion: torch.futures.Future) -> None:
    """The ``complete`` a Work passes to FutureOnRequest: the completion carries no value, since
    its ``then`` callback (``outcome``) gives the future handed out the outputs or the error."""
    completion.set_result(None)


class SMDDPWork(KeptWhileCppMayAsk, dist._Work):
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
        self._over = False  # the call is over (its future's callbacks may still be running)
        self._runner: CommThread | None = None  # the thread it is queued on, if any
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
        self._over = True
        self._future.end(complete_with_none)  # runs _outcome: completes the future with the outputs or the error
        # only now: whoever sees the work finished (wait, is_completed) may read its future at once
        self._finished = True
        self._running.release()

    def wait(self, timeout: timedelta | None = None) -> bool:
        timeout_given = timeout
        timeout = self._timeout_of(timeout)  # None: Python code's wait (see KeptWhileCppMayAsk)
        runner = self._runner
        if not self._finished and runner is not None:
            if runner.runs_here():
                # a future's callback, which runs on the thread that ran its call, waits for a
                # call queued behind the one it belongs to (PowerSGD's hook all-reduces P, then Q)
                runner.run_until(self)
            elif timeout_given is None:  # no bound of its own: it waits as long as the call runs
                runner.run_if_next(self)
        if not self._finished:
            limit = timeout.total_seconds() or self._timeout_s
            try:
                acquired = self._acquire_running(limit)
            except (KeyboardInterrupt, SystemExit) as exc:  # the call goes on without this caller
                if runner is not None and runner.on_interrupt is not None:
                    runner.on_interrupt(self._describe, exc)
                raise
            if not acquired:
                raise PeerFailureError(
                    f"{self._describe} not complete after {limit:g} s (the process group timeout); a peer "
                    "is stuck, dead or calling a different collective"
                )
            self._running.release()  # taken only to learn that the call ended: the next waiter's turn
        if self._error is not None:
            raise as_backend_error(self._error)
        return True

    def _acquire_running(self, limit: float) -> bool:
        """Wait up to ``limit`` seconds for the call to end. The main thread waits in slices: a
        Ctrl-C that the kernel hands to another thread (the communication thread, gloo's) does not
        wake a lock wait, and Python runs its handler, raising KeyboardInterrupt, only between
        slices; the lock is free the moment the call ends, so a slice costs no time."""
        if threading.current_thread() is not threading.main_thread():
            return self._running.acquire(timeout=limit)
        deadline = time.monotonic() + limit
        while True:
            left = deadline - time.monotonic()
            if self._running.acquire(timeout=min(max(left, 0.0), _SIGNAL_SLICE_S)):
                return True
            if left <= _SIGNAL_SLICE_S:
                return False

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
        self._asked_for(future_too=True)
        if not self._finished and self._runner is not None and self._runner.runs_here():
            self._runner.run_until(self)  # as in wait(): the future's wait() could not run the queue
        return self._future.get(complete_with_none)

    def result_tensors(self) -> list[torch.Tensor]:
        """The tensors the collective writes (its future's value), without waiting."""
        return self._outputs


def as_backend_error(error: BaseException) -> BaseException:
    """What a failed call raises: a DistBackendError; a KeyboardInterrupt (a Ctrl-C that came
    while the waiting thread ran the call itself) or SystemExit as it is."""
    if isinstance(error, dist.DistBackendError) or not isinstance(error, Exception):
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
    """Runs submitted collectives one after another, in the order they came: on a daemon thread
    of the group's, or on the caller's thread when ``inline`` (see ``Capabilities.runs_inline``).

    A caller that waits for a call the thread has not started yet, and that is next in line,
    runs it itself (``run_if_next``): a plain ``dist.all_reduce`` waits at once, and handing the
    call to the thread and the result back cost two thread wake-ups, 87 and 24 us of a 650 us
    call (p50, 2 ranks on gloo, this project's 2-core machine). Calls made with ``async_op=True``,
    or by DDP's reducer, run on the thread while the caller goes on.

    A Work's future completes on the thread that ran the call, and runs its ``then`` callbacks
    there. A callback that makes another call and waits for it (torch's PowerSGD hook does) would
    wait for that thread forever: its waits run the queue there instead, in order, up to that call."""

    def __init__(self, name: str, inline: bool) -> None:
        self._inline = inline
        # the group's word that a caller waiting for a call here was interrupted (Ctrl-C): its
        # peers may still be in that call, so the group refuses later ones, as when the caller
        # ran the call itself
        self.on_interrupt: Callable[[str, BaseException], None] | None = None
        self._stopping = False
        self._pending: collections.deque[tuple[Callable[[], Any], SMDDPWork]] = collections.deque()
        self._lock = threading.Lock()  # guards _pending and _owner
        self._owner: threading.Thread | None = None  # the thread running a call now
        # one token per submitted call (None: stop); the thread wakes on it and runs what is
        # pending, unless a waiting caller took the call first: then the token finds nothing
        self._doorbell: queue.SimpleQueue[bool | None] = queue.SimpleQueue()
        self._thread = None if inline else threading.Thread(target=self._loop, name=name, daemon=True)
        if self._thread is not None:
            self._thread.start()

    def submit(self, fn: Callable[[], Any], work: SMDDPWork) -> SMDDPWork:
        if self._inline:
            return run_into(fn, work)
        work._runner = self
        with self._lock:
            self._pending.append((fn, work))
        self._doorbell.put(True)
        return work

    def runs_here(self) -> bool:
        """Whether this thread is running a call of this group now (its callbacks run here)."""
        return self._owner is threading.current_thread()

    def run_if_next(self, work: SMDDPWork) -> bool:
        """On a thread that waits for ``work``: run it here if it is the next call and none runs."""
        return self._run_next(work)

    def run_until(self, work: SMDDPWork) -> None:
        """On the thread running a call: run queued calls, in the order they came, until ``work``
        is over."""
        while not work._over:
            with self._lock:
                item = self._pending.popleft()  # ``work`` is queued, so this cannot run dry
            run_into(*item)
            del item

    def _run_pending(self) -> None:
        while self._run_next():
            pass

    def _run_next(self, only: SMDDPWork | None = None) -> bool:
        """Run the next queued call on this thread, if no call runs now (and the next is ``only``,
        when given); say whether one ran."""
        with self._lock:
            if self._owner is not None or not self._pending:
                return False
            if only is not None and self._pending[0][1] is not only:
                return False
            item = self._pending.popleft()
            self._owner = threading.current_thread()
        try:
            run_into(*item)
        finally:
            del item  # held here, the call's tensors would live until the next call
            with self._lock:
                self._owner = None
                more = bool(self._pending) or self._stopping
            # calls queued behind it while a waiting caller ran it: their tokens found it busy
            if more and threading.current_thread() is not self._thread:
                self._doorbell.put(True)
        return True

    def _loop(self) -> None:
        while True:
            if self._doorbell.get() is None:
                self._stopping = True
            self._run_pending()
            if self._stopping:
                with self._lock:
                    if self._owner is None and not self._pending:
                        return
                # a waiting caller runs a call: it rings again when it is done

    def stop(self) -> None:
        """Let queued collectives finish, then end the thread."""
        if self._thread is None:
            return
        self._doorbell.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)
