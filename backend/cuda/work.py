"""Work handles for collectives on CUDA tensors, with ProcessGroupNCCL's stream semantics.

A CUDA collective is enqueued on the backend's own stream (which first waits for the caller's
current stream), so the host does not wait for it. What a caller does with the handle:

- ``wait()`` makes the caller's *current* stream wait for the collective's end event and returns
  at once; kernels the caller launches afterwards see the result. With blocking waits
  (``SMDDP_BLOCKING_WAIT=1`` or torch's ``TORCH_NCCL_BLOCKING_WAIT=1``) it also blocks the host
  until the collective ends, raising when the process group's timeout passes.
- ``synchronize()`` is the stream wait alone; ``is_completed()`` asks the end event.
- ``get_future()`` is a CUDA-aware ``torch.futures.Future`` of the output tensors, completed on
  a stream that waits for the collective's end, so DDP communication hooks that chain ``then``
  run after the collective on the device, without a host synchronisation. It is made only when
  asked for: a plain ``dist.all_reduce`` does not pay for it.

Errors found later by the watchdog (an asynchronous NCCL error, a timeout) are raised from
``wait()`` as ``DistBackendError``, and are errors of the future that C++ sees: DDP's reducer,
which takes each bucket through ``get_future()``, raises them from ``backward()``.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from ..errors import PeerFailureError, SMDDPError
from ..work import FutureOnRequest, KeptWhileCppMayAsk, as_backend_error


class OutcomeOnDevice:
    """What a CUDA Work answers about its outcome, from ``error`` and ``ended()`` (an event on
    the device): shared by CudaWork and the fast path's FastWork."""

    error: BaseException | None
    outputs: list[torch.Tensor]

    def is_completed(self) -> bool:
        return self.error is not None or self.ended()

    def is_success(self) -> bool:
        return self.error is None and self.ended()

    def exception(self):
        return self.error

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return self.outputs


class CudaWork(OutcomeOnDevice, KeptWhileCppMayAsk, dist._Work):
    """One collective on ``device``: ended when ``end`` (a CUDA event) has been reached.

    ``keep`` holds every tensor the collective touches until the watchdog sees it end, so the
    caching allocator cannot hand their memory to someone else meanwhile (the tensors are also
    ``record_stream``-ed onto the communication stream, which covers frees on the caller's side).
    """

    def __init__(self, describe: str, device: torch.device, outputs: list[torch.Tensor], timeout: timedelta,
                 blocking: bool, captured: bool = False, host_side: bool = True) -> None:
        super().__init__()
        self.describe = describe
        # enqueued while the caller's stream was capturing a CUDA graph: it runs at each replay,
        # so waiting only orders streams (the host cannot wait for work a capture only records)
        self.captured = captured
        self.device = device
        self.outputs = outputs
        self.keep: list[torch.Tensor] = []
        self.end: torch.cuda.Event | None = None
        self.started = time.monotonic()
        self.timeout_s = timeout.total_seconds()
        self.blocking = blocking
        self.error: BaseException | None = None
        # set once the host-side part has finished; a call enqueued whole by the caller's thread
        # (NCCL) has none, and shares one event that is always set (a fresh one costs per call)
        self._host_done = threading.Event() if host_side else _NO_HOST_SIDE
        # made on request (most callers only wait()); its callback raises the failure (_outcome)
        self._future = FutureOnRequest(self._outcome, devices=[device])

    # completion ---------------------------------------------------------------------------------
    def enqueued(self, stream: torch.cuda.Stream) -> None:
        """The collective is on ``stream``: record its end there (and complete the future, if
        someone already asked for it: the staged path ends on the communication thread)."""
        self.end = torch.cuda.Event()
        self.end.record(stream)
        self._host_done.set()
        self._future.end(self._complete_future)

    def fail(self, error: BaseException) -> None:
        """The collective failed or was aborted (watchdog, a host-side step)."""
        if self.error is None:
            self.error = error
        self._future.end(self._complete_future)
        self._host_done.set()

    def _outcome(self, completion: torch.futures.Future) -> list[torch.Tensor]:
        """The value of the future handed out, or its error. ``Future.set_exception`` would not
        do: it is Python's own, and completes the future with the exception as its *value*, which
        DDP's reducer takes for the reduced bucket and crashes on (as it did on the CPU path when
        a peer died during ``backward()``). An exception raised in a ``then`` callback is an error
        of the future ``then`` returns, which C++ sees. On success this runs on a stream that
        waits for the completion's events, so the outputs stay ordered after the collective."""
        if self.error is not None:
            raise as_backend_error(self.error)
        return completion.value()

    def release(self) -> None:
        """Ended on the device (the watchdog saw it): the tensors it touched may go."""
        self.keep = []

    def ended(self) -> bool:
        """True once the device has passed the collective's end (never blocks); a captured
        collective once it is in the graph (its event cannot be queried during the capture)."""
        if self.captured:
            return self._host_done.is_set()
        return self._host_done.is_set() and self.end is not None and self.end.query()

    # what callers use ---------------------------------------------------------------------------
    def _check_not_after_capture(self) -> None:
        # the end event belongs to the graph: outside the capture there is nothing to wait for
        if self.captured and not capturing(self.device):
            raise SMDDPError(f"{self.describe} was captured into a CUDA graph, so it runs at each replay: wait "
                             "for it inside the capture, and for a replay by synchronising its stream")

    def wait(self, timeout: timedelta | None = None) -> bool:
        timeout = self._timeout_of(timeout)  # None: Python code's wait (see KeptWhileCppMayAsk)
        self._check_not_after_capture()
        limit = timeout.total_seconds() or self.timeout_s
        if not self._host_done.wait(limit):
            raise PeerFailureError(f"{self.describe}: the host-side part did not finish within {limit:g} s")
        self._raise_if_failed()
        if self.blocking and not self.captured:
            self.block_host(limit)
        torch.cuda.current_stream(self.device).wait_event(self.end)
        return True

    def synchronize(self) -> None:
        self._check_not_after_capture()
        self._host_done.wait(self.timeout_s)
        self._raise_if_failed()
        torch.cuda.current_stream(self.device).wait_event(self.end)

    def get_future(self) -> torch.futures.Future:
        """A CUDA-aware future of the outputs: completed on a stream that waits for the
        collective's end event, so ``then`` callbacks and ``wait()`` are ordered after it on
        the device (ProcessGroupNCCL completes its futures the same way)."""
        self._asked_for(future_too=True)
        return self._future.get(self._complete_future)

    def _complete_future(self, future: torch.futures.Future) -> None:
        if self.error is not None:
            future.set_result([])  # _outcome raises the error into the future handed out
            return
        # set_result records an event on the current stream: make that a stream of its own that
        # waits for the end event, so neither the caller's stream nor later collectives wait
        stream = _future_stream(self.device)
        stream.wait_event(self.end)
        with torch.cuda.stream(stream):
            future.set_result(self.outputs)

    # helpers ------------------------------------------------------------------------------------
    def _raise_if_failed(self) -> None:
        if self.error is not None:
            raise as_backend_error(self.error)

    def block_host(self, limit: float) -> None:
        """Block the host until the collective has ended on the device; raise on failure or
        after ``limit`` seconds."""
        deadline = time.monotonic() + limit
        while not self.end.query():
            self._raise_if_failed()  # the watchdog may abort while we poll
            if time.monotonic() > deadline:
                raise PeerFailureError(
                    f"{self.describe}: not complete after {limit:g} s (the process group timeout); a peer "
                    "is stuck, dead or calling a different collective"
                )
            time.sleep(50e-6)
        self._raise_if_failed()


