"""Collectives on CUDA tensors over NCCL (``cupy.cuda.nccl``), with ProcessGroupNCCL's streams.

Every call is enqueued on this group's own stream for the tensors' device, after that stream
waits for the caller's current stream (so whatever the caller's kernels wrote is what is sent),
and the host returns at once with a ``CudaWork`` (see work.py). Lists of tensors go through one
NCCL group call. Calls reach it only where its table (support.py) says NCCL runs them: the
router (route.py) sends the others through host memory (staged.py) before they start. Ops that
only move data (broadcast, all_gather, all_to_all) carry a dtype NCCL has no type for (float8,
int16, complex, ...) as its bytes, so FSDP2's float8 all_gather stays on the GPU.

Numerics are NCCL's, as with torch's "nccl" backend: 16-bit floats are reduced in their own
dtype hop by hop, AVG is NCCL's native average (NCCL >= 2.10; older: SUM, then one division on
the communication stream, ``numerics.averaged_``), bool reduces as uint8 (numerics.bool_on_bytes).
"""

from __future__ import annotations

import logging
import os
import threading
from datetime import timedelta
from typing import Callable, NoReturn

import torch

from .. import numerics
from ..call import Call
from ..errors import SMDDPError, where
from ..ops import RedOp
from ..transports.base import block_offsets, overlap
from .communicators import Communicators, nccl_version_string
from .environment import efa_devices, find_net_plugin, network_report
from .fast_path import FastCalls
from .support import NcclSupport
from .watchdog import Watchdog
from .work import CommStream, CudaWork, capturing

log = logging.getLogger("smddp_lite")

_reported = False  # the network report is logged once per process


