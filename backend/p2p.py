"""Point-to-point send and recv: one two-rank gloo group per pair of ranks that talk.

Collectives run on the group's transport in call order, numbered alike on every rank; a send
involves two ranks only, so it must stay out of that order (the other ranks never make the
call). Each pair of ranks that exchange messages gets a gloo group of its own instead, made on
first use by both of them, whatever transport the group's collectives use (shared memory, MPI,
gloo or the hierarchical one). Messages between two ranks keep their order per tag, as torch's
own backends and MPI promise.

A pair's group is made on a thread of its own. Making it waits until the peer makes it too, and
a rank may post a send to one peer while the peer it sends to is still posting to a third
(``batch_isend_irecv`` over a ring): made inline, each would wait for the next and none would
go on. Until the pair's group exists its calls are kept, and posted in call order once it does.
Gloo runs posted sends and receives on its own threads; ``wait()`` waits for them, bounded by the
group's timeout.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from . import sagemaker_host
from .errors import PeerFailureError, SMDDPError
from .ops import flat_view, moved_as_bytes
from .work import FutureOnRequest, complete_with_none


class PointToPointWork(dist._Work):
    """Handle of one send or recv. Its gloo work exists once the pair's group does; ``wait``
    waits for both, within the group's timeout, and raises failures as ``DistBackendError``."""

    def __init__(self, describe: str, kind: str, tensor: torch.Tensor, timeout: timedelta,
                 after: Callable[[], None] | None = None, failed: Callable[[str], None] | None = None) -> None:
        super().__init__()
        self._describe = describe
        self._kind = kind
        self._tensor = tensor
        self._failed = failed  # tells the pair's link that it cannot be used again
        self._timeout_s = timeout.total_seconds()
        self._after = after  # copies a received message into a non-contiguous tensor
        # Held until the call is posted to gloo (at once when the pair's group exists). A plain
        # lock, not an Event (a Condition and its lock): a round trip of two small messages took
        # 290 us against gloo's 160, and each call's own Python cost counts twice in it.
        self._posted = False
        self._posting = threading.Lock()
        self._posting.acquire()
        self._gloo_work = None
        self._error: BaseException | None = None
        self._finished = False
        self._lock = threading.Lock()  # one waiter at a time asks gloo; the others read its outcome
        self._future = FutureOnRequest(self._outcome)
        self._watcher: threading.Thread | None = None

    # called when the pair's group posts the call (or cannot)
    def _post(self, gloo_work, error: BaseException | None = None) -> None:
        self._gloo_work, self._error = gloo_work, error
        self._posted = True
        self._posting.release()

    def _outcome(self, _completed: torch.futures.Future) -> list[torch.Tensor]:
        if self._error is not None:
            raise self._error
        return [self._tensor]

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        limit = timeout.total_seconds() or self._timeout_s
        deadline = time.monotonic() + limit
        ended_now = False
        # another waiter (get_future's watcher, which waits for the group's timeout) may hold the
        # lock: this wait still ends at its own deadline, and fails the pair's link as a gloo wait
        # that times out closes the pair (the call must not be carried out later)
        if not self._lock.acquire(timeout=limit):
            error = PeerFailureError(
                f"{self._describe}: not complete within {limit:g} s; the peer is stuck, dead, or never calls the "
                "matching send/recv with this tag")
            if self._failed is not None:
                self._failed(str(error))
            raise error
        try:
            if not self._finished:
                self._wait_for_gloo(deadline, limit)
                self._finished = ended_now = True
        finally:
            self._lock.release()
        if ended_now:  # outside the lock: the future's callbacks may touch this work again
            self._future.end(complete_with_none)
        if self._error is not None:
            raise self._error
        return True

    def _wait_for_gloo(self, deadline: float, limit: float) -> None:
        """Wait for the call within ``limit`` s; any way it ends, ``_error`` says how."""
        if not self._posted and not self._posting.acquire(timeout=max(0.0, deadline - time.monotonic())):
            self._error = PeerFailureError(
                f"{self._describe}: the peer did not connect within {limit:g} s; it is stuck, dead, or never "
                "calls the matching send/recv")
        elif self._error is None:
            try:
                self._gloo_work.wait(timedelta(seconds=max(0.001, deadline - time.monotonic())))
                if self._after is not None:
                    self._after()
                return
            except Exception as exc:
                self._error = PeerFailureError(
                    f"{self._describe}: not complete within {limit:g} s or failed ({exc}); the peer is stuck, "
                    "dead, or never calls the matching send/recv with this tag")
        if self._failed is not None:  # gloo closes a pair whose wait timed out: later calls must say so
            self._failed(str(self._error))

    def is_completed(self) -> bool:
        if self._finished:
            return True
        if self._posted and (self._error is not None or self._gloo_work.is_completed()):
            try:
                self.wait()  # over: this only collects the outcome (and copies a received message out)
            except Exception:
                pass  # wait() and the future raise it
            return True
        return False

    def is_success(self) -> bool:
        return self.is_completed() and self._error is None

    def exception(self):
        return self._error

    def synchronize(self) -> None:
        self.wait()

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return [self._tensor]

    def result_tensors(self) -> list[torch.Tensor]:
        """What the call writes (the staged CUDA path copies these back): a recv's tensor only."""
        return [self._tensor] if self._kind == "recv" else []

    def get_future(self) -> torch.futures.Future:
        """Gloo's send and recv work has no future: a thread waits for this one and completes it."""
        future = self._future.get(complete_with_none)
        with self._lock:
            if not self._finished and self._watcher is None:
                self._watcher = threading.Thread(target=self._watch, daemon=True, name="smddp-p2p-future")
                self._watcher.start()
        return future

    def _watch(self) -> None:
        try:
            self.wait()
        except Exception:
            pass  # the future carries it (_outcome)