_NO_HOST_SIDE = threading.Event()
_NO_HOST_SIDE.set()


def capturing(device: torch.device) -> bool:
    """Whether ``device``'s current stream (the caller's, which collectives wait for) is
    capturing a CUDA graph. (Every call asks: switching devices only when the tensors are not on
    the current one keeps this off the per-call cost.)"""
    if device.index == torch.cuda.current_device():
        return torch.cuda.is_current_stream_capturing()
    with torch.cuda.device(device):
        return torch.cuda.is_current_stream_capturing()


_FUTURE_STREAMS: dict[int, torch.cuda.Stream] = {}


def _future_stream(device: torch.device) -> torch.cuda.Stream:
    stream = _FUTURE_STREAMS.get(device.index)
    if stream is None:
        stream = _FUTURE_STREAMS[device.index] = torch.cuda.Stream(device)
    return stream


class CommStream:
    """A process group's communication stream on one device, and the event it waits on.

    ``run`` makes the stream wait for the caller's current stream, runs ``enqueue`` with the
    stream current (so kernels it launches, temporaries it allocates and NCCL calls given
    ``torch.cuda.current_stream()`` all land there), and marks ``tensors`` as used on the stream
    for the caching allocator. It does what ``stream.wait_stream`` and ``with
    torch.cuda.stream(...)`` do, with fewer calls into CUDA and torch per collective (on the H100 a
    call took a median 165 us more than with torch's nccl): no new CUDA event per call
    (one serves every call, because a stream waits for what was recorded when ``wait_event`` is
    called, not for later records) and no stream context object.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.cuda_stream = self.stream.cuda_stream
        self._caller_reached = torch.cuda.Event()  # callers serialise run() (NcclPath._launch's lock)

    def run(self, tensors: list[torch.Tensor], enqueue: Callable[[], None]) -> None:
        if self.device.index != torch.cuda.current_device():
            # set_stream also makes the stream's device current: keep the caller's afterwards
            with torch.cuda.device(self.device):
                return self.run(tensors, enqueue)
        caller = torch.cuda.current_stream(self.device)
        self._caller_reached.record(caller)
        self.stream.wait_event(self._caller_reached)
        torch.cuda.set_stream(self.stream)
        try:
            enqueue()
        finally:
            torch.cuda.set_stream(caller)
        for t in tensors:
            t.record_stream(self.stream)
