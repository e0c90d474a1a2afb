"""CUDA tensors through host memory: copy to pinned host buffers, run the CPU path, copy back.

This is the path without cupy/NCCL (with a one-time warning saying what to install), for the few
calls NCCL cannot make (bitwise reductions), and with ``SMDDP_CUDA_TRANSPORT=staged``. It also
lets several processes share one GPU, which NCCL refuses, so multi-rank CUDA semantics can be
tested on a single-GPU machine.

Ordering: the device-to-host copies run on a side stream that first waits for the caller's
current stream, and the host waits for them (the CPU transports read host memory). The CPU
collective then runs as any CPU call does; when it ends (on the group's communication thread,
or at once for inline transports), the results are copied back on the side stream, and the
returned ``CudaWork`` completes there, so ``wait()`` and ``get_future()`` behave as on NCCL.
Only the call's outputs are copied back: inputs stay untouched, also when an output is a view
of an input (in-place all_gather / reduce_scatter).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Callable

import torch

from ..errors import SMDDPError, where
from .work import CudaWork, capturing


class StagedPath:
    """The host-memory side of one process group's CUDA calls."""

    kind = "staged"

    def __init__(self, rank: int, world_size: int, timeout: timedelta, blocking: bool) -> None:
        self.rank, self.world_size = rank, world_size
        self.timeout, self.blocking = timeout, blocking
        self.streams: dict[int, torch.cuda.Stream] = {}

    def run(self, op: str, method: Callable[..., Any], args: tuple, kwargs: dict, device: torch.device) -> CudaWork:
        """Call the process group's ``method`` with every CUDA tensor in ``args`` replaced by a
        host copy; returns a ``CudaWork`` that ends once the outputs are back on ``device``."""
        if capturing(device):  # the host must wait for the copies: no graph
            raise SMDDPError(f"{where(self.rank, self.world_size, op)} is being captured into a CUDA graph, "
                             "but this call goes through host memory, which a graph cannot hold: NCCL is not in "
                             "use (install cupy, see SMDDP_CUDA_TRANSPORT) or cannot run it (bitwise reductions, "
                             "bool XOR, bfloat16 before NCCL 2.10); capture only what NCCL runs")
        stream = self.streams.get(device.index)
        if stream is None:
            stream = self.streams[device.index] = torch.cuda.Stream(device)
        originals: dict[int, torch.Tensor] = {}  # id(host copy) -> the CUDA tensor it stands for
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            host_args = _mirror(args, originals)
            copied = torch.cuda.Event()
            copied.record(stream)
        for t in originals.values():
            t.record_stream(stream)
        copied.synchronize()  # the CPU transports read the host copies from here on
        cpu_work = method(*host_args, **kwargs)
        pairs = [(h, originals[id(h)]) for h in cpu_work.result_tensors() if id(h) in originals]
        work = CudaWork(where(self.rank, self.world_size, op), device, [o for _, o in pairs], self.timeout,
                        self.blocking)

        def copy_back(done: torch.futures.Future) -> None:
            # everything inside the try: an error raised in a then() callback would otherwise only
            # reach the future it returns, which nobody reads, and wait() would hang until timeout
            try:
                done.wait()  # raises the CPU collective's error
                # no_grad: outputs may be parameters; grad mode is on by default in this thread
                with torch.no_grad(), torch.cuda.device(device), torch.cuda.stream(stream):
                    for host, cuda in pairs:  # the pinned allocator keeps each host copy until its copy ends
                        cuda.copy_(host, non_blocking=True)
                    work.enqueued(stream)
            except Exception as exc:
                work.fail(exc)

        cpu_work.get_future().then(copy_back)
        return work


def _mirror(value: Any, originals: dict[int, torch.Tensor]) -> Any:
    """``value`` with each CUDA tensor (also inside lists and tuples) replaced by a pinned host
    copy, enqueued on the current stream; ``originals`` maps each copy back."""
    if isinstance(value, torch.Tensor) and value.is_cuda:
        host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
        host.copy_(value, non_blocking=True)
        originals[id(host)] = value
        return host
    if isinstance(value, (list, tuple)):
        return type(value)(_mirror(v, originals) for v in value)
    return value