def _own_client(store):
    """A client of ``store`` for one link's thread. A TCPStore client runs one request at a time:
    with one client, a link waiting for its peer's key held up another link's writing of its own,
    and three ranks linking in a ring each waited on the next (a hang, seen at world size 3)."""
    try:
        return store.clone()
    except Exception:  # stores without clone (a custom one): shared
        return store


class _PairLink:
    """The gloo group of this rank and one peer, and the calls posted to it in call order."""

    def __init__(self, store, rank: int, peer: int, timeout: timedelta) -> None:
        self._pending: list[tuple[str, torch.Tensor, int, PointToPointWork]] = []
        self._group = None
        self._error: BaseException | None = None
        self._closed = False
        self._lock = threading.Lock()
        low, high = sorted((rank, peer))
        self._peer_in_pair = 0 if peer == low else 1
        prefix = dist.PrefixStore(f"p2p/{low}-{high}", _own_client(store))
        threading.Thread(target=self._make, args=(prefix, 0 if rank == low else 1, timeout), daemon=True,
                         name=f"smddp-p2p-{low}-{high}").start()

    def _make(self, store, rank_in_pair: int, timeout: timedelta) -> None:
        sagemaker_host.use_job_interface_for_gloo()
        try:
            group = dist.ProcessGroupGloo(store, rank_in_pair, 2, timeout)
            error = None
        except Exception as exc:  # the peer never came, or could not be reached
            group, error = None, SMDDPError(f"connecting to the peer failed: {exc}")
        with self._lock:
            if self._closed:  # the process group was destroyed while this link was being made
                return
            # a call that timed out before the link was made failed it (fail()): its calls, that
            # one among them, must not be carried out now (a later recv would get the wrong message)
            if self._error is None:
                self._group, self._error = group, error
            pending, self._pending = self._pending, []
            for call in pending:
                self._post(*call)

    def call(self, kind: str, tensor: torch.Tensor, tag: int, work: PointToPointWork) -> None:
        with self._lock:
            if self._group is None and self._error is None:
                self._pending.append((kind, tensor, tag, work))
            else:
                self._post(kind, tensor, tag, work)

    def _post(self, kind: str, tensor: torch.Tensor, tag: int, work: PointToPointWork) -> None:
        if self._error is not None:
            work._post(None, SMDDPError(f"{work._describe}: {self._error}"))
            return
        try:
            post = self._group.send if kind == "send" else self._group.recv
            work._post(post([tensor], self._peer_in_pair, tag))
        except Exception as exc:
            work._post(None, SMDDPError(f"{work._describe}: gloo refused the {kind}: {exc}"))

    def fail(self, reason: str) -> None:
        """A call on this link failed or timed out, and gloo closes the pair then: later calls
        fail at once, saying why, instead of reporting a crashed peer."""
        with self._lock:
            if self._error is None:
                self._error = SMDDPError(f"this pair's link failed earlier and cannot be used again ({reason})")
                self._group = None

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._group = None
            self._error = self._error or SMDDPError("the process group was destroyed")
            pending, self._pending = self._pending, []
            for call in pending:  # their waits raise now, not at the timeout
                self._post(*call)


class PeerLinks:
    """This rank's point-to-point links in one process group, made as peers are first named."""

    def __init__(self, store, rank: int, timeout: timedelta) -> None:
        self._store, self._rank, self._timeout = store, rank, timeout
        self._links: dict[int, _PairLink] = {}
        self._lock = threading.Lock()

    def start(self, kind: str, tensor: torch.Tensor, peer: int, tag: int, describe: str) -> PointToPointWork:
        """Post a ``kind`` ("send" or "recv") of ``tensor`` with ``peer``; returns its Work."""
        with self._lock:
            link = self._links.get(peer)
            if link is None:
                link = self._links[peer] = _PairLink(self._store, self._rank, peer, self._timeout)
        after = None
        # gloo moves contiguous memory, as it is: a lazy negative or conjugate view holds its
        # values unresolved (a contiguous one was sent with the wrong sign)
        if not tensor.is_contiguous() or tensor.is_neg() or tensor.is_conj():
            wire = tensor.resolve_conj().resolve_neg().contiguous()
            if kind == "recv":
                def after() -> None:
                    with torch.no_grad():
                        tensor.copy_(wire)
            tensor_on_wire = wire
        else:
            tensor_on_wire = tensor
        work = PointToPointWork(describe, kind, tensor, self._timeout, after, link.fail)
        tensor_on_wire = tensor_on_wire.detach()
        if moved_as_bytes(tensor_on_wire.dtype):  # gloo's send and recv know only the dtypes it reduces
            tensor_on_wire = flat_view(tensor_on_wire).view(torch.uint8)
        link.call(kind, tensor_on_wire, tag, work)
        return work

    def close(self) -> None:
        with self._lock:
            for link in self._links.values():
                link.close()
            self._links.clear()
