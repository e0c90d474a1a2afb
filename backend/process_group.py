"""ProcessGroupSMDDP: what torch.distributed sees. It validates each call and dispatches it.

Method names and signatures are c10d's, so ``dist.all_reduce`` and friends, DDP's C++ reducer and
``new_group`` all reach them unchanged. Both spellings exist where torch renamed a method
(``all_gather_single`` / ``_allgather_base``, ``reduce_scatter_single`` / ``_reduce_scatter_base``).
Every call is checked on the calling thread (bad input raises at once, on every rank that passed
it) and then runs, in call order, on the group's communication thread or inline (see work.py).
Calls on CUDA tensors go to the group's CUDA side (backend/cuda/): NCCL where it can run them,
else through host memory and the CPU path.
"""

from __future__ import annotations

import functools
import logging
from datetime import timedelta
from typing import Any, Callable, NoReturn

import torch
import torch.distributed as dist

from . import before_exit, flight_recorder, numerics, ops
from .algorithms import Collectives
from .call import Call
from .compile_boundary import hide_backend_from_dynamo
from .cuda.route import cuda_device, gathers_unevenly, staging_reason
from .errors import InvalidCallError, PeerFailureError, RecoverableMismatchError, SMDDPError, where
from .fast_cpu import FastCpuCalls
from .p2p import PeerLinks
from .transports import create_transport
from .transports.shm import ShmTransport
from .work import CommThread, SMDDPWork

log = logging.getLogger("smddp_lite")


def _device_aware(op: str, fast: str | None = None):
    """Route a collective (``op``, as errors name it) on CUDA tensors: the fast path's method
    ``fast`` where the call qualifies (backend/cuda/fast_path.py), else NCCL where the group has
    it and its table holds the call, else the CPU path on host copies (backend/cuda/staged.py),
    decided before the call starts (backend/cuda/route.py). CPU calls pass straight through."""
    return functools.partial(_route_by_device, op, fast)


def _route_by_device(op: str, fast: str | None, method):
    @functools.wraps(method)
    def route(self: ProcessGroupSMDDP, *args, **kwargs):
        small = self._fast_cpu
        if small is not None and fast is not None:
            taken = getattr(small, fast, None)
            work = taken(self, *args, **kwargs) if taken is not None else None
            if work is not None:
                return work
        calls = self._fast_cuda
        if calls is not None and fast is not None:
            work = getattr(calls, fast)(self, *args, **kwargs)
            if work is not None:
                return work
        with self._preparing(op):
            device, tensors = cuda_device(args)
        if device is None:
            return method(self, *args, **kwargs)
        paths = self._cuda_paths()
        why = staging_reason(paths.nccl.support if paths.nccl is not None else None, op, args, kwargs, tensors)
        if why is None:
            return method(self, *args, **kwargs)
        log.debug("smddp: %s on %s goes through host memory: %s", method.__name__, device, why)
        return paths.staged.run(method.__name__, functools.partial(method, self), args, kwargs, device)

    return route