class NcclPath:
    """The NCCL side of one process group."""

    kind = "nccl"

    def __init__(self, nccl, store, rank: int, world_size: int, timeout: timedelta, blocking: bool,
                 debug: bool, on_failure: Callable[[str], None]) -> None:
        self.nccl = nccl
        self.rank, self.world_size = rank, world_size
        self.timeout, self.blocking, self.debug = timeout, blocking, debug
        self.comms = Communicators(nccl, store, rank, world_size)
        self.support = NcclSupport.of(nccl, self.comms.version, world_size)  # what the router sends here
        self.streams: dict[int, CommStream] = {}
        # one call at a time from enqueue to tracking (the fast path's calls too), so that the
        # watchdog's list is in stream order even when several threads call (it lets a newer call
        # that ended vouch for older ones)
        self.launching = threading.Lock()
        self.last_device: torch.device | None = None
        self.watchdog = Watchdog(f"r{rank}", self.comms.check_async_errors, self.comms.abort, on_failure)
        # blocking waits block the host in wait(), which the fast path's Work never does
        self.fast = None if blocking else FastCalls(self, _cuda_runtime())

    # the one path every call takes -------------------------------------------------------------
    def _launch(self, call: Call, device: torch.device, touched: list[torch.Tensor], outputs: list[torch.Tensor],
                enqueue: Callable[[object, int], None]) -> CudaWork:
        """Enqueue ``enqueue(comm, stream_handle)`` on the group's stream for ``device``."""
        describe = where(self.rank, self.world_size, call.op)
        in_capture = capturing(device)
        if in_capture and (device.index not in self.comms.by_device or device.index not in self.streams):
            raise SMDDPError(f"{describe} the first collective on {device} is being captured into a CUDA graph, "
                             "but creating its NCCL communicator and stream cannot be captured; run one "
                             f"collective on {device} before the capture (a warm-up step), as with torch's nccl")
        comm = self.comms.get(device)
        self._report_once(device)
        stream = self.streams.get(device.index)
        if stream is None:
            stream = self.streams[device.index] = CommStream(device)
        work = CudaWork(describe, device, outputs, self.timeout, self.blocking, captured=in_capture,
                        host_side=False)
        with self.launching:
            try:
                stream.run(touched, lambda: enqueue(comm, stream.cuda_stream))
            except Exception as exc:  # NcclError: NCCL's own text, e.g. "NCCL_ERROR_INVALID_ARGUMENT: ..."
                self.launch_failed(describe, exc)
            work.keep = touched
            work.enqueued(stream.stream)
            if not in_capture:  # a captured call runs at each replay; the watchdog's event queries
                self.watchdog.track(work)  # during a capture would invalidate the graph
        self.last_device = device
        if self.fast is not None and not in_capture:
            self.fast.add_lane(device, comm, stream)
        return work

    def launch_failed(self, describe: str, exc: Exception) -> NoReturn:
        """NCCL refused to enqueue a call: abort, fail what was enqueued before it, and raise."""
        reason = f"{describe} NCCL failed: {exc}"
        self.watchdog.fail_all(reason)
        raise SMDDPError(reason) from exc

    # collectives -------------------------------------------------------------------------------
    def all_reduce(self, call: Call, tensors: list[torch.Tensor], red: RedOp) -> CudaWork:
        codes = [self.support.reduce_code(t.dtype, red) for t in tensors]
        flats = [_Flat(t) for t in tensors]

        def enqueue(comm, stream: int) -> None:
            with _group(self.nccl, len(flats) > 1):
                for f, (dt, nop, _) in zip(flats, codes):
                    comm.allReduce(f.ptr, f.ptr, f.numel, dt, nop, stream)
            for f, (_, _, divide) in zip(flats, codes):
                if divide:
                    numerics.averaged_(f.flat, self.world_size)
                f.write_back()

        return self._launch(call, tensors[0].device, _touched(*flats), tensors, enqueue)

    def broadcast(self, call: Call, tensors: list[torch.Tensor], root: int) -> CudaWork:
        codes = [self.support.move_code(t.dtype) for t in tensors]
        flats = [_Flat(t) for t in tensors]

        def enqueue(comm, stream: int) -> None:
            with _group(self.nccl, len(flats) > 1):
                for f, (dt, per) in zip(flats, codes):
                    comm.broadcast(f.ptr, f.ptr, f.numel * per, dt, root, stream)
            for f in flats:
                f.write_back()

        return self._launch(call, tensors[0].device, _touched(*flats), tensors, enqueue)

    def reduce(self, call: Call, tensor: torch.Tensor, root: int, red: RedOp) -> CudaWork:
        dt, nop, divide = self.support.reduce_code(tensor.dtype, red)
        f = _Flat(tensor)

        def enqueue(comm, stream: int) -> None:
            comm.reduce(f.ptr, f.ptr, f.numel, dt, nop, root, stream)
            if self.rank == root:  # non-root tensors are left as they were
                if divide:
                    numerics.averaged_(f.flat, self.world_size)
                f.write_back()

        return self._launch(call, tensor.device, _touched(f), [tensor], enqueue)

    def all_gather(self, call: Call, output: torch.Tensor, input: torch.Tensor) -> CudaWork:
        """``output`` (world_size * n elements, contiguous) receives every rank's ``input``."""
        dt, per = self.support.move_code(input.dtype)
        src, dst = _Flat(input), _Flat(output)

        def enqueue(comm, stream: int) -> None:
            comm.allGather(src.ptr, dst.ptr, src.numel * per, dt, stream)
            dst.write_back()

        return self._launch(call, input.device, _touched(src, dst), [output], enqueue)

    def all_gather_list(self, call: Call, outputs: list[torch.Tensor], input: torch.Tensor) -> CudaWork:
        dt, per = self.support.move_code(input.dtype)
        src = _Flat(input)
        n = src.numel

        def enqueue(comm, stream: int) -> None:
            flat = torch.empty(self.world_size * n, dtype=input.dtype, device=input.device)
            comm.allGather(src.ptr, _ptr(flat), n * per, dt, stream)
            for out, block in zip(outputs, flat.split(n) if n else [flat] * self.world_size):
                out.copy_(block.view_as(out))

        return self._launch(call, input.device, _touched(src) + outputs, outputs, enqueue)

    def reduce_scatter(self, call: Call, output: torch.Tensor, input: torch.Tensor, red: RedOp) -> CudaWork:
        """``output`` (n) receives the reduction of block ``rank`` of every rank's ``input``."""
        dt, nop, divide = self.support.reduce_code(input.dtype, red)
        src, dst = _Flat(input), _Flat(output)

        def enqueue(comm, stream: int) -> None:
            comm.reduceScatter(src.ptr, dst.ptr, dst.numel, dt, nop, stream)
            if divide:
                numerics.averaged_(dst.flat, self.world_size)
            dst.write_back()

        return self._launch(call, input.device, _touched(src, dst), [output], enqueue)

    def reduce_scatter_list(self, call: Call, output: torch.Tensor, inputs: list[torch.Tensor], red: RedOp) -> CudaWork:
        dt, nop, divide = self.support.reduce_code(output.dtype, red)
        dst = _Flat(output)

        def enqueue(comm, stream: int) -> None:
            packed = torch.cat([t.reshape(-1) for t in inputs])
            comm.reduceScatter(_ptr(packed), dst.ptr, dst.numel, dt, nop, stream)
            if divide:
                numerics.averaged_(dst.flat, self.world_size)
            dst.write_back()

        return self._launch(call, output.device, _touched(dst) + inputs, [output], enqueue)

    def all_to_all(self, call: Call, output: torch.Tensor, input: torch.Tensor) -> CudaWork:
        """Block ``q`` of ``input`` (equal blocks) goes to rank ``q``'s block ``rank``: the uneven
        form's sends and receives, so an in-place call goes from a copy as that one does."""
        n = input.numel() // self.world_size
        return self.all_to_all_v(call, output, [n] * self.world_size, input, [n] * self.world_size)

    def all_to_all_v(self, call: Call, output: torch.Tensor, output_splits: list[int], input: torch.Tensor,
                     input_splits: list[int]) -> CudaWork:
        """Blocks of any size: block ``q`` of ``input`` (``input_splits[q]`` elements) goes to
        rank ``q``; block ``q`` of ``output`` (``output_splits[q]``) comes from it. all_to_all
        runs here too, so a rank whose blocks are equal pairs with one whose blocks are not. Split sizes are not compared across ranks (torch's nccl does
        not either): ranks that disagree wait for the watchdog's timeout."""
        dt, per = self.support.move_code(input.dtype)
        if input.numel() and output.numel() and overlap(input.reshape(-1), output.reshape(-1)):
            input = input.clone()  # received blocks would land on input not yet sent
        src, dst = _Flat(input), _Flat(output)
        size = input.element_size()
        send_at, receive_at = block_offsets(input_splits), block_offsets(output_splits)

        def enqueue(comm, stream: int) -> None:
            with _group(self.nccl, True):  # sends and receives of one step must be one group
                for q in range(self.world_size):
                    if input_splits[q]:  # the peer skips the matching receive of nothing too
                        comm.send(src.ptr + send_at[q] * size, input_splits[q] * per, dt, q, stream)
                    if output_splits[q]:
                        comm.recv(dst.ptr + receive_at[q] * size, output_splits[q] * per, dt, q, stream)
            dst.write_back()

        return self._launch(call, input.device, _touched(src, dst), [output], enqueue)

    def barrier(self, call: Call) -> CudaWork:
        """A one-element all_reduce on the device this group last used, which the host then
        waits for (as ProcessGroupNCCL's barrier does): earlier collectives have ended too."""
        device = self.last_device or torch.device("cuda", torch.cuda.current_device())
        if capturing(device):
            raise SMDDPError(f"{where(self.rank, self.world_size, 'barrier')} is being captured into a CUDA "
                             "graph, but a barrier blocks the host, which a graph cannot do; call it outside "
                             "the capture")
        work = self.all_reduce(call, [torch.zeros(1, device=device)], RedOp.SUM)
        work.block_host(work.timeout_s)
        return work

    # lifetime ----------------------------------------------------------------------------------
    def close(self, abort: bool = False) -> None:
        self.watchdog.stop()
        (self.comms.abort if abort else self.comms.destroy)()

    def _report_once(self, device: torch.device) -> None:
        global _reported
        if _reported:
            return
        _reported = True
        lines, warnings = network_report(nccl_version_string(self.comms.version), os.environ,
                                         find_net_plugin(os.environ), efa_devices())
        if self.debug and self.rank == 0:
            try:
                torch_nccl = ".".join(map(str, torch.cuda.nccl.version()))
            except (AttributeError, RuntimeError):  # a torch build without NCCL
                torch_nccl = "not built in"
            log.info("smddp: CUDA collectives on %s go through NCCL (cupy); torch's own NCCL is %s", device, torch_nccl)
            for line in lines:
                log.info("smddp: %s", line)
        for line in warnings:
            log.warning("smddp: rank %d: %s", self.rank, line)


