"""Each member's heartbeat: a counter in the job's store that moves while the rank lives, and
the watch over the other members' counters.

The counter is added to by a process of its own (beating.py), so a rank that holds its GIL for
seconds, or is starved of CPU, still beats; a stopped rank does not, and is declared lost. A
thread of the rank beats until that process says it beats (it imports torch first: seconds on a
loaded machine; making a Heartbeat waits for it, up to a minute), and where the store is not a
TCPStore (the process could not reach it), for good.

The same thread reads the members' counters four times a second: a member whose counter stood
still for ``stale_after`` is dead, stopped or cut off, and ``on_stale`` hears of it at once. It
also reads how many replacements asked to join. Where this rank's own beating ends on an error
(the store's client failed, the process died), ``on_stopped`` hears of it: the others no longer
hear this rank, so it must not train on.
"""

from __future__ import annotations

import logging
import os
import select
import subprocess
import sys
import threading
import time
from datetime import timedelta
from typing import Callable, Iterable

import torch.distributed as dist

from ..backend import before_exit
from . import beating, store_link
from .errors import HeartbeatStoppedError
from .job_store import JobStore

_log = logging.getLogger("smddp_lite")

BEAT_S = 0.5  # how often a rank adds to its counter
LOOK_S = 0.25  # how often it reads the others': a stale counter is seen within this of stale_after
PROCESS_START_S = 60.0  # how long making a Heartbeat waits for its process's first beat (importing torch)


def cut_off_after(stale_after_s: float) -> float:
    """How long a store request of the heartbeat may wait before this rank takes itself for cut
    off from the store. The members declare a rank lost once its counter stood still for
    ``stale_after``: a rank whose requests went unanswered for five times that has been given
    up by every member that still reaches the store, and it should say so, not wait on."""
    return max(10.0, 5 * stale_after_s)


