"""A shared-memory segment that the ranks of one host map, and the control plane that orders them.

Layout (all offsets multiples of 64 bytes, so no two ranks write one cache line)::

    control   (world_size, 16) int64   one line pair per rank: phase, pid, broken flag, rejected
                                       call, and two copies of the op header (even/odd op seq)
    reasons   (world_size, 512) bytes  why a rank broke or rejected an op (UTF-8)
    data      2 x world_size x chunk   two buffer sets, used by alternate steps

Ordering relies on x86-64's total store order: a rank writes data, then bumps its phase counter
with one aligned 8-byte store; a peer that reads the new phase therefore sees the data. Every torch
op in between also releases and retakes the GIL (a locked instruction, a full fence), which orders
the non-temporal stores large copies may use. ``select`` only offers this transport on x86-64.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import re
import signal
import stat
import struct
import threading
import time
import uuid
from datetime import timedelta

import numpy as np
import torch

from .. import agreement
from ..errors import PeerFailureError, PeerRefusedError, SegmentRefusedError, ranks_said, where
from ..signatures import MISMATCH_SAID, mismatch_said
from .local_peers import alive
from .refusals import explained

PHASE, PID, BROKEN, REJECTED = 0, 1, 2, 3
HEADER = 4  # two headers of 10 fields: the op's seq, call index, op code, dtype code, numel, arg,
# and the user's call (its signature: op, dtype, numel, arg) where the op is a step of it, else 0s
HEADER_FIELDS = ("seq", "call", "op", "dtype", "numel", "arg", "call_op", "call_dtype", "call_numel", "call_arg")
_CALL_FIELDS = slice(6, 10)
CALL = HEADER + 2 * len(HEADER_FIELDS)  # the process-group call the rank is inside (entering)
_HEADER_PACKING = struct.Struct(f"<{len(HEADER_FIELDS)}q")  # a header as the control words hold it
CONTROL_WORDS = CALL + 1
REASON_BYTES = 512
# Poll with sched_yield this long, then sleep. Peers of a small collective arrive within tens of
# microseconds; a longer wait means a peer still computing or waiting on the network, and there a
# yielding poll still takes a core from it (Linux's CFS hands a yielding thread the CPU back
# at once). With 2 simulated hosts x 2 ranks on 2 cores (DDP, bfloat16 wire) a 20 ms yield
# window gave 168 ms per step, 1 ms 155 ms, 0.2 ms 150 ms; small all_reduce p50 stayed 43 us.
_YIELD_FOR_S = 0.0002
_SLEEP_S = 100e-6  # then poll every 0.1 ms: long waits are a peer still computing
_CHECK_EVERY_S = 0.05  # how often a waiting rank looks for dead or aborted peers
# How long past the timeout a rank waits for the group's board when the peer it waits for is
# inside the same call, waiting between hosts (hierarchical): that peer's own error names the
# rank it waited for; this one's could name only the host-mate
_BOARD_GRACE_S = 1.0


def _align(n: int, to: int = 4096) -> int:
    return (n + to - 1) // to * to


class ShmSegment:
    """The mapped segment of one process group on one host, with its barrier and failure checks."""

    def __init__(self, store, rank: int, world_size: int, chunk_bytes: int, timeout: timedelta, *,
                 shown_as: tuple[int, int] | None = None, peers_shown: list[int] | None = None,
                 refused=None, announce=None) -> None:
        self.shown_as, self.peers_shown, self.refused, self.announce = shown_as, peers_shown, refused, announce
        self.rank, self.world_size, self.chunk_bytes = rank, world_size, chunk_bytes
        self.timeout_s = timeout.total_seconds()
        self.interrupted: str | None = None  # the transport's interrupt(): waits end with it
        self._control_bytes = _align(world_size * CONTROL_WORDS * 8)
        self._reason_off = self._control_bytes
        self._data_off = _align(self._reason_off + world_size * REASON_BYTES)
        size = self._data_off + 2 * world_size * chunk_bytes
        made = os.path.join(SHM_DIR, _segment_name()) if rank == 0 else None
        with _removed_if_ended(made):  # a launcher ending rank 0 before all mapped it leaves no name
            self._mm, path = _map_shared(store, rank, world_size, size, self.timeout_s, made)
            self.control = np.frombuffer(self._mm, dtype=np.int64, count=world_size * CONTROL_WORDS)
            self.control = self.control.reshape(world_size, CONTROL_WORDS)
            self._bytes = torch.frombuffer(self._mm, dtype=torch.uint8)
            self.control[rank, PID] = os.getpid()
            self.control[rank, REJECTED] = -1
            self.control[rank, CALL] = -1
            self.phase = 0
            self._header_offsets = [[self._header_at(r, parity) for r in range(world_size)] for parity in (0, 1)]
            self.op_shown = "init"  # the op this rank is in, as messages name it (entering)
            # the rank that maps last removes the segment's name: rank 0 may be gone by then (killed
            # while it waited), and the name must not outlive the job
            if int(store.add("shm/mapped", 1)) == world_size:
                _unlink_quietly(path)
            if rank == 0:
                self._unlink_once_mapped(store, path)
        self.barrier()  # every pid and flag above is visible before the first collective

    def _unlink_once_mapped(self, store, path: str) -> None:
        """Rank 0 removes the segment's name as soon as every rank has mapped it, so nothing is left
        in /dev/shm even if the job is killed later. A rank that refused the published name, or
        ranks that never map it, break the segment, so ranks that did map it raise too."""
        deadline = time.monotonic() + self.timeout_s
        try:
            while int(store.add("shm/mapped", 0)) < self.world_size:
                if store.check([_REFUSED_KEY]):
                    said = store.get(_REFUSED_KEY).decode(errors="replace")
                    self.mark_broken(f"a rank refused the segment: {said}")
                    raise SegmentRefusedError(f"{where(0, self.world_size, 'init')} {said}")
                if time.monotonic() > deadline:
                    # a rank writes its pid into its control line as soon as it has mapped the segment
                    missing = [r for r in range(self.world_size) if int(self.control[r, PID]) == 0]
                    self._fail(f"{ranks_said(missing)} did not map the shared-memory segment within "
                               f"{self.timeout_s:.0f} s: died or stuck before it, or not sharing this host's "
                               "/dev/shm (set SMDDP_TRANSPORT=gloo where ranks do not share it)")
                time.sleep(0.001)
        finally:
            _unlink_quietly(path)  # the last rank to map it may have done so already

    # data ------------------------------------------------------------------------------------
    def slot(self, step: int, rank: int, dtype: torch.dtype) -> torch.Tensor:
        """The chunk of ``rank`` in buffer set ``step % 2``, viewed as ``dtype``."""
        start = self._data_off + ((step % 2) * self.world_size + rank) * self.chunk_bytes
        return self._bytes[start : start + self.chunk_bytes].view(dtype)

    # headers ---------------------------------------------------------------------------------
    def _header_at(self, rank: int, parity: int) -> int:
        """The byte offset of ``rank``'s header for ops of ``parity`` (control is the segment's start)."""
        return (rank * CONTROL_WORDS + HEADER + parity * len(HEADER_FIELDS)) * 8

    def publish_header(self, header: tuple[int, ...]) -> None:
        # packed into the mapping: half the time of a numpy row assignment, in every call
        _HEADER_PACKING.pack_into(self._mm, self._header_at(self.rank, header[0] % 2), *header)

    def check_headers(self, header: tuple[int, ...], signature_of, announce=None) -> None:
        """After the first barrier of an op: every rank published the same header, or all raise
        (each rank reads every header, so each finds it itself). ``signature_of``: a header's call
        in signatures.py's form, for the message; ``announce``: called with what differs before
        raising (the hierarchical transport's board: ranks on other hosts hear of it there)."""
        parity, mm, size = header[0] % 2, self._mm, _HEADER_PACKING.size
        # every rank's header bytes against this rank's own: a twentieth of a numpy compare's time,
        # in every call; what follows a difference is agreement's
        at = self._header_at(self.rank, parity)
        mine = mm[at : at + size]
        if all(mm[a : a + size] == mine for a in self._header_offsets[parity]):
            return
        base = HEADER + parity * len(HEADER_FIELDS)
        rows = [tuple(int(v) for v in h) for h in self.control[:, base : base + len(HEADER_FIELDS)]]
        self._refusal_behind_mismatch(header[1], rows)
        look = None
        if agreement.agreed([row[_CALL_FIELDS] for row in rows]) and any(rows[0][_CALL_FIELDS]):
            # the users' calls (shown where the ops are steps of one: the hierarchical
            # transport's) agree and their steps do not: name the steps. The settings that
            # choose steps agree (init compares them: shared_settings.py), so nothing the user
            # did explains it
            rows = [row[: _CALL_FIELDS.start] + (0,) * len(HEADER_FIELDS[_CALL_FIELDS]) for row in rows]
            look = ("The ranks made the same call and took different steps for it, with the same settings: this "
                    "is a bug in smddp-lite. Please report it with this message and the log of a run with "
                    "SMDDP_DEBUG=1 on every rank.")
        calls = [(self._shown(r), row[1], signature_of(row)) for r, row in enumerate(rows)]
        self.broken = True
        said = mismatch_said(calls, look=look)
        if announce is not None:
            announce(said)
        raise explained(said, self._where(numbered=False))

    def _refusal_behind_mismatch(self, call: int, rows: list[tuple[int, ...]]) -> None:
        """Headers of different calls where a rank refused one of them and went on to its next
        call before its peers looked: raise the refusal, with its reason, not the call numbers."""
        mine = int(self.control[self.rank, REJECTED])
        for peer, row in enumerate(rows):
            if peer == self.rank or row[1] == call:
                continue
            if self.control[peer, REJECTED] == call:  # it refused the call this rank is inside
                self._fail(f"rank {self._shown(peer)} refused this call: {self._reason(peer)}", PeerRefusedError)
            if mine == row[1]:  # this rank refused the call the peer is inside, and came to the next
                # the reason slot keeps the refusal's text: the peer, still inside that call, reads
                # this rank's refusal there (and only then that it broke)
                self._fail(f"rank {self._shown(peer)} is inside call #{row[1]}, which this rank refused "
                           f"({self._reason(self.rank)}), so this rank's later calls cannot pair with its peers'",
                           keep_reason=True)

    # control plane ---------------------------------------------------------------------------
    broken = False
    current_call = -1  # index of the process-group call this rank is inside (entering)
    refused = None  # the transport's look at its group's RefusalBoard, when its peers may refuse there
    # the transport's word to its group's ranks on other hosts (announce(call, reason)), which
    # cannot see this host's ranks die: they would wait between hosts for the group's timeout
    announce = None
    shown_as: tuple[int, int] | None = None  # the transport's (rank, world size) for messages, if not ours
    peers_shown: list[int] | None = None  # the rank messages give each of ours, if not ours (Transport's)

    def barrier(self) -> None:
        """Advance this rank's phase and wait until every rank has reached it."""
        self.phase += 1
        self.control[self.rank, PHASE] = self.phase
        for peer in range(self.world_size):
            if self.control[peer, PHASE] < self.phase:
                self._wait_for(peer)

    def _wait_for(self, peer: int) -> None:
        """Poll ``peer``'s phase. Each poll first yields the core (sched_yield, which also drops the
        GIL), so a rank that shares a core with its peer, or a training thread that shares the GIL
        with this one, runs instead of being starved; after _YIELD_FOR_S of waiting, polls sleep."""
        phase, control = self.phase, self.control
        start = time.monotonic()
        next_check = start + _CHECK_EVERY_S
        while control[peer, PHASE] < phase:
            now = time.monotonic()
            if now - start < _YIELD_FOR_S:
                os.sched_yield()
            else:
                time.sleep(_SLEEP_S)
            if now >= next_check:
                self._check_peers(peer, now - start)
                next_check = now + _CHECK_EVERY_S

    def _check_peers(self, waiting_for: int, waited_s: float) -> None:
        if self.interrupted is not None:  # Transport.interrupt: a peer found lost from outside the call
            self._fail_telling_others(self.interrupted)
        for peer in range(self.world_size):
            # a refusal of this call first: a refusing rank that goes on to its next call breaks
            # the group there (this rank is still inside the refused call), and under load this
            # rank may look only after both, when the refusal is still what happened
            if self.control[peer, REJECTED] == self.current_call >= 0:
                self._fail(f"rank {self._shown(peer)} refused this call: {self._reason(peer)}", PeerRefusedError)
            if self.control[peer, BROKEN]:
                reason = self._reason(peer)
                if reason.startswith(MISMATCH_SAID):  # the group's board found it: say what it said
                    self._fail_as_told(reason)
                self._fail_telling_others(f"rank {self._shown(peer)} aborted: {reason}")
        said = self.refused() if self.refused is not None else None
        if said is not None:  # a rank on another host, seen by the whole group (hierarchical)
            self._fail_as_told(said)
        pid = int(self.control[waiting_for, PID])
        if pid and not alive(pid):
            self._fail_telling_others(f"rank {self._shown(waiting_for)} (pid {pid}) died")
        if waited_s > self.timeout_s:
            inside = int(self.control[waiting_for, CALL]) == self.current_call >= 0
            if inside and self.refused is not None:
                # the peer is in this call too, waiting on the ranks of other hosts: its wait
                # there ends about now, and what it found goes on the group's board, read above
                if waited_s <= self.timeout_s + _BOARD_GRACE_S:
                    return
                self._fail(
                    f"rank {self._shown(waiting_for)} is in this call too but did not reach this step of it within "
                    f"the process group timeout ({self.timeout_s:g} s): it waits for ranks on other hosts, whose "
                    "errors say which"
                )
            self._fail_telling_others(
                f"rank {self._shown(waiting_for)} did not arrive within the process group timeout "
                f"({self.timeout_s:g} s); it may be stuck or calling a different collective"
            )

    def _shown(self, r: int) -> int:
        """Rank ``r`` of this segment as messages name it: the user's rank."""
        return self.peers_shown[r] if self.peers_shown else r

    def _where(self, numbered: bool = True) -> str:
        """The prefix of the segment's errors, naming the rank as the user's group numbers it, and
        the call (not when the message itself names it: what the refusal board said does)."""
        op = f"{self.op_shown}, call #{self.current_call}" if numbered and self.current_call >= 0 else self.op_shown
        return where(*(self.shown_as or (self.rank, self.world_size)), op)

    def _fail(self, what: str, error: type[PeerFailureError] = PeerFailureError, keep_reason: bool = False) -> None:
        self.mark_broken(None if keep_reason else what)
        raise error(
            f"{self._where()} {what}. This process group can no "
            "longer be used; restart the job (or destroy and re-create the group)."
        )

    def _fail_telling_others(self, what: str) -> None:
        """Fail for a peer on this host that died or aborted, and say so to the ranks on other
        hosts (the peer's own word may never reach them)."""
        if self.announce is not None and self.current_call >= 0:
            self.announce(self.current_call, f"on its host, {what}")
        self._fail(what)

    def _fail_as_told(self, said: str) -> None:
        """Leave the call for what the group's refusal board said (refusals.explained's error)."""
        self.mark_broken(said)
        raise explained(said, self._where(numbered=False))

    def mark_broken(self, reason: str | None) -> None:
        """Tell every peer, now and in later calls, that this rank has left the protocol, and why
        (None: the reason already written stays)."""
        self.broken = True
        if reason is not None:
            self._write_reason(reason)
        self.control[self.rank, BROKEN] = 1

    def peer_left(self) -> str | None:
        """Why a peer marked itself broken (it left the protocol), or None: read from the control
        rows, which outlive the peers' own mappings."""
        if self.control is None:
            return None
        for peer in range(self.world_size):
            if peer != self.rank and self.control[peer, BROKEN]:
                return f"rank {self._shown(peer)} left the group: {self._reason(peer)}"
        return None

    def entering(self, call: int, op_shown: str) -> None:
        """This rank enters process-group call ``call``, which its messages name ``op_shown``."""
        self.current_call, self.op_shown = call, op_shown
        self.publish_call(call)

    def publish_call(self, call: int) -> None:
        """Show peers that this rank is inside process-group call ``call`` (perhaps waiting
        elsewhere: between hosts, in a hierarchical transport)."""
        self.control[self.rank, CALL] = call

    def reject(self, call: int, reason: str) -> None:
        """This rank refused process-group call ``call`` before entering it; peers waiting in that
        call raise instead of waiting for the timeout. Peers that rejected it too never enter it."""
        self._write_reason(reason)
        self.control[self.rank, REJECTED] = call

    def _write_reason(self, reason: str) -> None:
        raw = reason.encode()[: REASON_BYTES - 1] + b"\0"
        start = self._reason_off + self.rank * REASON_BYTES
        self._mm[start : start + len(raw)] = raw

    def _reason(self, rank: int) -> str:
        start = self._reason_off + rank * REASON_BYTES
        return self._mm[start : start + REASON_BYTES].split(b"\0", 1)[0].decode(errors="replace")

    def close(self) -> None:
        if self._mm is not None:
            self.control = None
            self._bytes = None
            # a caller may still hold a view (BufferError): the mapping then goes with the process
            with contextlib.suppress(BufferError):
                self._mm.close()
            self._mm = None


_FAILED = "failed:"


def _reserve(fd: int, path: str, size: int, rank: int, world_size: int, store) -> None:
    """Give the segment its pages now. ftruncate alone leaves them to be taken as the
    collectives first write them, and where /dev/shm is full then (Docker gives a container
    64 MB; DataLoader workers share tensors there) that write kills the process with SIGBUS.
    posix_fallocate fails here instead, and the error says what to change; the other ranks,
    waiting for the segment's name, get the same text."""
    os.ftruncate(fd, size)
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EFBIG):  # a file system that cannot reserve: pages come on first write
            return
        os.unlink(path)
        stats = os.statvfs("/dev/shm")
        message = (f"the shared-memory transport needs {size / 2**20:.0f} MiB in /dev/shm for this group of "
                   f"{world_size} ranks, and /dev/shm has {stats.f_bavail * stats.f_frsize / 2**20:.0f} MiB free of "
                   f"{stats.f_blocks * stats.f_frsize / 2**20:.0f} MiB ({exc.strerror}). Give it more room (docker run "
                   "--shm-size=1g; on Kubernetes an emptyDir with medium: Memory at /dev/shm), lower "
                   "SMDDP_SHM_CHUNK_BYTES (the segment is 2 x ranks x that), or set SMDDP_TRANSPORT=gloo.")
        store.set("shm/path", _FAILED + message)
        raise OSError(exc.errno, f"{where(rank, world_size, 'init')} {message}") from None


