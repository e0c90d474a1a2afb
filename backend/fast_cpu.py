"""Small CPU collectives on the caller's thread, in the few steps such a call needs.

The general route of a call (process_group.py) prepares, checks and numbers it, builds its
Work, has the algorithms layer choose how to run it per dtype, and hands the transport a step:
some 40 Python functions, which cost an 8 B all_reduce on shared memory about 10x the wait for its
peer (benchmarks/results/2026-12-01-small-messages-where-the-time-goes.md). A call takes this
path instead when it is an all_reduce of one contiguous, dense CPU tensor of at most one
shared-memory slot (16 KiB), of a dtype numpy reduces as torch does, with SUM, PRODUCT, MIN, MAX
(or AVG of floats), on a healthy group whose transport is shared memory, while no profiler
runs. Anything else returns None here and takes the general route, which checks and explains.

Nothing a call is owed is skipped: it takes the group's next call number and runs the very
header, steps and waits of the transport's own small all_reduce (so a peer on the general
route pairs with it, a mismatch is found and a dead peer named as there), the flight recorder
records it, and a failure reaches ``wait()`` and the group's later calls as on the general route.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from . import numerics
from .call import Call
from .ops import RedOp, moved_as_bytes
from .transports.shm import SMALL_COMBINE, SMALL_DTYPES
from .work import KeptWhileCppMayAsk

_AllreduceOptions = dist.AllreduceOptions
_BroadcastOptions = dist.BroadcastOptions
_AllgatherOptions = torch._C._distributed_c10d.AllgatherOptions
_PLAIN = (torch.Tensor, torch.nn.Parameter)  # subclasses (DTensor, fakes) take the general route
_profiling = torch._C._autograd._profiler_enabled  # under a profiler the general route opens its range
_OPS = {dist.ReduceOp.RedOpType.SUM.value: RedOp.SUM, dist.ReduceOp.RedOpType.PRODUCT.value: RedOp.PRODUCT,
        dist.ReduceOp.RedOpType.MIN.value: RedOp.MIN, dist.ReduceOp.RedOpType.MAX.value: RedOp.MAX}
_AVG = dist.ReduceOp.RedOpType.AVG.value
_FLOATS = (torch.float32, torch.float64)


class DoneWork(KeptWhileCppMayAsk, dist._Work):
    """The Work of a call that ran to its end on the caller's thread, successfully."""

    def __init__(self, outputs: list[torch.Tensor]) -> None:
        super().__init__()
        self._outputs = outputs

    def wait(self, timeout=None) -> bool:
        self._timeout_of(timeout)  # notes a wait from Python code (see KeptWhileCppMayAsk)
        return True

    def synchronize(self) -> None:
        self._asked_for()

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def exception(self):
        return None

    def result(self) -> list[torch.Tensor]:
        self._asked_for()
        return self._outputs

    def get_future(self) -> torch.futures.Future:
        self._asked_for(future_too=True)
        future = torch.futures.Future()
        future.set_result(self._outputs)
        return future

    def result_tensors(self) -> list[torch.Tensor]:
        return self._outputs


