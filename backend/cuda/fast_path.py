"""The common CUDA call at the host cost of torch's own nccl backend.

A call takes this path when it is an all_reduce, broadcast or all_gather into one tensor of one
contiguous CUDA tensor, of a dtype and op NCCL runs as they are, on the current device, outside
a CUDA graph capture, on a healthy group whose NCCL communicator and stream for that device
exist (the general route in nccl_path.py makes them, so a device's first call never takes this
one). Anything else returns None here and goes that general route, which checks and explains.

Synchronous calls (torch's API passes ``async_op`` as ``opts.asyncOp``) are enqueued on the
caller's current stream, as ProcessGroupNCCL enqueues them: the stream itself orders the caller's
kernels before and after the collective, so there is no stream switch, no event between streams
and no ``record_stream``, and the Work's ``wait()`` has nothing left to do. Asynchronous calls go
on the group's communication stream after one reused event, and their Work holds the tensors
until the collective ends. Each call's end is one event from a pool, recorded through cupy's
runtime on raw stream handles (no Python stream or event objects per call), which the watchdog
polls as it polls every CUDA work: a stuck or failed call is found and aborted either way.

When the general route was the only one, a call cost about 100 us more than with torch's nccl
(measured on an H200), spread over some 40 Python functions; this path is the few steps a
qualifying call needs.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ..errors import where
from ..ops import _FROM_TORCH
from ..work import KeptWhileCppMayAsk, as_backend_error
from .work import OutcomeOnDevice


class PooledEvent:
    """A CUDA event that serves call after call: recorded and waited on through raw handles."""

    __slots__ = ("event", "handle")

    def __init__(self, device_index: int, stream: torch.cuda.Stream) -> None:
        self.event = torch.cuda.Event()
        with torch.cuda.device(device_index):
            self.event.record(stream)  # torch creates the CUDA event at its first record
        self.handle = self.event.cuda_event


class EventPool:
    """Free events of one device. Taking and giving back are single list operations, which the
    interpreter makes atomic: the caller takes, the watchdog gives back once a call ended."""

    def __init__(self, device_index: int, stream: torch.cuda.Stream) -> None:
        self.device_index, self.stream = device_index, stream
        self._free: list[PooledEvent] = []

    def take(self) -> PooledEvent:
        try:
            return self._free.pop()
        except IndexError:
            return PooledEvent(self.device_index, self.stream)

    def give(self, event: PooledEvent) -> None:
        self._free.append(event)


class Lane:
    """What a device's fast calls need: its communicator, the group's stream there, its events."""

    def __init__(self, device: torch.device, comm, stream) -> None:
        self.device = device
        self.index = device.index
        self.comm = comm
        self.raw_stream = stream.cuda_stream  # the group's CommStream on this device
        self.events = EventPool(device.index, stream.stream)
        self.caller_reached = PooledEvent(device.index, stream.stream)  # async calls' stream wait


class FastWork(OutcomeOnDevice, KeptWhileCppMayAsk, dist._Work):
    """One fast call: the Work handed back, and what the watchdog tracks until the call ends.

    A synchronous call ran on the caller's stream, so waiting orders nothing more; an
    asynchronous one makes the waiting stream wait for its end event. ``is_completed`` asks the
    device. Failures the watchdog finds later (a timeout, an asynchronous NCCL error) are raised
    from ``wait()`` and by every later call of the group."""

    def __init__(self, fast: "FastCalls", op: str, lane: Lane, outputs: list[torch.Tensor], on_caller_stream: bool,
                 keep: list[torch.Tensor] | None) -> None:
        super().__init__()
        self._fast = fast
        self.op = op
        self.lane = lane
        self.device = lane.device
        self.outputs = outputs
        self.on_caller_stream = on_caller_stream
        self.keep = keep  # an asynchronous call's tensors, until it ends on the device
        self.started = time.monotonic()
        self.timeout_s = fast.timeout_s
        self.error: BaseException | None = None
        self.end: PooledEvent | None = None  # set at launch; None again once released

    @property
    def describe(self) -> str:  # made only when an error needs it
        return where(self._fast.rank, self._fast.world_size, self.op)

    # the watchdog's side --------------------------------------------------------------------------
    def ended(self) -> bool:
        end = self.end  # read once: the watchdog may release it meanwhile
        return end is None or end.event.query()

    def fail(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error

    def release(self) -> None:
        """Ended on the device: its tensors may go, and its event serves a later call. ``end`` is
        cleared before the event goes back, so that nobody asks it after a later call recorded it."""
        self.keep = None
        end, self.end = self.end, None
        if end is not None:
            self.lane.events.give(end)

    # the caller's side ----------------------------------------------------------------------------
    def wait(self, timeout=None) -> bool:
        self._timeout_of(timeout)
        if self.error is not None:
            raise as_backend_error(self.error)
        if not self.on_caller_stream:
            end = self.end
            if end is not None:  # None: released, the call has ended on the device
                _stream_wait_event(_raw_stream(self.lane.index), end.handle, 0)
        return True

    def synchronize(self) -> None:
        if self.error is not None:
            raise as_backend_error(self.error)
        end = self.end
        if not self.on_caller_stream and end is not None:
            _stream_wait_event(_raw_stream(self.lane.index), end.handle, 0)

    def get_future(self) -> torch.futures.Future:
        """A CUDA-aware future of the outputs, completed on a stream ordered after the call (the
        caller's for a synchronous call; for an asynchronous one a stream that waits for its end),
        so ``then`` callbacks run after the collective on the device, as with ProcessGroupNCCL."""
        self._asked_for(future_too=True)
        if self.error is not None:
            raise as_backend_error(self.error)
        future = torch.futures.Future(devices=[self.device])
        if self.on_caller_stream:
            future.set_result(self.outputs)
            return future
        stream = self._fast.future_stream(self.lane)
        end = self.end
        if end is not None:
            _stream_wait_event(stream.cuda_stream, end.handle, 0)
        with torch.cuda.stream(stream):
            future.set_result(self.outputs)
        return future


class FastCalls:
    """The fast path of one process group's NCCL side (see the module docstring)."""

    def __init__(self, nccl_path, runtime) -> None:
        self._path = nccl_path
        self.rank, self.world_size = nccl_path.rank, nccl_path.world_size
        self.timeout_s = nccl_path.timeout.total_seconds()
        self._lanes: dict[int, Lane] = {}
        self._future_streams: dict[int, torch.cuda.Stream] = {}
        global _event_record, _stream_wait_event
        _event_record, _stream_wait_event = runtime.eventRecord, runtime.streamWaitEvent
        self._support = nccl_path.support
        self._reduce = self._reduce_codes(nccl_path.support)
        self._move: dict[torch.dtype, tuple[int, int]] = {}  # dtype -> (NCCL dtype, how many make one)

    @staticmethod
    def _reduce_codes(support) -> dict[tuple[torch.dtype, int], tuple[int, int]]:
        """(dtype, torch's RedOpType's value) -> (NCCL dtype, NCCL op), for what NCCL runs as it
        is (support.py's table without the AVGs it divides afterwards). Keyed by the enum's
        integer: hashing the pybind enum itself cost about 1.5 us a call."""
        by_torch_value = {red: torch_op.value for torch_op, red in _FROM_TORCH.items()}
        return {(dtype, by_torch_value[red]): (code.dtype, code.op)
                for (dtype, red), code in support.reduce_codes().items() if not code.divide}

    def _moved(self, dtype: torch.dtype) -> tuple[int, int]:
        """How an op that only moves data carries ``dtype``: its NCCL type, else its bytes."""
        code = self._move.get(dtype)
        if code is None:
            code = self._move[dtype] = self._support.move_code(dtype)
        return code

    def add_lane(self, device: torch.device, comm, stream) -> None:
        """The general route made ``device``'s communicator and stream: later calls there may
        come this way."""
        if device.index not in self._lanes:
            self._lanes[device.index] = Lane(device, comm, stream)

    def future_stream(self, lane: Lane) -> torch.cuda.Stream:
        stream = self._future_streams.get(lane.index)
        if stream is None:
            stream = self._future_streams[lane.index] = torch.cuda.Stream(lane.device)
        return stream

    # the calls ------------------------------------------------------------------------------------
    def all_reduce(self, group, tensors, opts=None, **kwargs) -> FastWork | None:
        if type(opts) is not _AllreduceOptions or kwargs or type(tensors) is not list or len(tensors) != 1:
            return None
        t = tensors[0]
        lane = self._lane_for(group, t)
        if lane is None:
            return None
        code = self._reduce.get((t.dtype, opts.reduceOp.op.value))
        if code is None:
            return None
        ptr, n = t.data_ptr(), t.numel()
        return self._issue(group, lane, "all_reduce", opts.asyncOp, tensors, tensors,
                           lambda comm, stream: comm.allReduce(ptr, ptr, n, code[0], code[1], stream))

    def broadcast(self, group, tensors, opts=None, **kwargs) -> FastWork | None:
        if type(opts) is not _BroadcastOptions or kwargs or type(tensors) is not list or len(tensors) != 1:
            return None
        t = tensors[0]
        lane = self._lane_for(group, t)
        if lane is None:
            return None
        code = self._moved(t.dtype)
        root = opts.rootRank
        if opts.rootTensor != 0 or not 0 <= root < self.world_size:
            return None
        ptr, n = t.data_ptr(), t.numel() * code[1]
        return self._issue(group, lane, "broadcast", opts.asyncOp, tensors, tensors,
                           lambda comm, stream: comm.broadcast(ptr, ptr, n, code[0], root, stream))

    def all_gather_single(self, group, output, input, opts=None, **kwargs) -> FastWork | None:
        if type(opts) is not _AllgatherOptions or kwargs:
            return None
        lane = self._lane_for(group, input)
        if lane is None or self._lane_for(group, output) is not lane:
            return None
        code = self._moved(input.dtype)
        n = input.numel()
        if output.dtype != input.dtype or output.numel() != n * self.world_size:
            return None
        src, dst, count = input.data_ptr(), output.data_ptr(), n * code[1]
        block = n * input.element_size()
        if dst < src + block and src < dst + block * self.world_size and src != dst + self.rank * block:
            return None  # an input inside the output other than as this rank's block: the general route copies
        outputs = [output]
        return self._issue(group, lane, "all_gather", opts.asyncOp, [input, output], outputs,
                           lambda comm, stream: comm.allGather(src, dst, count, code[0], stream))

    # what every call shares -----------------------------------------------------------------------
    def _lane_for(self, group, t) -> Lane | None:
        if not isinstance(t, torch.Tensor) or not t.is_cuda or t.is_quantized:  # quantized: refused there
            return None
        lane = self._lanes.get(t.get_device())
        if (lane is None or not group.takes_calls() or t.layout is not torch.strided
                or not t.is_contiguous() or t.is_conj() or t.is_neg()):
            return None
        if lane.index != _current_device() or _capturing():  # a capture: see nccl_path's capture rules
            return None
        return lane

    def _issue(self, group, lane: Lane, op: str, async_op: bool, touched: list[torch.Tensor],
               outputs: list[torch.Tensor], enqueue) -> FastWork:
        path = self._path
        group.number_call()  # every call takes one (refusals pair ranks' calls by it)
        work = FastWork(self, op, lane, outputs, not async_op, touched if async_op else None)
        end = work.end = lane.events.take()
        with path.launching:  # the watchdog's list stays in launch order (see NcclPath._launch)
            try:
                if async_op:
                    caller = _raw_stream(lane.index)
                    _event_record(lane.caller_reached.handle, caller)
                    _stream_wait_event(lane.raw_stream, lane.caller_reached.handle, 0)
                    enqueue(lane.comm, lane.raw_stream)
                    _event_record(end.handle, lane.raw_stream)
                else:
                    stream = _raw_stream(lane.index)
                    enqueue(lane.comm, stream)
                    _event_record(end.handle, stream)
            except Exception as exc:  # NcclError: NCCL's own text
                lane.events.give(end)
                path.launch_failed(work.describe, exc)
            path.watchdog.track(work)
        path.last_device = lane.device
        return work


# the options torch's API passes; a caller that passes anything else takes the general route
_AllreduceOptions = dist.AllreduceOptions
_BroadcastOptions = dist.BroadcastOptions
_AllgatherOptions = torch._C._distributed_c10d.AllgatherOptions
_current_device = getattr(torch._C, "_cuda_getDevice", None)
_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None)
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_event_record = _stream_wait_event = None  # cupy's runtime functions, set by FastCalls

