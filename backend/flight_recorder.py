"""The flight recorder: every group's last calls, dumped in the format torch's analyzer reads.

torch's backends keep a ring of their last N calls per process (``TORCH_FR_BUFFER_SIZE``, 2000 by
default; here 0, off, unless a variable sets it: recording a call in Python costs about 10 us,
1.19x a 256 B shared-memory all_reduce's median, against the 5% a default may cost) and ``python -m torch.distributed.flight_recorder.fr_trace`` reads one dump per rank and
names the rank and the call where a group went apart. torch's C++ recorder takes no entries from
a Python backend, so this module keeps the same ring and writes the same pickle (version "2.10",
the keys ``fr_trace``'s loader and matcher read). The process group hands each call to ``track``,
once, which returns the call's body wrapped; nothing below the group knows of the recorder.

A rank dumps when one of its calls fails (a timeout, a dead or refusing peer, a mismatch) and
posts ``fr/dump`` in the group's store; every other rank of the group, in a call or not (a rank
that skipped the call sits in user code), sees it within half a second on a thread of the group
and dumps too, so the analyzer gets every rank that is still alive.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import pickle
import sys
import threading
import time
from typing import Callable

import torch

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

    buffer_size: int = 0
    """Calls kept per process (TORCH_FR_BUFFER_SIZE, or TORCH_NCCL_TRACE_BUFFER_SIZE; torch's
    default is 2000); 0 turns the recorder off and every call then skips it. Off unless set: see
    the module's docstring for its cost."""
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


def _sizes(tensors: list[torch.Tensor]) -> tuple:
    """(shape, dtype) of each tensor, as they are: spelled out only when a dump asks."""
    return tuple([(t.shape, t.dtype) for t in tensors])


def _spelled(sizes: tuple) -> tuple[list[list[int]], list[str]]:
    return ([list(shape) for shape, _ in sizes],
            [_SCALAR_NAMES.get(dtype) or str(dtype).removeprefix("torch.") for _, dtype in sizes])


def _line(code, lasti: int) -> int | None:
    for start, end, line in code.co_lines():
        if start <= lasti < end:
            return line
    return code.co_firstlineno


def _stack() -> tuple:
    """The caller's frames as one flat tuple (code, offset, code, offset, ...), innermost first,
    from the first frame outside this package: lines, names and files are read only when a dump
    asks (a frame's f_lineno costs 0.1 us each; holding frames would keep their locals)."""
    frame, frames = sys._getframe(2), []
    while frame is not None and frame.f_code.co_filename.startswith(_BACKEND_DIR):  # from torch's frames on
        frame = frame.f_back
    while frame is not None and len(frames) < 40:
        frames.append(frame.f_code)
        frames.append(frame.f_lasti)
        frame = frame.f_back
    return tuple(frames)


class _Entry:
    __slots__ = ("record_id", "group", "seq_id", "p2p_seq_id", "name", "inputs", "outputs", "created_ns",
                 "started_ns", "completed_ns", "state", "stack", "thread")

    def to_dict(self, with_stack: bool) -> dict:
        group = self.group
        inputs, outputs, stack = _spelled(self.inputs), _spelled(self.outputs), self.stack
        return {"record_id": self.record_id, "pg_id": group.pg_id, "process_group": (group.name, group.desc),
                "collective_seq_id": self.seq_id, "p2p_seq_id": self.p2p_seq_id, "op_id": self.seq_id,
                "profiling_name": self.name, "time_created_ns": self.created_ns,
                "input_sizes": inputs[0], "input_dtypes": inputs[1],
                "output_sizes": outputs[0], "output_dtypes": outputs[1],
                "state": self.state, "time_discovered_started_ns": self.started_ns,
                "time_discovered_completed_ns": self.completed_ns, "retired": self.state == "completed",
                "timeout_ms": group.timeout_ms, "is_p2p": self.p2p_seq_id > 0,
                "thread_id": str(self.thread[0]), "thread_name": self.thread[1],
                "frames": [{"name": stack[i].co_name, "filename": stack[i].co_filename,
                            "line": _line(stack[i], stack[i + 1])} for i in range(0, len(stack), 2)]
                if with_stack else []}