class FastCpuCalls:
    """The calls of one group's shared-memory transport that may skip the general route."""

    def __init__(self, transport) -> None:
        self.transport = transport
        self.max_bytes = transport.small_bytes

    def all_reduce(self, group, tensors, opts=None, **kwargs) -> dist._Work | None:
        if type(opts) is not _AllreduceOptions or kwargs or type(tensors) is not list or len(tensors) != 1:
            return None
        t = tensors[0]
        if not self._takes(group, t) or t.dtype not in SMALL_DTYPES:
            return None
        code = opts.reduceOp.op.value
        op = _OPS.get(code)
        average = code == _AVG and t.dtype in _FLOATS
        if op is None and not average:
            return None
        # numpy's reshape gives a flat view of any contiguous tensor (torch's view of bytes would
        # not, for a one-element column's stride): half the cost of _bytes_of's torch views
        mine = (t.detach() if t.requires_grad else t).numpy().reshape(-1)
        transport, world = self.transport, group.size()

        def body(call: Call) -> None:
            transport.small_all_reduce(call, mine, RedOp.SUM if average else op)
            if average:  # the sum divided as the general route divides it (outside autograd, as there)
                with torch.no_grad():
                    numerics.finish_(t, RedOp.AVG, world)

        return _run(group, "all_reduce", tensors, body)

    def broadcast(self, group, tensors, opts=None, **kwargs) -> dist._Work | None:
        if type(opts) is not _BroadcastOptions or kwargs or type(tensors) is not list or len(tensors) != 1:
            return None
        t = tensors[0]
        if not self._takes(group, t) or opts.rootTensor != 0 or not 0 <= opts.rootRank < group.size():
            return None
        mine, dtype, numel = _bytes_of(t)
        root, transport = opts.rootRank, self.transport
        return _run(group, "broadcast", tensors, lambda call: transport.small_broadcast(call, mine, dtype, numel, root))

    def all_gather_single(self, group, output, input, opts=None, **kwargs) -> dist._Work | None:
        if type(opts) is not _AllgatherOptions or kwargs or not self._takes(group, input):
            return None
        if (type(output) not in _PLAIN or not output.is_cpu or output.dtype != input.dtype
                or output.numel() != input.numel() * group.size() or not output.is_contiguous()
                or output.is_conj() or output.is_neg()):
            return None
        block = input.numel() * input.element_size()
        src, dst = input.data_ptr(), output.data_ptr()
        if dst < src + block and src < dst + block * group.size() and src != dst + group.rank() * block:
            return None  # an input inside the output other than as this rank's block: the general route copies
        mine, dtype, numel = _bytes_of(input)
        gathered = _bytes_of(output)[0]
        transport = self.transport
        return _run(group, "all_gather_into_tensor", [output, input],
                    lambda call: transport.small_all_gather(call, gathered, mine, dtype, numel), outputs=[output])

    def _takes(self, group, t) -> bool:
        """Whether ``t`` may move on this path: a plain, contiguous CPU tensor of at most a slot."""
        return (type(t) in _PLAIN and t.is_cpu and not _profiling() and t.layout is torch.strided
                and 0 < t.numel() * t.element_size() <= self.max_bytes and t.is_contiguous() and not t.is_conj()
                and not t.is_neg() and not t.is_quantized and group.takes_calls())

    def barrier(self, group) -> dist._Work | None:
        if _profiling() or not group.takes_calls():
            return None
        return _run(group, "barrier", [], self.transport.barrier)


def _bytes_of(t: torch.Tensor) -> tuple[np.ndarray, torch.dtype, int]:
    """A contiguous tensor's memory as numpy bytes, and the dtype and numel a moving op's header
    gives it (algorithms.py's ``_as_bytes``: a dtype moved as bytes counts bytes)."""
    # contiguous, but a dimension of size 1 may carry any stride (a one-element column): the
    # flat view is said outright, which reshape would not do
    flat = (t.detach() if t.requires_grad else t).as_strided((t.numel(),), (1,))
    numel = flat.numel() * flat.element_size() if moved_as_bytes(t.dtype) else flat.numel()
    return flat.view(torch.uint8).numpy(), t.dtype, numel


def _run(group, op: str, tensors: list[torch.Tensor], body, outputs: list[torch.Tensor] | None = None) -> dist._Work:
    """``body`` as call ``op`` of ``group``: numbered, recorded, and its failure handled as
    ProcessGroupSMDDP._run handles one."""
    outputs = tensors if outputs is None else outputs
    index = group.number_call()
    if group._recorder is not None:
        body = group._recorder.track(index, op, tensors, outputs, body)
    try:
        body(Call(index, op))
    except BaseException as exc:
        return _failed(group, op, outputs, exc)
    return DoneWork(outputs)


def _failed(group, op: str, tensors: list[torch.Tensor], exc: BaseException) -> dist._Work:
    """A failed call's Work, whose ``wait()`` raises ``exc``, after the group took note of it as
    on the general route."""
    group._call_failed(op, exc)
    work = group._work(op, tensors)
    work._finish(exc)
    return work
