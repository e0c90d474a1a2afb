"""The watchdog: notices CUDA collectives that failed or got stuck, and aborts their communicator.

NCCL reports some errors only asynchronously (a peer's connection dropped, a remote rank died)
and a collective whose peers never arrive spins on the GPU forever. A daemon thread per process
group therefore polls, every ``POLL_S``, the collectives still in flight: those whose end event
has passed are released (asked newest first: one communicator per device ends them in order);
otherwise the communicator's asynchronous error is checked, and one older than the process
group's timeout counts as stuck. Either way every communicator of the group is
aborted (which makes NCCL's kernels return), every collective in flight fails with the reason,
and the group refuses later calls with it, on every rank that sees the failure, instead of
hanging. This is what ProcessGroupNCCL's watchdog does with TORCH_NCCL_ASYNC_ERROR_HANDLING.

CUDA graphs: while another thread captures in CUDA's default ("global") mode, an event query
from this thread would invalidate that capture. The thread therefore switches its own capture
mode to thread-local before its first query (it never captures anything itself), as
ProcessGroupNCCL's watchdog does; collectives made during a capture are not tracked at all.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from typing import Callable

import torch

from .. import before_exit
from ..errors import PeerFailureError
from .work import CudaWork

log = logging.getLogger("smddp_lite")

POLL_S = 0.1
CUDA_CAPTURE_MODE_THREAD_LOCAL = 1  # cudaStreamCaptureModeThreadLocal (0 is global, 2 relaxed)


def use_thread_local_capture_mode() -> bool:
    """Set the calling thread's CUDA stream-capture mode to thread-local: through the driver
    (one per process, and its calls make no context), else through the CUDA runtime torch has
    loaded (dlopen by soname finds that copy). False, with a warning, where neither is reachable:
    an event query of this thread during a capture elsewhere would then invalidate that capture."""
    major = (torch.version.cuda or "").split(".")[0]
    tried = []
    for library, function in (("libcuda.so.1", "cuThreadExchangeStreamCaptureMode"),
                              (f"libcudart.so.{major}", "cudaThreadExchangeStreamCaptureMode")):
        try:
            mode = ctypes.c_int(CUDA_CAPTURE_MODE_THREAD_LOCAL)
            status = getattr(ctypes.CDLL(library), function)(ctypes.byref(mode))
        except (OSError, AttributeError) as exc:
            tried.append(f"{library}: {exc}")
            continue
        if status == 0:
            return True
        tried.append(f"{function} returned {status}")
    log.warning("smddp: the watchdog could not make its CUDA capture mode thread-local (%s); capture CUDA "
                "graphs with torch.cuda.graph(..., capture_error_mode='thread_local')", "; ".join(tried))
    return False


class Watchdog:
    """Tracks the CUDA collectives of one process group until they end.

    Args:
        check_async_error: raises when a communicator reports an asynchronous error.
        abort: aborts every communicator of the group (idempotent).
        on_failure: records the failure reason on the process group.
    """

    def __init__(self, name: str, check_async_error: Callable[[], None], abort: Callable[[], None],
                 on_failure: Callable[[str], None]) -> None:
        self._check_async_error = check_async_error
        self._abort = abort
        self._on_failure = on_failure
        self._pending: list[CudaWork] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._capture_mode_set = False  # done once, by the thread that queries events
        self._thread = threading.Thread(target=self._loop, name=f"smddp-watchdog-{name}", daemon=True)
        self._thread.start()
        before_exit.stop_at_exit(self.stop)

    def track(self, work: CudaWork) -> None:
        with self._lock:
            self._pending.append(work)

    def in_flight(self) -> int:
        with self._lock:
            return len(self._pending)

    def _loop(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                self.poll()
            except Exception as exc:  # e.g. a sticky CUDA error, which reaches every thread
                try:  # fail the group rather than let its timeouts and aborts go quiet
                    self.fail_all(f"the watchdog could not check the collectives in flight: {exc}")
                except Exception:
                    log.exception("smddp: the watchdog could not abort the group's communicators")

    def fail_all(self, reason: str) -> None:
        """Abort the group's communicators and fail every collective in flight with ``reason``:
        the watchdog's own verdicts, and a launch that NCCL refused (the collectives enqueued
        before it would otherwise end "successfully" on aborted communicators)."""
        with self._lock:
            pending, self._pending = self._pending, []
        self._fail(reason, pending)

    def poll(self) -> None:
        """One round: release ended collectives, fail everything on an error or a timeout."""
        with self._lock:
            pending = list(self._pending)
        if not pending:
            return
        reason = None
        try:
            self._check_async_error()
        except Exception as exc:  # NCCL's own text, e.g. "NCCL_ERROR_REMOTE_ERROR: ..."
            reason = f"NCCL reported an asynchronous error: {exc}"
        ended = self._ended(pending)
        still = []
        now = time.monotonic()
        for work, done in zip(pending, ended):
            if done:
                work.release()  # done: its tensors may go (and a fast call's event serves again)
                continue
            if reason is None and now - work.started > work.timeout_s:
                reason = (f"{work.describe} did not complete within {work.timeout_s:g} s (the process group "
                          "timeout): a peer is stuck, dead or calling a different collective")
            still.append(work)
        if reason is not None:
            self._fail(reason, still)
            still = []
        with self._lock:
            self._pending = still + self._pending[len(pending):]

    def _ended(self, pending: list[CudaWork]) -> list[bool]:
        """Which of ``pending`` (in launch order) have ended. A group's collectives on one
        device end in launch order: they share one NCCL communicator, whose kernels NCCL runs one
        after another whichever stream each was enqueued on (the group's own, or a caller's for
        the fast path's blocking calls), so each device's works are asked from
        the newest back, and the first that has ended vouches for all before it: a poll costs a
        few event queries, not one per call in flight (a loop of small collectives launches
        hundreds between two polls, and the queries hold the interpreter lock its caller needs)."""
        ended = [work.error is not None for work in pending]
        by_device: dict[object, list[int]] = {}
        for i, work in enumerate(pending):
            by_device.setdefault(work.device, []).append(i)
        for device, indices in by_device.items():
            # the event's device made current: a thread starts on device 0, and a CUDA call there
            # would give every rank a context (hundreds of MiB) on the first GPU
            with torch.cuda.device(device):
                if (not self._capture_mode_set and getattr(device, "type", None) == "cuda"
                        and threading.current_thread() is self._thread):  # the mode is per thread
                    self._capture_mode_set = True  # tried once: it fails the same way each time
                    use_thread_local_capture_mode()
                for position in range(len(indices) - 1, -1, -1):
                    if pending[indices[position]].ended():
                        for i in indices[:position + 1]:
                            ended[i] = True
                        break
        return ended

    def _fail(self, reason: str, works: list[CudaWork]) -> None:
        log.error("smddp: %s; aborting the group's NCCL communicators", reason)
        self._on_failure(reason)
        try:
            self._abort()
        finally:
            for work in works:
                work.fail(PeerFailureError(reason))

    def stop(self) -> None:
        self._stop.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=2)