SHM_DIR = "/dev/shm"
# rank 0's pid namespace (the inode number of /proc/self/ns/pid, 0 where unknown), its pid there,
# and 48 random bits: a later job can tell from the name alone whether its maker is gone
SEGMENT_NAME = re.compile(r"smddp-([0-9]{1,20})-([0-9]{1,10})-[0-9a-f]{12}")
SEGMENT_NAME_SHOWN = "smddp-<pid namespace>-<pid>-<12 hex digits>"
_REFUSED_KEY = "shm/refused"


def _pid_namespace() -> int:
    """This process's pid namespace as a number (the "pid:[N]" link of /proc/self/ns/pid); 0
    where /proc does not show it, which no segment sweep then trusts."""
    try:
        return int(os.readlink("/proc/self/ns/pid").split("[", 1)[1].rstrip("]"))
    except (OSError, IndexError, ValueError):
        return 0


def _segment_name() -> str:
    """A fresh name that ``SEGMENT_NAME`` accepts."""
    return f"smddp-{_pid_namespace()}-{os.getpid()}-{uuid.uuid4().hex[:12]}"


def remove_stale_segments() -> list[str]:
    """Remove the names of segments whose maker has died, and return them.

    A job killed before every rank mapped its segment (so before the last one to map removed
    the name) leaves the segment in /dev/shm, holding its memory for good. Rank 0 of each later
    job sweeps: a name is removed only if it has this transport's exact pattern, was made in this
    process's own pid namespace (where its pid means the same process), is a regular file of this
    user (not a link: lstat), and no process of that pid is alive (a pid reused since makes the
    segment look alive: it stays, which is the safe side). Where /proc cannot show this process,
    nothing is proven and nothing removed. Ranks of the dead job that still map the segment keep
    their mapping: removing a name unmaps nothing."""
    namespace = _pid_namespace()
    if namespace == 0 or not alive(os.getpid()):
        return []
    removed = []
    try:
        entries = list(os.scandir(SHM_DIR))
    except OSError:
        return []
    for entry in entries:
        match = SEGMENT_NAME.fullmatch(entry.name)
        if match is None or int(match[1]) != namespace or alive(int(match[2])):
            continue
        try:
            found = entry.stat(follow_symlinks=False)
            if not stat.S_ISREG(found.st_mode) or found.st_uid != os.geteuid():
                continue
            os.unlink(entry.path)
        except OSError:  # gone meanwhile (another job's sweep), or not ours to remove
            continue
        removed.append(entry.name)
    return removed