def _cuda_runtime():
    """cupy's CUDA runtime module (cupy is loaded whenever NCCL is): the fast path records and
    waits on events through it, on raw handles."""
    from cupy.cuda import runtime

    return runtime


class _Flat:
    """A contiguous 1-D view of a tensor (or a contiguous copy made on the communication stream
    when the tensor is not contiguous, with ``write_back`` to copy the result home)."""

    def __init__(self, t: torch.Tensor) -> None:
        self.tensor = t
        self.copied = not t.is_contiguous()
        base = t.contiguous() if self.copied else t  # made before the stream switch: ordered by wait_stream
        self.flat = base.view(-1)
        self.numel = self.flat.numel()
        self.ptr = _ptr(self.flat)

    def write_back(self) -> None:
        if self.copied:
            self.tensor.copy_(self.flat.view_as(self.tensor))


def _touched(*flats: _Flat) -> list[torch.Tensor]:
    """One tensor per memory block a call touches (record_stream works per block): the flat
    view, and the caller's tensor too where the flat one is a contiguous copy of it."""
    return [t for f in flats for t in ((f.flat, f.tensor) if f.copied else (f.flat,))]


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


class _group:
    """``nccl.groupStart()`` / ``groupEnd()`` around several calls (one launch for them all)."""

    def __init__(self, nccl, active: bool) -> None:
        self.nccl, self.active = nccl, active

    def __enter__(self) -> None:
        if self.active:
            self.nccl.groupStart()

    def __exit__(self, *exc) -> None:
        if self.active:
            self.nccl.groupEnd()
