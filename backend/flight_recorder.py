"""The flight recorder: every group's last calls, dumped in the format torch's analyzer reads.

torch's backends keep a ring of their last N calls per process (``TORCH_FR_BUFFER_SIZE``, 2000 by
default, as here; 0 turns it off) and ``python -m torch.distributed.flight_recorder.fr_trace``
reads one dump per rank and names the
rank and the call where a group went apart. torch's C++ recorder takes no entries from
a Python backend, so this module keeps the same ring and writes the same pickle (version "2.10",
the keys ``fr_trace``'s loader and matcher read). The process group hands each call to ``track``,
once, which returns the call's body wrapped; nothing below the group knows of the recorder.

A rank dumps when one of its calls fails (a timeout, a dead or refusing peer, a mismatch) and
posts ``fr/dump`` in the group's store; every other rank of the group, in a call or not (a rank
that skipped the call sits in user code), sees it within half a second on a thread of the group
and dumps too, so the analyzer gets every rank that is still alive.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import pickle
import threading
import time
from typing import Callable

import torch

from . import before_exit

VERSION = "2.10"  # the dump format torch 2.13 writes and fr_trace parses
_SIGNAL_KEY = "fr/dump"
_POLL_S = 0.5
_BACKEND_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
log = logging.getLogger("smddp_lite")

# torch's own profiling names (ProcessGroupNCCL's), since fr_trace matches ops by them and knows
# no others; ours differ where torch renamed the method (all_gather_into_tensor, ...)
_TORCH_NAMES = {"all_gather_into_tensor": "_all_gather_base", "reduce_scatter_tensor": "_reduce_scatter_base",
                "all_to_all_single": "all_to_all", "barrier": "all_reduce_barrier",
                "all_gather_into_tensor_coalesced": "all_gather_into_tensor_coalesced",
                "reduce_scatter_tensor_coalesced": "reduce_scatter_tensor_coalesced"}
_NAMES: dict[tuple[str, str], str] = {}  # (prefix, op): its profiling name, made once (one string for all)


def _profiling_name(prefix: str, op: str) -> str:
    """The name of ``op``'s calls in the dumps, made on its first call (``_NAMES`` then has it)."""
    name = _NAMES[(prefix, op)] = f"{prefix}:{_TORCH_NAMES.get(op, op)}"
    return name


# c10::ScalarType's names, as torch's dumps spell dtypes
_SCALAR_NAMES = {torch.float32: "Float", torch.float64: "Double", torch.float16: "Half", torch.bfloat16: "BFloat16",
                 torch.int8: "Char", torch.uint8: "Byte", torch.int16: "Short", torch.int32: "Int",
                 torch.int64: "Long", torch.bool: "Bool", torch.complex64: "ComplexFloat",
                 torch.complex128: "ComplexDouble"}


def _flag(env, names: tuple[str, ...], default: bool) -> bool:
    for name in names:
        if name in env:
            return env[name].strip().lower() not in ("0", "false", "no", "off", "")
    return default