class ProcessGroupSMDDP(dist.ProcessGroup):
    """A torch.distributed process group whose collectives run on smddp-lite's transports."""

    def __init__(self, store, rank: int, world_size: int, timeout: timedelta,
                 global_ranks: list[int] | None = None, group_name: str = "", config=None) -> None:
        super().__init__(rank, world_size)
        from smddp_lite.config import backend_config

        before_exit.gloo_used()  # gloo groups come with smddp groups (send/recv links, transports) and beside them

        self.config = config or backend_config()
        self.timeout = timeout
        self._group_name = group_name
        self._group_desc = ""  # c10d sets both (_set_group_name, _set_group_desc)
        store = _own_keys(store, world_size)
        self.transport, reason = create_transport(store, rank, world_size, global_ranks, timeout, self.config)
        self.collectives = Collectives(self.transport, self.config.checks_collectives, self.config.scratch_max_bytes)
        self._comm = CommThread(f"smddp-comm-{group_name or 'default'}", inline=self.transport.capabilities.runs_inline)
        self._comm.on_interrupt = self._interrupted
        self._calls = 0
        self._rank_and_size = (rank, world_size)  # for every call's Work (rank()/size() cross into C++)
        self._failure: str | None = None
        self._closed = False
        self._store = store
        self._cuda = None  # CudaPaths, made on the first call with CUDA tensors
        self._fast_cuda = None  # its FastCalls, where NCCL loaded (see _route_by_device)
        # small CPU calls on the caller's thread (fast_cpu.py), where the transport is shared memory
        self._fast_cpu = FastCpuCalls(self.transport) \
            if isinstance(self.transport, ShmTransport) and world_size > 1 else None
        self._peers = PeerLinks(store, rank, timeout)  # send/recv links: none is made before its first call
        # the last calls, for torch's analyzer (TORCH_FR_BUFFER_SIZE; None when 0)
        self._recorder = flight_recorder.for_group(store, self, global_ranks, timeout.total_seconds())
        if rank == 0:
            members = "all ranks" if global_ranks is None else f"global ranks {list(global_ranks)}"
            # the default group's choice always shows; subgroups' in debug mode
            level = logging.INFO if global_ranks is None or self.config.debug else logging.DEBUG
            log.log(level,
                    "smddp: group %s (%d ranks, %s) uses transport %s: %s",
                    group_name or "default", world_size, members, self.transport.name, reason)
        # last, once the transport's modules are loaded: torch.compile calls into a group as
        # into torch's C++ backends
        hide_backend_from_dynamo()

    # identity ----------------------------------------------------------------------------------
    def getBackendName(self) -> str:
        return "smddp"

    def name(self) -> str:
        return "smddp"

    # torch's Python code asks a group which devices it serves (``_device_types``: object
    # collectives, loading a full state dict with broadcast_from_rank0, DCP's async_save, FSDP's
    # optimizer state dict) and for the backend of a device. A ProcessGroup learns both only
    # from backends registered with it, and this one has none: it answered no devices, and those
    # failed ("Default device not found", "A CPU backend must be enabled for async save"). It
    # serves CPU and CUDA tensors itself, as gloo's group reports both.
    @property
    def _device_types(self) -> list[torch.device]:
        return [torch.device("cpu"), torch.device("cuda")]

    def _get_backend(self, device: torch.device) -> "ProcessGroupSMDDP":
        return self

    def supports_tensor_alloc(self, device: torch.device) -> bool:
        return False  # FSDP2 then allocates its communication buffers itself

    # c10d names every group it makes (_set_group_name, _set_group_desc) and DeviceMesh, FSDP2 and
    # the functional collectives read the names back. A ProcessGroup keeps them on the backends
    # registered with it, and this one, a ProcessGroup subclass, has none: without these, the
    # name was lost and fully_shard() failed with "ProcessGroup name not set".
    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    @property
    def group_name(self) -> str:
        return self._group_name

    def _set_group_desc(self, desc: str) -> None:
        self._group_desc = desc

    @property
    def group_desc(self) -> str:
        return self._group_desc

    # the one path every collective takes ---------------------------------------------------------
    def _run(self, op: str, tensors: list[torch.Tensor], outputs: list[torch.Tensor],
             check: Callable[[], None], body: Callable[[Call], None],
             nccl: Callable[[Any, Call], Any] | None = None):
        """Validate on this thread, then queue ``body`` (given this call's ``Call``) on the
        communication thread; for CUDA tensors (which the router sends here only where the NCCL
        path runs the call), enqueue ``nccl(nccl_path, call)`` on the device instead."""
        call = self.number_call()
        try:
            self._check_usable(op)
            for t in tensors:
                self._check_tensor(op, t)
            check()
        except (TypeError, ValueError, RuntimeError) as exc:
            self._refuse(op, call, exc)
        if tensors and tensors[0].is_cuda:
            if nccl is None or self._cuda.nccl is None:
                raise AssertionError(f"{op} on CUDA tensors was routed to NCCL, which has no form of it: "
                                     "backend/cuda/support.py's NCCL_FORMS and the call disagree")
            if self._recorder is not None:  # enqueued is started; the watchdog reports its end or failure
                nccl = self._recorder.track(call, op, tensors, outputs, nccl, prefix="nccl", ends=False)
            with torch.no_grad():  # see run() below
                return flight_recorder.profiled(op, tensors, outputs, lambda: nccl(self._cuda.nccl, Call(call, op)))
        if self._recorder is not None:
            body = self._recorder.track(call, op, tensors, outputs, body)

        def run() -> None:
            if self._failure is not None:
                raise SMDDPError(self._failure)
            try:
                # collectives write tensors' data outside autograd, as torch's own backends do: a
                # parameter (a leaf that requires grad) may be all-reduced or broadcast by hand,
                # and grad mode is per thread, on by default on the communication thread
                with torch.no_grad():
                    body(Call(call, op))
            except BaseException as exc:
                self._call_failed(op, exc)
                raise

        return flight_recorder.profiled(op, tensors, outputs, lambda: self._comm.submit(run, self._work(op, outputs)))

    def number_call(self) -> int:
        """The next call number. Every collective takes one, on every path (refused ones too):
        ranks that make the same calls give them the same numbers, under which they find each
        other's refusals and signatures (refusals.py)."""
        self._calls += 1
        return self._calls

    def takes_calls(self) -> bool:
        """Neither destroyed nor failed (a call would be refused)."""
        return self._failure is None and not self._closed

    def _preparing(self, op: str) -> "_Preparing":
        """Around what a call does with its arguments before ``_run`` numbers it (reading the
        reduce op, listing the tensors, finding their device): bad arguments there are refused
        as ``_run``'s checks refuse them, under a call number of their own, so that peers waiting
        in the call hear of it and this rank's later calls keep the numbers its peers give them."""
        return _Preparing(self, op)

    def _refuse(self, op: str, call: int, exc: Exception) -> NoReturn:
        """Raise ``exc`` on this rank naming rank and op, after queueing the refusal of ``call``
        for its peers (on the communication thread, after earlier calls): bad arguments as an
        InvalidCallError, a call on a group that failed as the same ``DistBackendError`` its waits
        raise."""
        message = f"{where(self.rank(), self.size(), op)} {exc}"
        if not self._closed:
            self._comm.submit(lambda: self._refused(op, call, message), self._work(op, []))
        raise _refusal_type(exc)(message) from None

    def _refused(self, op: str, call: int, message: str) -> None:
        """On the communication thread, in call order: tell peers this rank refused ``call``;
        if some were inside it and left, this rank's later calls must not go on (they would pair
        with the operations those peers left posted)."""
        if self._failure is not None or self._closed:  # refused because of that: nothing to learn
            self.transport.reject(call, message, learn_outcome=False)
            return
        cannot_go_on = self.transport.reject(call, message)
        if cannot_go_on and self._failure is None:
            self._failure = f"{where(self.rank(), self.size(), op)} {cannot_go_on}"

    def _call_failed(self, op: str, exc: BaseException) -> None:
        """What a call that raised ``exc`` leaves the group, on whichever route it ran: after a
        backend error the group can no longer be used (a mismatch every rank found before any
        data moved excepted: the group goes on); an interrupted call leaves its peers inside it."""
        if isinstance(exc, RecoverableMismatchError):
            return
        if isinstance(exc, dist.DistBackendError):
            self._failure = f"{where(self.rank(), self.size(), op)} an earlier collective failed: {exc}"
        elif isinstance(exc, (KeyboardInterrupt, SystemExit)):  # on a caller's thread that ran its call
            self._interrupted(where(self.rank(), self.size(), op), exc)

    def _interrupted(self, prefix: str, exc: BaseException) -> None:
        """A call was interrupted (Ctrl-C) on the caller's thread: running it, or waiting for it."""
        self._failure = self._failure or (f"{prefix} an earlier collective was interrupted ({type(exc).__name__}) "
                                          "while its peers may still be in it")

    def _work(self, op: str, outputs: list[torch.Tensor]) -> SMDDPWork:
        return SMDDPWork(where(*self._rank_and_size, op), outputs, self.timeout)

    def _check_usable(self, op: str) -> None:
        if self._closed:
            raise RuntimeError(
                "this process group was destroyed (destroy_process_group); create a new one with "
                "init_process_group or new_group before calling collectives"
            )
        if self._failure is not None:
            # a DistBackendError, as the wait that found the failure raised (torchelastic and
            # user retry loops catch that type): a call made after that wait ended is refused
            # here, one made before it raised in the communication thread, and both mean the same
            raise SMDDPError(f"this process group can no longer be used: {self._failure}")

    def _check_tensor(self, op: str, t: object, lazy_views: bool = False) -> None:
        """``lazy_views``: the op takes lazy conjugate / negative views (send and recv resolve them)."""
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"expected a torch.Tensor, found {type(t).__name__}")
        if t.device.type not in ("cpu", "cuda"):
            raise ValueError(
                f"tensor is on {t.device}; the smddp backend moves CPU and CUDA tensors. Move it with "
                ".cpu() or .cuda()"
            )
        if t.layout != torch.strided:
            raise ValueError(f"expected a dense (strided) tensor, found layout {t.layout}; call .to_dense()")
        if not lazy_views and (t.is_conj() or t.is_neg()):
            # lazy conjugate / negative views: the memory holds the values unconjugated, and
            # every transport moves memory (a contiguous one was sent with the wrong sign)
            raise ValueError(f"the tensor is a lazy {'conjugate' if t.is_conj() else 'negative'} view; call "
                             f"{'.resolve_conj()' if t.is_conj() else '.resolve_neg()'} first (torch's own "
                             "backends read its memory as it is too)")
        if t.is_quantized:
            raise ValueError(f"quantized tensors ({ops.dtype_name(t.dtype)}) are not supported; send t.int_repr() "
                             "and the scale and zero point, as with torch's own backends")
        if t.is_complex() and op in ops.REDUCING_OPS:  # the summing ops took their real view already
            raise ValueError(f"{ops.dtype_name(t.dtype)} tensors are reduced only by SUM, AVG and PREMUL_SUM (which "
                             "add real and imaginary parts apart); MIN, MAX, PRODUCT and the bitwise ops do not apply "
                             "to complex numbers, and torch's own backends refuse them too")
        if t.dtype not in ops.DTYPES and op in ops.REDUCING_OPS:
            raise ValueError(f"dtype {ops.dtype_name(t.dtype)} is not supported by reductions; supported: "
                             f"{ops.supported_dtype_names()}. Ops that only move data (broadcast, all_gather, "
                             "gather, scatter, all_to_all, send/recv) take any dtype")

    def _root(self, root: int) -> None:
        if not 0 <= root < self.size():
            raise ValueError(f"root rank {root} is outside the group of {self.size()} ranks (0..{self.size() - 1})")

    def _reduce_op(self, opts) -> tuple[ops.RedOp, numerics.Factor | None]:
        """The op and, for a PREMUL_SUM, its factor (see numerics.reduction)."""
        return numerics.reduction(getattr(opts, "reduceOp", opts))

    # collectives -------------------------------------------------------------------------------
    @_device_aware("all_reduce", fast="all_reduce")
    def allreduce(self, tensors, opts=None):
        with self._preparing("all_reduce"):
            op, factor = self._reduce_op(opts or dist.AllreduceOptions())
            tensors = numerics.complex_as_real(_as_list(tensors), op)

        def premultiplied(t: torch.Tensor) -> torch.Tensor:
            """For a PREMUL_SUM, ``t`` times the factor, in place (the result overwrites it
            anyway). Runs after the checks: on the CPU after the ranks agreed on the call (a
            mismatch leaves the group usable, so the input must be as it was), on CUDA on the
            caller's stream, which the collective's stream waits for."""
            return numerics.premultiplied(t, factor, in_place=True)

        return self._run("all_reduce", tensors, tensors, lambda: _same_ops(op, tensors, factor),
                         lambda c: self.collectives.all_reduce(c, tensors, op, premultiplied),
                         lambda n, c: n.all_reduce(c, [premultiplied(t) for t in tensors], op))

    def allreduce_coalesced(self, tensors, opts=None):
        return self.allreduce(tensors, opts)

    @_device_aware("broadcast", fast="broadcast")
    def broadcast(self, tensors, opts=None):
        with self._preparing("broadcast"):
            tensors = _as_list(tensors)
        root = getattr(opts, "rootRank", 0) if opts is not None else 0
        return self._run("broadcast", tensors, tensors, lambda: self._root(root),
                         lambda c: self.collectives.broadcast(c, tensors, root),
                         lambda n, c: n.broadcast(c, tensors, root))

    @_device_aware("reduce")
    def reduce(self, tensors, opts=None):
        opts = opts or dist.ReduceOptions()
        with self._preparing("reduce"):
            (op, factor), root = self._reduce_op(opts), opts.rootRank
            tensors = numerics.complex_as_real(_as_list(tensors), op)

        def check() -> None:
            self._root(root)
            _one_tensor("reduce", tensors)
            _same_ops(op, tensors, factor)

        def premultiplied(t: torch.Tensor) -> torch.Tensor:
            """What this rank reduces: ``t``, or for a PREMUL_SUM ``t`` times the factor, in place
            on the root (which receives the result) and a copy elsewhere (whose tensors a reduce
            leaves as they were). On the CPU it runs after the ranks agreed on the call."""
            return numerics.premultiplied(t, factor, in_place=self.rank() == root)

        return self._run("reduce", tensors, tensors, check,
                         lambda c: self.collectives.reduce(c, tensors[0], root, op, premultiplied),
                         lambda n, c: n.reduce(c, premultiplied(tensors[0]), root, op))

    @_device_aware("all_gather")
    def allgather(self, output_tensors, input_tensors, opts=None):
        with self._preparing("all_gather"):
            inputs = _as_list(input_tensors)
            outputs = list(_inner_list(output_tensors))

        # Outputs of different sizes (NCCL allows them; gloo does not): rank p's output p must
        # hold its input, and the others what those ranks send, which the uneven all_to_all that
        # carries them checks across ranks, failing on every rank where they disagree. (A rank
        # whose outputs all match its input takes the equal path; on shm its peers on the uneven
        # one then fail with it, as ranks that call different collectives do.) On CUDA they go
        # through host memory (the router asks the same question).
        uneven = gathers_unevenly(outputs, inputs)

        def check() -> None:
            _one_tensor("all_gather", inputs)
            if not uneven:
                return self._same_blocks("all_gather", outputs, inputs[0], "output")
            self._same_blocks("all_gather", outputs, inputs[0], "output", sizes=False)
            mine = outputs[self.rank()]
            if mine.numel() != inputs[0].numel():
                raise ValueError(f"output tensor {self.rank()} (this rank's) has {mine.numel()} elements, but the "
                                 f"input has {inputs[0].numel()}; this rank's output must hold its own input")

        def body(c: Call) -> None:
            if uneven:
                return self.collectives.all_gather_v(c, outputs, inputs[0])
            flat = torch.empty(self.size() * inputs[0].numel(), dtype=inputs[0].dtype)
            self.collectives.all_gather(c, flat, inputs[0])
            for out, block in zip(outputs, flat.chunk(self.size()) if flat.numel() else [flat] * self.size()):
                out.copy_(block.view_as(out))

        return self._run("all_gather", inputs + outputs, outputs, check, body,
                         None if uneven else lambda n, c: n.all_gather_list(c, outputs, inputs[0]))

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        """``output_lists[r][j]`` receives rank r's ``input_list[j]``: the lists are indexed by rank
        first, as ``dist.all_gather_coalesced`` passes them (and gloo lays them out)."""
        with self._preparing("all_gather_coalesced"):
            if len(output_lists) != self.size() or any(len(outs) != len(input_list) for outs in output_lists):
                raise ValueError(
                    f"expected {self.size()} output lists (one per rank) of {len(input_list)} tensors each (one per "
                    f"input), found {len(output_lists)} lists of {[len(outs) for outs in output_lists]} tensors; "
                    "output_tensor_lists[r][j] receives rank r's input_tensor_list[j]")
        works = [self.allgather([[outs[j] for outs in output_lists]], [inp], opts) for j, inp in enumerate(input_list)]
        return works[-1] if works else self.barrier()

    @_device_aware("all_gather_into_tensor", fast="all_gather_single")
    def all_gather_single(self, output, input, opts=None):
        check = lambda: self._sized("all_gather_into_tensor", output, input, self.size())  # noqa: E731
        return self._run("all_gather_into_tensor", [output, input], [output], check,
                         lambda c: self.collectives.all_gather(c, output, input),
                         lambda n, c: n.all_gather(c, output, input))

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        works = [self.all_gather_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return works[-1] if works else self.barrier()

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    @_device_aware("reduce_scatter")
    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        with self._preparing("reduce_scatter"):
            op, factor = self._reduce_op(opts or dist.ReduceScatterOptions())
            inputs = numerics.complex_as_real(list(_inner_list(input_tensors)), op)
            outputs = numerics.complex_as_real(_as_list(output_tensors), op)

        def check() -> None:
            _one_tensor("reduce_scatter", outputs)
            self._same_blocks("reduce_scatter", inputs, outputs[0], "input")
            _same_ops(op, outputs, factor)

        def sent() -> list[torch.Tensor]:  # a PREMUL_SUM's inputs times the factor: copies, the inputs stay
            return inputs if factor is None else [numerics.premultiplied(t, factor, in_place=False) for t in inputs]

        def body(c: Call) -> None:
            self.collectives.reduce_scatter(c, outputs[0], torch.cat([t.reshape(-1) for t in sent()]), op)

        return self._run("reduce_scatter", outputs + inputs, outputs, check, body,
                         lambda n, c: n.reduce_scatter_list(c, outputs[0], sent(), op))

    @_device_aware("reduce_scatter_tensor")
    def reduce_scatter_single(self, output, input, opts=None):
        with self._preparing("reduce_scatter_tensor"):
            op, factor = self._reduce_op(opts or dist.ReduceScatterOptions())
            output, input = numerics.complex_as_real([output, input], op)

        def check() -> None:
            self._sized("reduce_scatter_tensor", input, output, self.size())
            _same_ops(op, [output], factor)

        def sent() -> torch.Tensor:  # a PREMUL_SUM's input times the factor: a copy, the input stays
            return numerics.premultiplied(input, factor, in_place=False)

        return self._run("reduce_scatter_tensor", [output, input], [output], check,
                         lambda c: self.collectives.reduce_scatter(c, output, sent(), op),
                         lambda n, c: n.reduce_scatter(c, output, sent(), op))

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        works = [self.reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return works[-1] if works else self.barrier()

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    @_device_aware("all_to_all_single")
    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        op = "all_to_all_single"
        n = self.size()
        # Split sizes given (MoE routing; torch's functional collectives give equal ones always)
        # take the uneven path on every rank, equal or not: the ranks must all take the same one,
        # and a rank's own sizes may be equal (its routing balanced) where a peer's are not.
        # Both run NCCL on CUDA, as grouped sends and receives that pair with each other.
        uneven = output.numel() != input.numel() or bool(output_split_sizes) or bool(input_split_sizes)

        def check() -> None:
            if output.dtype != input.dtype:
                raise ValueError(f"tensors differ in dtype: {ops.dtype_name(output.dtype)} and "
                                 f"{ops.dtype_name(input.dtype)}; pass an output of the input's dtype")
            if output.dim() == 0 or input.dim() == 0:
                raise ValueError("expected tensors with at least one dimension (blocks are split along "
                                 "the first), found a 0-dimensional tensor; reshape it with .view(-1)")
            if output.shape[1:].numel() != input.shape[1:].numel():
                raise ValueError(f"the input's rows ({tuple(input.shape)}) and the output's ({tuple(output.shape)}) "
                                 "differ in size; blocks are rows of the first dimension, so every other "
                                 "dimension must hold as many elements in both")
            for name, splits, t in (("output_split_sizes", output_split_sizes, output),
                                    ("input_split_sizes", input_split_sizes, input)):
                _check_splits(name, splits, t, n)

        body = nccl = None
        if uneven:
            row = input.shape[1:].numel()
            output_rows = lambda: list(output_split_sizes) or _equal(output.shape[0], n)  # noqa: E731
            input_rows = lambda: list(input_split_sizes) or _equal(input.shape[0], n)  # noqa: E731

            def body(c: Call) -> None:
                self.collectives.all_to_all_v(c, output, output_rows(), input, input_rows(), row)

            def nccl(path, call: Call):
                return path.all_to_all_v(call, output, [c * row for c in output_rows()], input,
                                         [c * row for c in input_rows()])
        else:
            def body(c: Call) -> None:
                self.collectives.all_to_all(c, output, input)

            def nccl(path, call: Call):
                return path.all_to_all(call, output, input)
        return self._run(op, [output, input], [output], check, body, nccl)

    all_to_all_single = alltoall_base

    @_device_aware("all_to_all")
    def alltoall(self, output_tensors, input_tensors, opts=None):
        with self._preparing("all_to_all"):
            outputs, inputs = list(output_tensors), list(input_tensors)

        def check() -> None:
            for name, tensors in (("output", outputs), ("input", inputs)):
                if len(tensors) != self.size():
                    raise ValueError(f"expected {self.size()} {name} tensors (one per rank), found {len(tensors)}")
            dtypes = {t.dtype for t in outputs + inputs}
            if len(dtypes) > 1:
                raise ValueError(f"tensors differ in dtype ({', '.join(sorted(map(ops.dtype_name, dtypes)))}); "
                                 "pass tensors of one dtype")

        def body(c: Call) -> None:
            received = torch.empty(sum(t.numel() for t in outputs), dtype=outputs[0].dtype)
            sent = torch.cat([t.reshape(-1) for t in inputs])
            self.collectives.all_to_all_v(c, received, [t.numel() for t in outputs], sent, [t.numel() for t in inputs])
            for out, block in zip(outputs, received.split([t.numel() for t in outputs])):
                out.copy_(block.view_as(out))

        return self._run("all_to_all", outputs + inputs, outputs, check, body)

    @_device_aware("gather")
    def gather(self, output_tensors, input_tensors, opts=None):
        root = (opts or dist.GatherOptions()).rootRank
        with self._preparing("gather"):
            inputs = _as_list(input_tensors)
            outputs = list(_inner_list(output_tensors)) if output_tensors else []
        return self._rooted("gather", inputs, outputs, "output", root, outputs,
                            lambda c: self.collectives.gather(c, outputs, inputs[0], root))

    @_device_aware("scatter")
    def scatter(self, output_tensors, input_tensors, opts=None):
        root = (opts or dist.ScatterOptions()).rootRank
        with self._preparing("scatter"):
            outputs = _as_list(output_tensors)
            inputs = list(_inner_list(input_tensors)) if input_tensors else []
        return self._rooted("scatter", outputs, inputs, "input", root, outputs,
                            lambda c: self.collectives.scatter(c, outputs[0], inputs, root))

    def _rooted(self, op: str, mine: list[torch.Tensor], blocks: list[torch.Tensor], what: str, root: int,
                outputs: list[torch.Tensor], body: Callable[[Call], None]):
        """gather and scatter: one tensor of this rank's (``mine``) and, on the root only, one
        block per rank (``blocks``, the ``what`` tensors), each like it."""
        def check() -> None:
            self._root(root)
            _one_tensor(op, mine)
            if self.rank() == root:
                self._same_blocks(op, blocks, mine[0], what)
            elif blocks:
                raise ValueError(f"found {len(blocks)} {what} tensors on a rank other than the root ({root}); "
                                 f"pass {op}_list only on the root")

        return self._run(op, mine + blocks, outputs, check, body)

    def barrier(self, opts=None):
        if self._fast_cpu is not None and self._cuda is None:  # no CUDA collectives to order it after
            work = self._fast_cpu.barrier(self)
            if work is not None:
                return work
        nccl = self._cuda.nccl if self._cuda is not None else None
        if nccl is not None and nccl.comms.by_device:  # ordered after this group's CUDA collectives
            call = self.number_call()
            try:
                self._check_usable("barrier")
            except RuntimeError as exc:
                self._refuse("barrier", call, exc)
            return nccl.barrier(Call(call, "barrier"))
        return self._run("barrier", [], [], lambda: None, self.collectives.barrier)

    def recv_anysource(self, *args, **kwargs):
        raise RuntimeError(
            f"{where(self.rank(), self.size(), 'recv')} recv from any source (src=None) is not supported by the "
            "smddp backend: each pair of ranks has a link of its own (backend/p2p.py). Pass src=<rank>."
        )

    # point to point ------------------------------------------------------------------------------
    @_device_aware("send")
    def send(self, tensors, dstRank, tag=0):
        return self._point_to_point("send", tensors, dstRank, tag)

    @_device_aware("recv")
    def recv(self, tensors, srcRank, tag=0):
        return self._point_to_point("recv", tensors, srcRank, tag)

    def _point_to_point(self, kind: str, tensors, peer: int, tag: int):
        """A send or recv on the pair's own link (p2p.py): not numbered among the collectives,
        which every rank makes, so a refusal here is this rank's alone."""
        rank, size = self._rank_and_size
        tensors = list(tensors) if isinstance(tensors, (list, tuple)) else [tensors]
        try:
            self._check_usable(kind)
            _one_tensor(kind, tensors)
            self._check_tensor(kind, tensors[0], lazy_views=True)
            if not 0 <= peer < size or peer == rank:
                raise ValueError(f"peer rank {peer} is not another rank of this group of {size} "
                                 f"(0..{size - 1}, not this rank, {rank})")
            if not isinstance(tag, int) or not 0 <= tag < 2**31:
                # gloo's tags are 32-bit: a larger one failed the post and closed the pair's link
                raise ValueError(f"tag {tag!r} must be an int from 0 to 2**31 - 1")
            if kind == "recv" and any(st == 0 and n > 1 for st, n in zip(tensors[0].stride(), tensors[0].shape)):
                raise ValueError(f"cannot receive into a tensor whose elements share memory (shape "
                                 f"{tuple(tensors[0].shape)}, strides {tensors[0].stride()}: expand()ed?); "
                                 "receive into a tensor of its own (torch.empty(shape)) and expand that")
        except (TypeError, ValueError, RuntimeError) as exc:
            raise _refusal_type(exc)(f"{where(rank, size, kind)} {exc}") from None
        if tensors[0].is_cuda:
            raise AssertionError(f"{kind} of a CUDA tensor reached the CPU path: the router stages it "
                                 "(backend/cuda/support.py has no NCCL form of it)")
        describe = f"{where(rank, size, kind)} {'to' if kind == 'send' else 'from'} rank {peer} (tag {tag})"
        if self._recorder is not None:
            self._recorder.record_p2p(kind, rank, peer, tensors[0])
        return self._peers.start(kind, tensors[0], peer, tag, describe)


    # shape checks ------------------------------------------------------------------------------
    def _same_blocks(self, op: str, blocks: list[torch.Tensor], like: torch.Tensor, what: str,
                     sizes: bool = True) -> None:
        """One block per rank, each of ``like``'s dtype and (where ``sizes``) its size."""
        if len(blocks) != self.size():
            raise ValueError(f"expected {self.size()} {what} tensors (one per rank), found {len(blocks)}")
        for i, b in enumerate(blocks):
            self._check_tensor(op, b)
            if b.dtype != like.dtype or (sizes and b.numel() != like.numel()):
                found, expected = ops.dtype_name(b.dtype), ops.dtype_name(like.dtype)
                differs = (f"has {b.numel()} elements of {found}, expected {like.numel()} of {expected}" if sizes
                           else f"is of {found}, expected {expected}")
                raise ValueError(f"{what} tensor {i} {differs} like the other tensor")

    def _sized(self, op: str, big: torch.Tensor, small: torch.Tensor, factor: int) -> None:
        if big.dtype != small.dtype:
            raise ValueError(f"tensors differ in dtype: {ops.dtype_name(big.dtype)} and {ops.dtype_name(small.dtype)}")
        if big.numel() != factor * small.numel():
            raise ValueError(
                f"expected the larger tensor to hold {factor} x {small.numel()} = {factor * small.numel()} "
                f"elements (world size x the smaller one), found {big.numel()}"
            )

    # CUDA tensors ------------------------------------------------------------------------------
    def _cuda_paths(self):
        if self._cuda is None:
            from .cuda import CudaPaths

            self._cuda = CudaPaths(self._store, self.rank(), self.size(), self.timeout, self.config,
                                   self._cuda_failed)
            if self.rank() == 0:
                log.log(logging.INFO if self.config.debug else logging.DEBUG, "smddp: group %s moves CUDA tensors "
                        "%s", self._group_name or "default",
                        "through NCCL (cupy)" if self._cuda.nccl else f"through host memory: {self._cuda.reason}")
            self._fast_cuda = self._cuda.nccl.fast if self._cuda.nccl is not None else None
            hide_backend_from_dynamo()  # the CUDA modules just loaded
        return self._cuda

    def _cuda_failed(self, reason: str) -> None:
        self._failure = self._failure or reason
        if self._recorder is not None:
            self._recorder.failed(reason)

    def interrupt(self, reason: str) -> None:
        """End the call this rank waits in with a PeerFailureError saying ``reason``, and refuse
        later calls: for a watcher outside the calls (SurvivingSync's heartbeat) that found a peer
        lost, which the waits themselves would see only at the group's timeout. Any thread.
        Calls on CUDA tensors through NCCL are not reached."""
        self._failure = self._failure or f"{where(self.rank(), self.size(), 'interrupted')} {reason}"
        self.transport.interrupt(reason)

    def raise_if_a_peer_left(self) -> None:
        """Raise PeerFailureError where a peer left the group's protocol (failed, or was
        interrupted) while this rank was not waiting: a call this rank makes after that can
        complete on what the peer posted before it left. SurvivingSync's commit asks it, so that
        a rank let go on after the others went on without it never applies their step."""
        left = self.transport.peer_left()
        if left is not None:
            raise PeerFailureError(f"{where(self.rank(), self.size(), 'commit')} {left}")

    # lifetime ----------------------------------------------------------------------------------
    def shutdown(self, *args, **kwargs) -> None:
        self._close(abort=False)

    def abort(self, *args, **kwargs) -> None:
        self._close(abort=True)

    def _close(self, abort: bool) -> None:
        if self._closed:
            return
        self._closed = True
        if self._recorder is not None:
            self._recorder.close()
        if self._cuda is not None:
            self._cuda.close(abort)
        self._comm.stop()
        self._peers.close()
        self.transport.close()
        self.collectives.scratch.release()


class _Preparing:
    """``ProcessGroupSMDDP._preparing``'s context. A class, not ``contextlib.contextmanager``: it
    runs twice in every call, and a generator-based context costs several times as much."""

    __slots__ = ("group", "op")

    def __init__(self, group: ProcessGroupSMDDP, op: str) -> None:
        self.group, self.op = group, op

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, exc, traceback) -> bool:
        if kind is not None and issubclass(kind, (TypeError, ValueError)):
            self.group._refuse(self.op, self.group.number_call(), exc)
        return False


def _refusal_type(exc: Exception) -> type[Exception]:
    """What a refused call raises: the group's failure keeps its DistBackendError type; bad
    arguments (and a destroyed group) are an InvalidCallError (a ValueError and a RuntimeError)."""
    return type(exc) if isinstance(exc, dist.DistBackendError) else InvalidCallError


def _as_list(tensors) -> list[torch.Tensor]:
    if isinstance(tensors, torch.Tensor):
        return [tensors]
    tensors = list(tensors)
    if not tensors:
        raise ValueError("expected at least one tensor, found an empty list")
    return tensors


def _inner_list(tensor_lists):
    """The one list of ``[[t0, t1, ...]]`` (c10d's list-of-lists form), or the list itself."""
    if tensor_lists and isinstance(tensor_lists[0], (list, tuple)):
        return tensor_lists[0]
    return tensor_lists


def _equal(rows: int, world_size: int) -> list[int]:
    """Split sizes of ``rows`` in equal blocks, one per rank (what empty split sizes mean)."""
    return [rows // world_size] * world_size


def _check_splits(name: str, splits, tensor: torch.Tensor, world_size: int) -> None:
    """Split sizes, as c10d takes them: none (equal blocks of the first dimension) or one
    non-negative count of rows per rank, adding up to the first dimension."""
    rows = tensor.shape[0]
    if not splits:
        if rows % world_size:
            raise ValueError(f"{name} is empty, so the first dimension ({rows} rows of {tuple(tensor.shape)}) "
                             f"must divide into {world_size} equal blocks; pass {name} for uneven blocks")
        return
    splits = list(splits)
    if len(splits) != world_size or any(not isinstance(c, int) or c < 0 for c in splits):
        raise ValueError(f"{name}={splits}: expected {world_size} non-negative row counts (one per rank)")
    if sum(splits) != rows:
        raise ValueError(f"{name}={splits} adds up to {sum(splits)} rows, but the tensor has {rows} "
                         f"({tuple(tensor.shape)}); the counts must add up to its first dimension")


def _one_tensor(op: str, tensors: list[torch.Tensor]) -> None:
    if len(tensors) != 1:
        raise ValueError(f"{op} takes one tensor per rank, found {len(tensors)}")


def _same_ops(op: ops.RedOp, tensors: list[torch.Tensor], factor: numerics.Factor | None = None) -> None:
    for t in tensors:
        ops.check_op_for_dtype(op, t.dtype)
        if factor is not None and not t.is_floating_point():
            raise ValueError(f"PREMUL_SUM needs floating-point tensors, found {ops.dtype_name(t.dtype)}; use SUM")


def _own_keys(store, world_size: int):
    """The part of ``store`` this incarnation of the group writes to. A group destroyed and made
    again under the same store prefix (destroy_process_group and a new init_process_group on
    torchrun's agent store) found the keys its last incarnation left: the shared-memory segment's
    name (the file was gone: FileNotFoundError), gloo's and NCCL's rendezvous addresses. Every
    rank of the group adds 1 while the group is made, and cannot finish making it before all have
    (each transport meets every rank there), so each computes the same number. The count is kept
    per group size: torch names subgroups by a counter that destroy_process_group resets, so a
    prefix may next serve a group of another size, and one shared count would then start
    mid-group (a 2-rank group's count read by a 4-rank one gave incarnations 0, 0, 1, 1)."""
    incarnation = (store.add(f"smddp/incarnations/{world_size}", 1) - 1) // world_size
    return dist.PrefixStore(f"smddp/{world_size}/{incarnation}", store)


def create_process_group(dist_backend_opts, backend_options=None) -> ProcessGroupSMDDP:
    """The creator torch.distributed calls for backend "smddp" (``extended_api=True``)."""
    return ProcessGroupSMDDP(
        dist_backend_opts.store,
        dist_backend_opts.group_rank,
        dist_backend_opts.group_size,
        dist_backend_opts.timeout,
        global_ranks=list(dist_backend_opts.global_ranks_in_group or []) or None,
        group_name=str(dist_backend_opts.group_id or ""),
    )
