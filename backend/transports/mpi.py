"""MPI through mpi4py, for jobs launched by mpiexec/mpirun.

Non-blocking MPI calls are polled so that every wait honours the process group's timeout: a
blocking MPI call on a stuck peer would never return. MPI has no bfloat16 type and sums float16
in float16, so the algorithms layer hands this transport float32 for 16-bit tensors.
"""

from __future__ import annotations

import os
import time

import torch

from ..call import Call
from ..errors import PeerFailureError, ranks_said, where
from ..ops import RedOp
from .base import Transport, block_offsets, overlap
from .local_peers import LocalPeers
from .mpi_environment import cma_requested_where_blocked, import_mpi
from .refusals import POLL_S


def _mpi():
    return import_mpi()  # imported lazily: MPI_Init belongs to jobs that use this transport


_MPI_OP = {RedOp.SUM: "SUM", RedOp.PRODUCT: "PROD", RedOp.MIN: "MIN", RedOp.MAX: "MAX",
           RedOp.BAND: "BAND", RedOp.BOR: "BOR", RedOp.BXOR: "BXOR"}

# MPICH (the pip wheel, 2 ranks on one host) reduces up to 16 MiB at 5-6 GB/s of bus bandwidth
# and larger messages at about 2 (benchmarks/results/2026-11-22-cpu-collectives.md): an
# all_reduce above this size runs as consecutive pieces of it.
_ALL_REDUCE_PIECE_BYTES = 16 << 20
_YIELD_FOR_S = 0.02
_SLEEP_S = 100e-6


def _buf(t: torch.Tensor):
    """A numpy view of ``t`` for mpi4py. bfloat16 has no numpy (or MPI) type; it only reaches this
    transport in data-movement ops, where its bits travel as int16."""
    t = t.detach()  # numpy() refuses tensors that require grad (parameters); the memory is the same
    return (t.view(torch.int16) if t.dtype is torch.bfloat16 else t).numpy()


def _in_place(input: torch.Tensor, output: torch.Tensor, at: int) -> bool:
    """Whether ``input`` is the block of ``output`` that starts at element ``at`` (MPI_IN_PLACE)."""
    return bool(input.numel()) and input.data_ptr() == output[at:].data_ptr()