@dataclasses.dataclass(frozen=True)
class RecorderSettings:
    """What torch's variables say about the recorder; read once per group (``from_env``)."""

    buffer_size: int = 2000
    """Calls kept per process (TORCH_FR_BUFFER_SIZE, or TORCH_NCCL_TRACE_BUFFER_SIZE; torch's
    default too); 0 turns the recorder off and every call then skips it."""
    dump_prefix: str = "/tmp/nccl_trace_rank_"
    """Each rank writes ``<prefix><global rank>`` (TORCH_FR_DUMP_TEMP_FILE, or
    TORCH_NCCL_DEBUG_INFO_TEMP_FILE), the names fr_trace infers the rank from."""
    dump_on_failure: bool = True
    """Dump when a call fails and when a peer's did (TORCH_NCCL_DUMP_ON_TIMEOUT)."""
    include_stack_traces: bool = True
    """Keep the Python stack of each call (TORCH_INCLUDE_STACK_TRACE)."""
    only_active: bool = False
    """Dump only calls not yet completed (TORCH_INCLUDE_ONLY_ACTIVE)."""

    def __post_init__(self) -> None:
        if self.buffer_size < 0:
            raise ValueError(f"TORCH_FR_BUFFER_SIZE must be 0 (off) or more, found {self.buffer_size}")

    @classmethod
    def from_env(cls, env=None) -> RecorderSettings:
        env = os.environ if env is None else env
        size = env.get("TORCH_FR_BUFFER_SIZE", env.get("TORCH_NCCL_TRACE_BUFFER_SIZE", str(cls.buffer_size)))
        try:
            buffer_size = int(size)
        except ValueError:
            raise ValueError(f"TORCH_FR_BUFFER_SIZE must be an integer, found {size!r}") from None
        return cls(buffer_size=buffer_size,
                   dump_prefix=env.get("TORCH_FR_DUMP_TEMP_FILE",
                                       env.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", cls.dump_prefix)),
                   dump_on_failure=_flag(env, ("TORCH_NCCL_DUMP_ON_TIMEOUT",), True),
                   include_stack_traces=_flag(env, ("TORCH_INCLUDE_STACK_TRACE",), True),
                   only_active=_flag(env, ("TORCH_INCLUDE_ONLY_ACTIVE",), False))


# An entry is a plain tuple of ints, strings and tuples that are made once and shared (a call's
# sizes, its thread): the GC untracks such a tuple at its first collection, so the ring's thousands
# of live entries cost the full collections nothing. (An object per entry stays tracked: in a job,
# the ring of such entries set off an extra full collection, of 50-200 ms, every few thousand
# calls. Tuples nested in a new entry stay tracked for a while too: a collection untracks one level
# of them.) Fields, in order:
#   record_id, pg_id, seq_id, p2p_seq_id, profiling name, input sizes, output sizes,
#   time created (ns), thread (ident, name)
# where sizes are ((shape, dtype), ...) with shape a tuple of ints: spelled out only at a dump.
# The ring keeps the rest in lists of its own, slot by slot: the stack (a CapturedTraceback, a type
# the GC knows, so that a tuple holding one stays tracked) and the times started and completed.

_SIZES: dict[tuple, tuple] = {}  # the (shape, dtype) of a call's tensors: their sizes, made once
_SIZES_KEPT = 4096  # then forgotten, all at once: shapes that change with every call cannot grow it


def _sizes(tensors: list[torch.Tensor]) -> tuple:
    """((shape, dtype), ...) of the tensors, the same tuple for every call of the same sizes."""
    if len(tensors) == 1:  # most calls: a key made without a comprehension's frame, in half the time
        t = tensors[0]
        key = (t.shape, t.dtype)
    else:
        key = tuple([(t.shape, t.dtype) for t in tensors])
    sizes = _SIZES.get(key)
    if sizes is None:
        if len(_SIZES) >= _SIZES_KEPT:
            _SIZES.clear()
        # plain tuples: a torch.Size (a subclass) would keep them tracked by the GC for good
        sizes = _SIZES[key] = tuple([(tuple(t.shape), t.dtype) for t in tensors])
    return sizes


def _spelled(sizes: tuple) -> tuple[list[list[int]], list[str]]:
    return ([list(shape) for shape, _ in sizes],
            [_SCALAR_NAMES.get(dtype) or str(dtype).removeprefix("torch.") for _, dtype in sizes])


# The caller's Python stack as torch's own recorder takes it (CapturedTraceback::gather): in C,
# each frame's code object and offset, about a tenth of the time a walk of the frames in Python
# takes (1 against 10 us for 20 frames, measured side by side); names, files and lines are read
# only at a dump. Python frames only: TorchScript's and C++'s are not what a caller of a Python
# backend looks for.
_gather_stack = functools.partial(torch._C._profiler.gather_traceback, True, False, False)
_STACK_DEPTH = 40  # frames kept in a dump, from the first one outside this package


def _frames(stacks: list) -> list[list[dict]]:
    """Each stack's frames as the dumps spell them, innermost first, from the caller of the
    process group on (the frames of this package are the recorder's and the group's own); no
    frames for a stack not taken (None) or, with a warning, where torch cannot name them.

    torch's symbolizer asks torch._inductor for the frames of the code it generated, which
    imports it the first time (a second or two, once per process): only a dump pays that."""
    taken = [stack for stack in stacks if stack is not None]
    try:
        named = iter(torch._C._profiler.symbolize_tracebacks(taken) if taken else [])
    except Exception as exc:  # a dump is made where something already failed: it must not fail too
        log.warning("smddp: the flight recorder's dump has no stack traces: torch could not name their frames (%s)",
                    exc)
        return [[] for _ in stacks]
    result = []
    for stack in stacks:
        frames = next(named) if stack is not None else []
        first = 0
        while first < len(frames) and frames[first]["filename"].startswith(_BACKEND_DIR):
            first += 1
        result.append(frames[first:first + _STACK_DEPTH])
    return result


_thread = threading.local()


def _thread_of_caller() -> tuple[int, str]:
    """(ident, name) of this thread, made once per thread (current_thread() costs 0.2 us): a
    thread renamed after its first call keeps its first name here."""
    try:
        return _thread.ident_and_name
    except AttributeError:
        thread = threading.current_thread()
        _thread.ident_and_name = (thread.ident, thread.name)
        return _thread.ident_and_name


class _Ring:
    """The last ``size`` entries of a process, in lists made once: record ``i`` is in slot
    ``i % size``; its stack (None: not taken) and its start and completion times (None: not
    yet) are in the same slot of three more lists (the GC walks a list, not the ints in it)."""

    __slots__ = ("size", "entries", "stacks", "started", "completed")

    def __init__(self, size: int) -> None:
        self.size = size
        self.entries: list[tuple | None] = [None] * size
        self.stacks: list[object | None] = [None] * size
        self.started: list[int | None] = [None] * size
        self.completed: list[int | None] = [None] * size

    def put(self, entry: tuple, stack, started_ns: int | None = None) -> int:
        slot = entry[0] % self.size
        self.entries[slot], self.stacks[slot] = entry, stack
        self.started[slot], self.completed[slot] = started_ns, None
        return slot

    def held(self, next_record_id: int) -> list[tuple[tuple, object | None, int | None, int | None]]:
        """(entry, stack, started, completed) of every entry held, oldest first (a ring made
        larger holds none of the oldest records its size would allow)."""
        held = []
        for record_id in range(max(0, next_record_id - self.size), next_record_id):
            slot = record_id % self.size
            if self.entries[slot] is not None and self.entries[slot][0] == record_id:
                held.append((self.entries[slot], self.stacks[slot], self.started[slot], self.completed[slot]))
        return held


def _entry_dict(entry: tuple, started_ns: int | None, completed_ns: int | None, frames: list[dict]) -> dict:
    """An entry as torch's recorder writes it (the keys fr_trace reads)."""
    record_id, pg_id, seq_id, p2p_seq_id, name, inputs, outputs, created_ns, thread = entry
    group = _PROCESS.groups[pg_id]
    state = "scheduled" if started_ns is None else "started" if completed_ns is None else "completed"
    inputs, outputs = _spelled(inputs), _spelled(outputs)
    return {"record_id": record_id, "pg_id": pg_id, "process_group": (group.name, group.desc),
            "collective_seq_id": seq_id, "p2p_seq_id": p2p_seq_id, "op_id": seq_id,
            "profiling_name": name, "time_created_ns": created_ns,
            "input_sizes": inputs[0], "input_dtypes": inputs[1],
            "output_sizes": outputs[0], "output_dtypes": outputs[1],
            "state": state, "time_discovered_started_ns": started_ns,
            "time_discovered_completed_ns": completed_ns,
            "retired": state == "completed", "timeout_ms": group.timeout_ms, "is_p2p": p2p_seq_id > 0,
            "thread_id": str(thread[0]), "thread_name": thread[1], "frames": frames}


class _Process:
    """The ring of one process, holding every group's entries as torch's recorder does."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ring = _Ring(1)
        self.next_record_id = 0
        self.groups: dict[int, GroupRecorder] = {}
        self.global_rank = 0

    def resize(self, size: int) -> None:
        """Keep the last ``size`` entries (a group asked for another size than the first one)."""
        with self.lock:
            if self.ring.size == size:
                return
            ring = _Ring(size)
            for entry, stack, started, completed in self.ring.held(self.next_record_id)[-size:]:
                ring.completed[ring.put(entry, stack, started)] = completed
            self.ring = ring

    def dump(self, settings: RecorderSettings, include_collectives: bool = True,
             include_stack_traces: bool | None = None, only_active: bool | None = None) -> bytes:
        with_stack = settings.include_stack_traces if include_stack_traces is None else include_stack_traces
        active = settings.only_active if only_active is None else only_active
        with self.lock:
            held = self.ring.held(self.next_record_id) if include_collectives else []
            groups = list(self.groups.values())
        if active:
            held = [e for e in held if e[3] is None]
        frames = _frames([stack for _, stack, _, _ in held]) if with_stack else [[] for _ in held]
        return pickle.dumps({
            "version": VERSION, "comm_lib_version": "", "nccl_version": "",
            "pg_config": {g.name: {"name": g.name, "desc": g.desc, "ranks": str(g.ranks)} for g in groups},
            "pg_status": {str(g.pg_id): g.status() for g in groups},
            "entries": [_entry_dict(entry, started, completed, named)
                        for (entry, _, started, completed), named in zip(held, frames)]})


_PROCESS = _Process()
_WRITE_LOCK = threading.Lock()


def dump(include_collectives: bool = True, include_stack_traces: bool | None = None,
         only_active: bool | None = None) -> bytes:
    """This process's record as the pickled bytes torch's ``_dump_fr_trace`` returns.

    Example::

        open(f"/tmp/fr/rank_{dist.get_rank()}", "wb").write(smddp_lite.dump_fr_trace())
    """
    return _PROCESS.dump(RecorderSettings.from_env(), include_collectives, include_stack_traces, only_active)


def write(path: str | None = None) -> str:
    """Write this process's record to ``path`` (by default ``<TORCH_FR_DUMP_TEMP_FILE><global rank>``,
    the name fr_trace reads). A reader never sees half a file, and a process ended while it writes
    (as a launcher ends the rest of a failed job) leaves nothing that the analyzer would read."""
    settings = RecorderSettings.from_env()
    path = path or f"{settings.dump_prefix}{_PROCESS.global_rank}"
    # one writer at a time: a failed call's dump and a watcher's may overlap (the first dump of a
    # process takes a second or more, see _frames)
    with _WRITE_LOCK:
        data = _PROCESS.dump(settings)
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        _publish(path, data)
    return path


def _publish(path: str, data: bytes) -> None:
    """Put ``data`` at ``path`` whole, or leave the folder as it was.

    fr_trace reads every file under the folder whose name holds the prefix, so a temporary name
    beside the dump (``trace_1.<pid>.tmp``) made it fail when a process died mid-write. The data
    goes first into a file with no name (O_TMPFILE), which vanishes with the process, and gets
    its name only once written; where the system cannot do that, into a hidden name that holds
    no prefix and ends in no rank number, which the analyzer passes over."""
    folder = os.path.dirname(path) or "."
    hidden = os.path.join(folder, f".smddp-fr-{os.getpid()}-{threading.get_ident()}.partial")
    if _publish_unnamed(folder, path, hidden, data):
        return
    with open(hidden, "wb") as f:
        f.write(data)
    os.replace(hidden, path)


def _publish_unnamed(folder: str, path: str, hidden: str, data: bytes) -> bool:
    """``_publish`` through an unnamed file; False where this system cannot make or name one."""
    try:
        fd = os.open(folder, os.O_TMPFILE | os.O_WRONLY, 0o644)
    except (AttributeError, OSError):  # not Linux, or a file system without unnamed files
        return False
    try:
        with open(fd, "wb", closefd=False) as f:
            f.write(data)
        # linkat(AT_SYMLINK_FOLLOW) of /proc/self/fd/N names an unnamed file; os.link makes that
        # call only when given a folder's descriptor (plain link() refuses: EXDEV)
        proc = os.open("/proc", os.O_RDONLY | os.O_DIRECTORY)
        try:
            try:
                os.link(f"self/fd/{fd}", path, src_dir_fd=proc)  # the name comes with the whole file
            except FileExistsError:  # a later dump of this process replaces its earlier one
                os.link(f"self/fd/{fd}", hidden, src_dir_fd=proc)
                os.replace(hidden, path)
        finally:
            os.close(proc)
    except OSError:  # no /proc, or a system that cannot name the file: the hidden name then
        return False
    finally:
        os.close(fd)
    return True


def _write_soon() -> None:
    """``_write_or_warn()`` on a thread of its own, so that the failure that asks for a dump is
    raised at once: the first dump of a process takes a second or more (see _frames), which
    made errors late by that much. The thread is not a daemon: a process that ends with that
    error (its exception uncaught) waits for the dump before it exits."""
    threading.Thread(target=_write_or_warn, name="smddp-fr-dump").start()


def _write_or_warn() -> None:
    """``write()`` where the failure that asks for it must not be hidden by a second one: a dump
    that cannot be written is said, with how to fix it, and the caller goes on."""
    try:
        path = write()
    except OSError as exc:
        log.warning("smddp: the flight recorder's dump could not be written (%s); set TORCH_FR_DUMP_TEMP_FILE to a "
                    "writable path prefix", exc)
        return
    log.warning("smddp: the flight recorder's dump is in %s (read every rank's with python -m "
                "torch.distributed.flight_recorder.fr_trace <folder>)", path)


class GroupRecorder:
    """One group's part of the record: its identity for pg_config, its sequence numbers and the
    watcher that dumps when a peer did."""

    def __init__(self, settings: RecorderSettings, store, group, ranks: list[int], timeout_s: float) -> None:
        self.settings, self._group, self.ranks = settings, group, ranks
        self.timeout_ms = int(timeout_s * 1000)
        self.last = {"enqueued": -1, "started": -1, "completed": -1}
        self.p2p_seq = 0
        self._store, self._dumped, self._stop = store, threading.Event(), threading.Event()
        self._dump_claim = threading.Lock()  # the watcher's check of _dumped and its claim, as one step
        self._with_stack = settings.include_stack_traces
        _PROCESS.resize(settings.buffer_size)
        with _PROCESS.lock:
            self.pg_id = len(_PROCESS.groups)
            while self.pg_id in _PROCESS.groups:
                self.pg_id += 1
            _PROCESS.groups[self.pg_id] = self
            _PROCESS.global_rank = ranks[group.rank()]  # the same in every group of this process
        self._watcher = None
        if settings.dump_on_failure and store is not None and group.size() > 1:
            self._watcher = threading.Thread(target=self._watch, name="smddp-fr-watch", daemon=True)
            self._watcher.start()
            before_exit.stop_at_exit(self.close)

    name = property(lambda self: self._group.group_name or "0")
    desc = property(lambda self: self._group.group_desc or "undefined")

    def status(self) -> dict:
        return {f"last_{k}_collective": v for k, v in self.last.items()}

    def record(self, index: int, name: str, inputs: list[torch.Tensor], outputs: list[torch.Tensor],
               p2p: bool = False, started: bool = False) -> tuple[_Ring, int, tuple]:
        """Put a call in the ring, scheduled (or ``started``): (the ring, its slot, the entry)."""
        input_sizes = _sizes(inputs)
        output_sizes = input_sizes if outputs is inputs else _sizes(outputs)
        stack = _gather_stack() if self._with_stack else None
        if p2p:
            self.p2p_seq += 1
            seq_id, p2p_seq_id = max(self.last["enqueued"], 0), self.p2p_seq
        else:
            seq_id, p2p_seq_id = index, 0
            self.last["enqueued"] = index
        thread, created_ns = _thread_of_caller(), time.time_ns()
        process = _PROCESS
        process.lock.acquire()  # not `with`: half the cost
        try:
            entry = (process.next_record_id, self.pg_id, seq_id, p2p_seq_id, name, input_sizes, output_sizes,
                     created_ns, thread)
            process.next_record_id += 1
            ring = process.ring
            slot = ring.put(entry, stack, created_ns if started else None)
        finally:
            process.lock.release()
        return ring, slot, entry

    def record_p2p(self, kind: str, rank: int, peer: int, tensor: torch.Tensor) -> None:
        """A send or recv, as torch names them (``send 0->1``, ``recv 1<-0``); its link completes it
        on a thread of its own, so it stays started."""
        name = f"gloo:send {rank}->{peer}" if kind == "send" else f"gloo:recv {rank}<-{peer}"
        self.record(0, name, [tensor] if kind == "send" else [], [tensor] if kind == "recv" else [], p2p=True,
                    started=True)

    def track(self, call: int, op: str, tensors: list[torch.Tensor], outputs: list[torch.Tensor],
              body: Callable, prefix: str = "gloo", ends: bool = True) -> Callable:
        """Record the call (scheduled) and return ``body`` wrapped: started when it begins,
        completed when it returns (``ends``; an NCCL enqueue only starts it); a failure dumps and
        tells the group. ``tensors`` are all the call's tensors, ``outputs`` those it writes.
        fr_trace knows the ops of its own backends only (nccl, gloo, ...), so the CPU transports'
        calls carry gloo's names."""
        if tensors is outputs:  # in place (all_reduce, broadcast, ...): the inputs are the outputs
            inputs = outputs
        else:
            inputs = [t for t in tensors if not any(t is o for o in outputs)] or outputs
        name = _NAMES.get((prefix, op)) or _profiling_name(prefix, op)
        ring, slot, entry = self.record(call, name, inputs, outputs)
        # a partial, not a closure: one tuple of arguments where a closure makes a cell for each
        return functools.partial(_tracked, self, ring, slot, entry, call, op, body, ends)

    def failed(self, reason: str) -> None:
        """Dump this rank's record and ask the group's other ranks to dump theirs."""
        if not self.settings.dump_on_failure:
            return
        with self._dump_claim:  # before writing: a watcher that hears a peer now leaves it to this call
            self._dumped.set()
        _write_soon()  # the failure itself raises now
        try:
            if self._store is not None:
                self._store.set(_SIGNAL_KEY, reason[:2000])
        except Exception as exc:  # the store's host may be gone with the failure: this rank has dumped
            log.debug("smddp: could not ask the group's other ranks to dump their flight records: %s", exc)

    def _watch(self) -> None:
        """Poll the group's ``fr/dump`` key on a store client of its own (a TCPStore client runs
        one request at a time: a shared one would wait behind the group's waits)."""
        try:
            store = self._store.clone()
        except Exception:
            return
        while not self._stop.wait(_POLL_S):
            try:
                signalled = store.check([_SIGNAL_KEY])
            except Exception:  # the store's host ended: nothing more to hear
                return
            if signalled:
                with self._dump_claim:
                    if self._dumped.is_set():  # this rank's own failure dumped, or is dumping
                        return
                    self._dumped.set()
                # a failure of this rank from now on writes after this dump (write() takes turns)
                _write_soon()
                return

    def close(self) -> None:
        self._stop.set()
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(timeout=2 * _POLL_S + 1)