class _Process:
    """The ring of one process, holding every group's entries as torch's recorder does."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.entries: collections.deque[_Entry] = collections.deque(maxlen=1)
        self.next_record_id = 0
        self.groups: dict[int, GroupRecorder] = {}
        self.global_rank = 0

    def dump(self, settings: RecorderSettings, include_collectives: bool = True,
             include_stack_traces: bool | None = None, only_active: bool | None = None) -> bytes:
        with_stack = settings.include_stack_traces if include_stack_traces is None else include_stack_traces
        active = settings.only_active if only_active is None else only_active
        with self.lock:
            entries = list(self.entries) if include_collectives else []
            groups = list(self.groups.values())
        return pickle.dumps({
            "version": VERSION, "comm_lib_version": "", "nccl_version": "",
            "pg_config": {g.name: {"name": g.name, "desc": g.desc, "ranks": str(g.ranks)} for g in groups},
            "pg_status": {str(g.pg_id): g.status() for g in groups},
            "entries": [e.to_dict(with_stack) for e in entries if not active or e.state != "completed"]})


_PROCESS = _Process()


def dump(include_collectives: bool = True, include_stack_traces: bool | None = None,
         only_active: bool | None = None) -> bytes:
    """This process's record as the pickled bytes torch's ``_dump_fr_trace`` returns.

    Example::

        open(f"/tmp/fr/rank_{dist.get_rank()}", "wb").write(smddp_lite.dump_fr_trace())
    """
    return _PROCESS.dump(RecorderSettings.from_env(), include_collectives, include_stack_traces, only_active)


def write(path: str | None = None) -> str:
    """Write this process's record to ``path`` (by default ``<TORCH_FR_DUMP_TEMP_FILE><global rank>``,
    the name fr_trace reads) through a temporary name, so a reader never sees half a file."""
    settings = RecorderSettings.from_env()
    path = path or f"{settings.dump_prefix}{_PROCESS.global_rank}"
    data = _PROCESS.dump(settings)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    partial = f"{path}.{os.getpid()}.tmp"
    with open(partial, "wb") as f:
        f.write(data)
    os.replace(partial, path)
    return path


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
        with _PROCESS.lock:
            if _PROCESS.entries.maxlen != settings.buffer_size:
                _PROCESS.entries = collections.deque(_PROCESS.entries, maxlen=settings.buffer_size)
            self.pg_id = len(_PROCESS.groups)
            while self.pg_id in _PROCESS.groups:
                self.pg_id += 1
            _PROCESS.groups[self.pg_id] = self
            _PROCESS.global_rank = ranks[group.rank()]  # the same in every group of this process
        self._watcher = None
        if settings.dump_on_failure and store is not None and group.size() > 1:
            self._watcher = threading.Thread(target=self._watch, name="smddp-fr-watch", daemon=True)
            self._watcher.start()

    name = property(lambda self: self._group.group_name or "0")
    desc = property(lambda self: self._group.group_desc or "undefined")

    def status(self) -> dict:
        return {f"last_{k}_collective": v for k, v in self.last.items()}

    def record(self, index: int, name: str, inputs: list[torch.Tensor], outputs: list[torch.Tensor],
               p2p: bool = False) -> _Entry:
        entry = _Entry()
        entry.group, entry.name = self, name
        entry.inputs, entry.outputs = _sizes(inputs), _sizes(outputs)
        entry.created_ns, entry.started_ns, entry.completed_ns = time.time_ns(), None, None
        entry.state = "scheduled"
        entry.stack = _stack() if self.settings.include_stack_traces else ()
        thread = threading.current_thread()
        entry.thread = (thread.ident, thread.name)
        if p2p:
            self.p2p_seq += 1
            entry.seq_id, entry.p2p_seq_id = self.last["enqueued"] if self.last["enqueued"] > 0 else 0, self.p2p_seq
        else:
            entry.seq_id, entry.p2p_seq_id = index, 0
            self.last["enqueued"] = index
        with _PROCESS.lock:
            entry.record_id = _PROCESS.next_record_id
            _PROCESS.next_record_id += 1
            _PROCESS.entries.append(entry)
        return entry

    def record_p2p(self, kind: str, rank: int, peer: int, tensor: torch.Tensor) -> None:
        """A send or recv, as torch names them (``send 0->1``, ``recv 1<-0``); its link completes it
        on a thread of its own, so it stays started."""
        name = f"gloo:send {rank}->{peer}" if kind == "send" else f"gloo:recv {rank}<-{peer}"
        entry = self.record(0, name, [tensor] if kind == "send" else [], [tensor] if kind == "recv" else [], p2p=True)
        entry.started_ns, entry.state = entry.created_ns, "started"

    def track(self, call: int, op: str, tensors: list[torch.Tensor], outputs: list[torch.Tensor],
              body: Callable, prefix: str = "gloo", ends: bool = True) -> Callable:
        """Record the call (scheduled) and return ``body`` wrapped: started when it begins,
        completed when it returns (``ends``; an NCCL enqueue only starts it); a failure dumps and
        tells the group. ``tensors`` are all the call's tensors, ``outputs`` those it writes.
        fr_trace knows the ops of its own backends only (nccl, gloo, ...), so the CPU transports'
        calls carry gloo's names."""
        inputs = [t for t in tensors if not any(t is o for o in outputs)] or outputs  # in place: the same
        entry = self.record(call, f"{prefix}:{_TORCH_NAMES.get(op, op)}", inputs, outputs)

        def tracked(*args):
            entry.started_ns, entry.state = time.time_ns(), "started"
            self.last["started"] = call
            try:
                result = body(*args)
            except BaseException as exc:
                self.failed(f"{op} (collective {call}) failed: {exc}")
                raise
            if not ends:
                return result
            entry.completed_ns, entry.state = time.time_ns(), "completed"
            self.last["completed"] = call
            return result

        return tracked

    def failed(self, reason: str) -> None:
        """Dump this rank's record and ask the group's other ranks to dump theirs."""
        if not self.settings.dump_on_failure:
            return
        _write_or_warn()  # the failure itself still raises
        self._dumped.set()
        try:
            if self._store is not None:
                self._store.set(_SIGNAL_KEY, reason[:2000])
        except Exception:  # the store's host may be gone with the failure
            pass

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
            if signalled and not self._dumped.is_set():
                self._dumped.set()
                _write_or_warn()
                return

    def close(self) -> None:
        self._stop.set()
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(timeout=2 * _POLL_S + 1)


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