def _unaliased(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """``src``, or a copy of it when its memory overlaps ``dst``'s."""
    return src.clone() if overlap(src, dst) else src


class MPITransport(Transport):
    name = "mpi"

    def __init__(self, rank: int, world_size: int, global_ranks: list[int] | None, timeout, store, **shown) -> None:
        super().__init__(rank, world_size, **shown)
        MPI = _mpi()
        self._MPI = MPI
        self.timeout_s = timeout.total_seconds()
        world = MPI.COMM_WORLD
        if global_ranks is None or len(global_ranks) == world.Get_size():
            if world.Get_size() != world_size:
                raise ValueError(
                    f"{where(rank, world_size, 'init')} the MPI job has {world.Get_size()} processes but "
                    f"the process group has {world_size} ranks; launch with mpiexec -n {world_size} or set "
                    "SMDDP_TRANSPORT=gloo"
                )
            # key=rank orders the new communicator by torch rank, whatever order the launcher used
            self.comm = world.Split(color=0, key=rank)
        else:
            # a subgroup: its members' COMM_WORLD ranks (a launcher may number them otherwise
            # than torch), learned through the group's store, so that the default group need not
            # be MPI (under mpiexec on several hosts it is the hierarchical transport)
            store.set(f"mpi-world-rank/{rank}", str(world.Get_rank()))
            members = [int(store.get(f"mpi-world-rank/{r}")) for r in range(world_size)]
            self.comm = world.Create_group(world.Get_group().Incl(members))
        if self.comm.Get_rank() != rank:
            raise RuntimeError(f"{where(rank, world_size, 'init')} MPI rank {self.comm.Get_rank()} != group rank")
        # MPI says nothing when a peer's process ends (under a launcher that lets the others
        # live, they would wait for the timeout): the waits look for its pid instead
        self._local_peers = LocalPeers(store, self.peers_shown[rank] if self.peers_shown else rank)
        self.comm.Barrier()
        self._local_peers.learn()

    def _run(self, call: Call, op: str, start) -> None:
        """Start a non-blocking MPI call (``start()`` returns its request) and wait for it. An MPI
        error on this rank is announced to the peers (refusals.RefusalBoard.announce_failure),
        which would otherwise wait in the call until the timeout, and raised with what to do."""
        try:
            self._wait(call, op, start())
        except self._MPI.Exception as exc:
            message = f"MPI failed: {exc}".rstrip()
            if self.refusals is not None:
                self.refusals.announce_failure(call.index, f"{op}: {message}")
            hint = (" MPICH was told to copy between ranks with process_vm_readv (MPIR_CVAR_CH4_CMA_ENABLE), "
                    "which this process may not call (a container without CAP_SYS_PTRACE?): unset that variable "
                    "to let smddp_lite turn it off, or run the container with --cap-add SYS_PTRACE."
                    if cma_requested_where_blocked() else "")
            raise PeerFailureError(f"{self.where(call, op)} {message}.{hint}") from exc

    def _wait(self, call: Call, op: str, request) -> None:
        """Drive ``request`` to completion, raising once the group's timeout passes.

        MPICH advances a non-blocking collective only inside MPI calls, so polls must be frequent:
        each is followed by a sched_yield (which also drops the GIL) for the first _YIELD_FOR_S,
        then by a short sleep, so long waits for a busy peer do not burn a core.
        """
        start = time.monotonic()
        next_check = start + POLL_S
        while not request.Test():
            now = time.monotonic()
            waited = now - start
            if waited < _YIELD_FOR_S:
                os.sched_yield()
                continue
            time.sleep(_SLEEP_S)
            if now >= next_check:
                self.raise_if_told(call, op)  # a peer that refused this call never enters it
                dead = self._local_peers.dead(settle=False)
                if dead:
                    raise PeerFailureError(f"{self.where(call, op)} {ranks_said(dead)} on this machine died (its "
                                           "process ended) while this rank waited for it in the MPI call")
                next_check = now + POLL_S
            if waited > self.timeout_s:
                # MPI names no peer; a group of two ranks has one
                peer = f"rank {1 - self.rank}" if self.world_size == 2 else "a peer"
                raise PeerFailureError(
                    f"{self.where(call, op)} MPI collective did not complete within "
                    f"the process group timeout ({self.timeout_s:g} s); {peer} may be stopped, stuck or "
                    "calling a different collective"
                )

    def _op(self, op: RedOp):
        return getattr(self._MPI, _MPI_OP[op])

    def all_reduce(self, call: Call, tensor: torch.Tensor, op: RedOp) -> None:
        flat = tensor.view(-1)  # the algorithms layer hands transports contiguous tensors
        step = max(1, _ALL_REDUCE_PIECE_BYTES // max(1, flat.element_size()))
        for start in range(0, max(1, flat.numel()), step):
            piece = flat[start : start + step]
            self._run(call, "all_reduce", lambda: self.comm.Iallreduce(self._MPI.IN_PLACE, _buf(piece), self._op(op)))

    def broadcast(self, call: Call, tensor: torch.Tensor, root: int) -> None:
        self._run(call, "broadcast", lambda: self.comm.Ibcast(_buf(tensor), root=root))

    def reduce(self, call: Call, tensor: torch.Tensor, root: int, op: RedOp) -> None:
        buf = _buf(tensor)
        send = self._MPI.IN_PLACE if self.rank == root else buf
        receive = buf if self.rank == root else None
        self._run(call, "reduce", lambda: self.comm.Ireduce(send, receive, self._op(op), root=root))

    # MPI refuses aliased send and receive buffers ("Buffers must not be aliased"), which torch's
    # in-place forms produce: all_gather passes MPI_IN_PLACE, the others send from a copy.
    def all_gather(self, call: Call, output: torch.Tensor, input: torch.Tensor) -> None:
        in_place = _in_place(input, output, self.rank * input.numel())
        send = self._MPI.IN_PLACE if in_place else _buf(_unaliased(input, output))
        self._run(call, "all_gather", lambda: self.comm.Iallgather(send, _buf(output)))

    def reduce_scatter(self, call: Call, output: torch.Tensor, input: torch.Tensor, op: RedOp) -> None:
        send = _buf(_unaliased(input, output))
        self._run(call, "reduce_scatter", lambda: self.comm.Ireduce_scatter_block(send, _buf(output), self._op(op)))

    def all_to_all(self, call: Call, output: torch.Tensor, input: torch.Tensor) -> None:
        self._run(call, "all_to_all", lambda: self.comm.Ialltoall(_buf(_unaliased(input, output)), _buf(output)))

    def all_to_all_v(self, call: Call, output: torch.Tensor, input: torch.Tensor, sends: list[list[int]]) -> None:
        input_splits, output_splits = self.splits(sends)
        send = [_buf(_unaliased(input, output)), (input_splits, block_offsets(input_splits))]
        receive = [_buf(output), (output_splits, block_offsets(output_splits))]
        self._run(call, "all_to_all", lambda: self.comm.Ialltoallv(send, receive))

    def all_gather_v(self, call: Call, output: torch.Tensor, input: torch.Tensor, sizes: list[int]) -> None:
        offsets = block_offsets(sizes)
        send = self._MPI.IN_PLACE if _in_place(input, output, offsets[self.rank]) else _buf(_unaliased(input, output))
        receive = [_buf(output), (list(sizes), offsets)]
        self._run(call, "all_gather", lambda: self.comm.Iallgatherv(send, receive))

    def gather(self, call: Call, output: torch.Tensor | None, input: torch.Tensor, root: int) -> None:
        in_place = self.rank == root and _in_place(input, output, root * input.numel())
        send = self._MPI.IN_PLACE if in_place else _buf(input if output is None else _unaliased(input, output))
        self._run(call, "gather", lambda: self.comm.Igather(send, None if output is None else _buf(output), root=root))

    def scatter(self, call: Call, output: torch.Tensor, input: torch.Tensor | None, root: int) -> None:
        send = None if input is None else _buf(_unaliased(input, output))
        self._run(call, "scatter", lambda: self.comm.Iscatter(send, _buf(output), root=root))

    def barrier(self, call: Call) -> None:
        self._run(call, "barrier", lambda: self.comm.Ibarrier())

    def close(self) -> None:
        if getattr(self, "comm", None) is not None and not self._MPI.Is_finalized():
            self.comm.Free()
        self.comm = None