def _tracked(recorder: GroupRecorder, ring: _Ring, slot: int, entry: tuple, call: int, op: str, body: Callable,
             ends: bool, *args):
    """``body(*args)`` with the entry in ``slot`` marked started, then completed (where ``ends``)."""
    entries, last = ring.entries, recorder.last
    # the slot may hold a newer call by now (a ring's worth recorded since): this one is gone
    if entries[slot] is entry:
        ring.started[slot] = time.time_ns()
    last["started"] = call
    try:
        result = body(*args)
    except BaseException as exc:
        recorder.failed(f"{op} (collective {call}) failed: {exc}")
        raise
    if ends:
        if entries[slot] is entry:
            ring.completed[slot] = time.time_ns()
        last["completed"] = call
    return result


def profiled(op: str, tensors: list[torch.Tensor], outputs: list[torch.Tensor], submit: Callable):
    """``submit()``, under torch.profiler a range named ``smddp:<op>`` with the call's bytes,
    open until the call's Work completes (on whichever thread runs it), as gloo's and nccl's
    ranges are. One flag read per call when no profiler runs."""
    if not torch._C._autograd._profiler_enabled():
        return submit()
    moved = sum(t.numel() * t.element_size() for t in tensors)
    written = sum(t.numel() * t.element_size() for t in outputs)
    detail = f"in {moved - written if moved > written else written} B, out {written} B"
    with torch.autograd.profiler.record_function(f"smddp:{op} ({detail})", detail) as span:
        work = submit()
        if work is not None and hasattr(work, "get_future"):
            span._call_end_callbacks_on_future(work.get_future())
    return work


def for_group(store, group, global_ranks: list[int] | None, timeout_s: float) -> GroupRecorder | None:
    """The group's recorder, or None where TORCH_FR_BUFFER_SIZE=0 (every call then skips it)."""
    settings = RecorderSettings.from_env()
    if settings.buffer_size == 0:
        return None
    ranks = list(global_ranks) if global_ranks else list(range(group.size()))
    return GroupRecorder(settings, store, group, ranks, timeout_s)