def _unlink_quietly(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


# what a launcher ends a job's workers with: torchrun sends SIGTERM when one worker fails, and
# passes on the SIGINT, SIGHUP or SIGQUIT it gets itself. At their default action each ends the
# process at once, with no finally run
_ENDING_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


@contextlib.contextmanager
def _removed_if_ended(path: str | None):
    """While inside, a signal that would end this process removes ``path`` first (rank 0's
    segment, which until every rank has mapped it only rank 0 removes), then ends the process
    as the signal's default action does, so the launcher sees the same exit. Where ``path`` is
    None (the other ranks), nothing is done.

    Only signals left at their default action get this handler, and only for the time inside:
    one the user handles or ignores stays theirs (a handler of theirs that raises, as Python's
    own SIGINT handler does, reaches _unlink_once_mapped's cleanup anyway). Python runs signal
    handlers in the main thread, between bytecodes, so the unlink there is safe; a segment made
    on another thread goes without, and is left to remove_stale_segments."""
    if path is None or threading.current_thread() is not threading.main_thread():
        yield
        return

    def remove_and_end(signum, frame) -> None:
        _unlink_quietly(path)
        signal.signal(signum, signal.SIG_DFL)
        signal.raise_signal(signum)

    ours = [s for s in _ENDING_SIGNALS if signal.getsignal(s) == signal.SIG_DFL]
    for signum in ours:
        signal.signal(signum, remove_and_end)
    try:
        yield
    finally:
        for signum in ours:
            if signal.getsignal(signum) is remove_and_end:  # not replaced meanwhile
                signal.signal(signum, signal.SIG_DFL)


def _map_shared(store, rank: int, world_size: int, size: int, timeout_s: float,
                path: str | None = None) -> tuple[mmap.mmap, str]:
    """Rank 0 creates the segment at ``path`` (a fresh name of ``_segment_name``'s by default)
    and publishes its name; every other rank opens what was published only after checking it is
    such a segment. Returns the mapping and the path."""
    if rank == 0:
        remove_stale_segments()
        path = path or os.path.join(SHM_DIR, _segment_name())
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            _reserve(fd, path, size, rank, world_size, store)
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        store.set("shm/path", path)
        return mm, path
    path = store.get("shm/path").decode(errors="replace")
    if path.startswith(_FAILED):  # rank 0 could not make the segment: its error, on every rank
        raise OSError(errno.ENOSPC, f"{where(rank, world_size, 'init')} {path[len(_FAILED):]}")
    try:
        fd = _open_published(path, size)
    except FileNotFoundError:
        maker = _dead_maker(path)
        if maker is not None:  # its name went with it (a sweep of segments whose maker died)
            raise PeerFailureError(f"{where(rank, world_size, 'init')} rank 0 (pid {maker}) died before this "
                                   "rank mapped the shared-memory segment it made. Restart the job.") from None
        said = (f"the shared-memory segment {path!r} named by the rendezvous store does not exist: rank 0 may "
                "have failed, or the ranks do not share /dev/shm (set SMDDP_TRANSPORT=gloo then)")
        store.set(_REFUSED_KEY, f"rank {rank}: {said}")  # rank 0 hears of it instead of waiting
        raise SegmentRefusedError(f"{where(rank, world_size, 'init')} {said}") from None
    except SegmentRefusedError as exc:
        message = f"{where(rank, world_size, 'init')} {exc}"
        store.set(_REFUSED_KEY, f"rank {rank}: {exc}")  # rank 0 hears of it instead of waiting
        raise SegmentRefusedError(message) from None
    try:
        return mmap.mmap(fd, size), path
    finally:
        os.close(fd)


def _dead_maker(path: str) -> int | None:
    """The pid in a segment's name, where that process is in this pid namespace and has died."""
    match = SEGMENT_NAME.fullmatch(os.path.basename(path))
    if match is None or int(match.group(1)) != _pid_namespace() or not _pid_namespace():
        return None
    pid = int(match.group(2))
    return None if alive(pid) else pid


def _open_published(path: str, size: int) -> int:
    """Open, read-write, the segment rank 0 published as ``path``, refusing anything else.

    Anyone who can reach the rendezvous store can write this value, so it is trusted only as far
    as it names a segment this transport could have made: a name of ``SEGMENT_NAME``'s pattern
    directly in /dev/shm, not a link (O_NOFOLLOW), a regular file with one link, owned by this
    user, mode 0600, exactly ``size`` bytes. Nothing outside such files is ever opened for
    writing, so a store value cannot make a rank write into another file."""
    directory, name = os.path.split(path)
    if directory != SHM_DIR or not SEGMENT_NAME.fullmatch(name):
        raise SegmentRefusedError(
            f"refused the shared-memory segment path {path!r} from the rendezvous store: expected "
            f"{SHM_DIR}/{SEGMENT_NAME_SHOWN}, as rank 0 makes it. Something other than this "
            "job's rank 0 wrote that key; check who can reach the store (MASTER_ADDR:MASTER_PORT), "
            "or set SMDDP_TRANSPORT=gloo")
    dir_fd = os.open(SHM_DIR, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        # O_NONBLOCK: a FIFO or device planted under that name must not block the open
        fd = os.open(name, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dir_fd)
    except FileNotFoundError:
        raise  # _map_shared says why: its maker died, or /dev/shm is not shared
    except OSError as exc:
        raise SegmentRefusedError(
            f"refused the shared-memory segment {path!r} from the rendezvous store: it cannot be opened "
            f"as a plain file ({exc.strerror}); a link or special file there is not one rank 0 made") from None
    finally:
        os.close(dir_fd)
    found = os.fstat(fd)
    expected = dict(kind="a regular file", links=1, owner=os.geteuid(), mode="0o600", size=size)
    seen = dict(kind="a regular file" if stat.S_ISREG(found.st_mode) else "not a regular file",
                links=found.st_nlink, owner=found.st_uid, mode=oct(stat.S_IMODE(found.st_mode)),
                size=found.st_size)
    if seen != expected:
        os.close(fd)
        wrong = ", ".join(f"{k} {seen[k]} (expected {expected[k]})" for k in expected if seen[k] != expected[k])
        raise SegmentRefusedError(
            f"refused the shared-memory segment {path!r} from the rendezvous store: {wrong}. Rank 0 "
            "makes it as a fresh regular file of this user with mode 0600 and exactly the segment's size; "
            "something else wrote that key or made that file")
    return fd