class Heartbeat:
    """This rank's counter, beaten by a process of its own, and the watch over the members'."""

    def __init__(self, store: JobStore, rank: int, stale_after_s: float,
                 on_stale: Callable[[tuple[int, ...], float], None] | None = None,
                 on_stopped: Callable[[str], None] | None = None, wait_for_process: bool = True) -> None:
        self.store, self.rank, self.stale_after_s = store, rank, stale_after_s
        self.on_stale, self.on_stopped = on_stale, on_stopped
        self._stop = threading.Event()
        # a client of its own: a request of the watch never waits behind the training's
        self._store = JobStore(store.prefix, _own_client(store.root, cut_off_after(stale_after_s)))
        # this process's store requests (the training's, the backend's, this heartbeat's) fail once
        # unacknowledged for the cut-off time, rather than wait for good on a cut-off host
        store_link.bound_unacknowledged_requests(store.root, cut_off_after(stale_after_s))
        self._store.add(self.key(rank), 1)
        self.tickets = 0  # replacements that asked to join so far, as last read
        self._lock = threading.Lock()
        self._seen: dict[int, tuple[int, float]] = {}  # member -> (its count, when it was seen to move)
        self._first: dict[int, int] = {}  # member -> its count at the first look: moved() compares with it
        self._looked_at = time.monotonic()  # the last look's time: staleness is judged as of it
        self._declared: set[int] = set()  # members on_stale was told of
        self.failure: BaseException | None = None  # what ended the beating, where it ended unasked
        self._all_beating = False  # every watched member's key exists (then one multi_get reads them)
        self._process = self._start_process(store)
        self._thread_beats = True  # until the process says it beats
        self._process_beating = threading.Event()
        self._rounds = 0  # the thread's rounds of store requests done: the watchdog sees it move
        self._thread = threading.Thread(target=self._run, name="smddp-heartbeat", daemon=True)
        self._thread.start()
        # a store request to a host cut off by the network never returns (the client's timeout
        # bounds its connecting and its waits for keys, not a reply that never comes)
        threading.Thread(target=self._watch_the_store, name="smddp-heartbeat-watchdog", daemon=True).start()
        before_exit.stop_at_exit(self.stop)
        if wait_for_process:
            self._wait_for_process()

    @staticmethod
    def key(rank: int) -> str:
        return f"beat/{rank}"

    def _start_process(self, store: JobStore) -> subprocess.Popen | None:
        if not isinstance(store.root, dist.TCPStore):
            _log.info("smddp: the heartbeat beats on a thread: its process reaches only a TCPStore, not a %s",
                      type(store.root).__name__)
            return None
        # -P: the script's folder (this package's) is not put on sys.path before torch's
        isolate = ["-P"] if sys.version_info >= (3, 11) else []
        command = [sys.executable, *isolate, beating.__file__, str(os.getpid()), store.root.host,
                   str(store.root.port), store.prefix, self.key(self.rank), str(BEAT_S),
                   str(cut_off_after(self.stale_after_s))]
        # torch's import would load this library's backend through its entry point: not needed to beat
        env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0")
        try:
            return subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, env=env)
        except OSError as exc:
            _log.warning("smddp: the heartbeat's process did not start (%r); it beats on a thread, which a rank "
                         "that holds the GIL for longer than stale_after cannot keep beating", exc)
            return None

    def _wait_for_process(self) -> None:
        """Wait for the process's first beat (the thread beats meanwhile): from then on the beat
        holds whatever this rank does. Up to PROCESS_START_S, then the thread beats on."""
        if self._process is None:
            return
        deadline = time.monotonic() + PROCESS_START_S
        while not self._process_beating.wait(0.05):
            if self._process is None or self.failure is not None:
                return
            if time.monotonic() > deadline:
                _log.warning("smddp: the heartbeat's process did not beat within %g s; a thread beats until it does",
                             PROCESS_START_S)
                return

    def wait_for_first_beats(self, members: Iterable[int], timeout_s: float) -> None:
        """Until every one of ``members`` has beaten once, that is, made its SurvivingSync."""
        members = tuple(members)
        keys = [self.key(r) for r in members]
        try:
            self.store.wait(keys, timedelta(seconds=timeout_s))
        except dist.DistStoreError as exc:
            missing = [r for r, key in zip(members, keys) if not self.store.check([key])]
            raise RuntimeError(
                f"[smddp rank {self.rank}] SurvivingSync: {said(tuple(missing))} made no SurvivingSync within "
                f"the group's timeout ({timeout_s:g} s); every rank must make one, at the same point of its "
                f"script") from exc

    def watch(self, members: Iterable[int]) -> None:
        """Read these ranks' counters from now on (this rank's own excepted); a rank watched
        before keeps its count and the time it last moved."""
        now = time.monotonic()
        with self._lock:
            self._seen = {r: self._seen.get(r, (-1, now)) for r in members if r != self.rank}
            self._all_beating = False

    def watch_also(self, ranks: Iterable[int]) -> None:
        """Read these ranks' counters too (replacements to lease), keeping the members watched."""
        now = time.monotonic()
        with self._lock:
            for r in ranks:
                if r != self.rank and r not in self._seen:
                    self._seen[r] = (-1, now)
                    self._all_beating = False

    def moved(self, rank: int) -> bool:
        """Whether watched ``rank``'s counter moved since the first look at it (it beats now)."""
        with self._lock:
            first = self._first.get(rank)
            return first is not None and self._seen.get(rank, (first,))[0] != first

    def stale(self, rank: int) -> bool:
        """Whether watched ``rank``'s counter stood still for ``stale_after`` as of the last look
        (not as of now: a look delayed by this rank's own load proves nothing of the others)."""
        with self._lock:
            since = self._seen.get(rank, (-1, self._looked_at))[1]
            return self._looked_at - since >= self.stale_after_s

    def _run(self) -> None:
        next_beat = time.monotonic() + BEAT_S
        while not self._stop.wait(LOOK_S):
            try:
                if self._process is not None:
                    self._check_process()
                if time.monotonic() >= next_beat:
                    if self._thread_beats:
                        self._store.add(self.key(self.rank), 1)
                    self.tickets = self._store.add("tickets", 0)
                    next_beat = time.monotonic() + BEAT_S
                self._look()
                self._rounds += 1
            except Exception as exc:
                # the store's host is gone (at the job's end, where a rank hosts it) or this
                # rank's client failed: the next sync() raises rather than train on unheard
                self._stopped_on(exc)
                return

    def _check_process(self) -> None:
        ready = self._thread_beats and select.select([self._process.stdout], [], [], 0)[0]
        if ready and self._process.stdout.readline().strip() == b"beating":
            self._thread_beats = False  # the process beats from now on
            self._process_beating.set()
        status = self._process.poll()
        if status is not None and not self._stop.is_set():
            said_ = self._process.stderr.read().decode(errors="replace").strip()
            how = f"was killed by signal {-status}" if status < 0 else f"exited with status {status}"
            raise RuntimeError(f"the heartbeat's process (pid {self._process.pid}) {how}"
                               + (f": {said_}" if said_ else ""))

    def _watch_the_store(self) -> None:
        """End the beating once the thread's store requests went unanswered for the cut-off time
        (``cut_off_after``). Only the time this watchdog saw pass counts, a tick at most twice
        LOOK_S: a rank stopped (SIGSTOP) or holding the GIL for long does not count as cut off."""
        cut_off_s = cut_off_after(self.stale_after_s)
        stalled, seen, last = 0.0, -1, time.monotonic()
        while not self._stop.wait(LOOK_S):
            now, rounds = time.monotonic(), self._rounds
            stalled = stalled + min(now - last, 2 * LOOK_S) if rounds == seen else 0.0
            seen, last = rounds, now
            if stalled >= cut_off_s and self.failure is None:
                root = self.store.root
                where = f" at {root.host}:{root.port}" if isinstance(root, dist.TCPStore) else ""
                self._stopped_on(TimeoutError(
                    f"the job's store{where} answered none of this rank's requests for {stalled:.0f} s: this "
                    "host is cut off from it (a network partition, or the store's host is down)"))
                return

    def _stopped_on(self, exc: BaseException) -> None:
        with self._lock:
            if self.failure is not None:  # the thread and the watchdog may both find it
                return
            self.failure = exc
        _log.warning("smddp: rank %d's heartbeat stopped: %r", self.rank, exc)
        if self.on_stopped is not None:
            self.on_stopped(f"this rank's heartbeat stopped ({exc!r})")

    def beating(self) -> bool:
        """It beats: not stopped (as a rank declared lost is) and not ended on an error."""
        return not self._stop.is_set() and self.failure is None

    def raise_if_stopped(self) -> None:
        """Raise ``HeartbeatStoppedError`` where the beating ended on an error."""
        if self.failure is not None:
            raise HeartbeatStoppedError(
                f"[smddp rank {self.rank}] SurvivingSync: this rank's heartbeat stopped ({self.failure!r}), so the "
                f"other ranks no longer hear it and declare it lost once stale_after ({self.stale_after_s:g} s) "
                "passes. A lost rank cannot rejoin: end this process (smddp_lite.launch with --max-restarts starts "
                "a replacement). Is the rendezvous store still up, and reachable from this host?") from self.failure

    def _look(self) -> None:
        with self._lock:
            ranks = list(self._seen)
            all_beating = self._all_beating
        if not ranks:
            self._looked_at = time.monotonic()
            return
        keys = [self.key(r) for r in ranks]
        if not all_beating:  # multi_get would wait for a key that no beat made yet
            all_beating = self._store.check(keys)
        counts = [int(c) for c in self._store.multi_get(keys)] if all_beating else [
            self._store.add(k, 0) for k in keys]
        now, stale, stood = time.monotonic(), [], 0.0
        with self._lock:
            self._looked_at = now
            self._all_beating = all_beating or self._all_beating
            for r, count in zip(ranks, counts):
                if r not in self._seen:  # no longer watched
                    continue
                self._first.setdefault(r, count)
                if count != self._seen[r][0]:
                    self._seen[r] = (count, now)
                elif now - self._seen[r][1] >= self.stale_after_s and r not in self._declared:
                    self._declared.add(r)
                    stale.append(r)
                    stood = max(stood, now - self._seen[r][1])
        if stale and self.on_stale is not None:
            self.on_stale(tuple(stale), stood)

    def stop(self) -> None:
        """End the beating and the watch, and wait for the thread's last store request
        (backend/before_exit.py calls it at the interpreter's exit)."""
        self._stop.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=2 * LOOK_S + 1)
        process = self._process
        if process is None:
            return
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=2)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for pipe in (process.stdout, process.stderr):
            pipe.close()

    @property
    def process(self) -> subprocess.Popen | None:
        """The process that beats, where one does."""
        return self._process


def _own_client(store: dist.Store, timeout_s: float) -> dist.Store:
    if isinstance(store, dist.TCPStore):
        return dist.TCPStore(store.host, store.port, is_master=False, timeout=timedelta(seconds=timeout_s))
    return store


def said(ranks: tuple[int, ...]) -> str:
    """"rank 3" or "ranks 1, 2"."""
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))
