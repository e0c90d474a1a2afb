"""The embedded default across hosts: torch's own Gloo engine, driven from inside the backend.

It needs nothing beyond ``pip install torch`` and works wherever ranks can reach each other over
TCP, which is why it is the fallback when ranks do not share a host and no MPI launcher is in use.
"""

from __future__ import annotations

import threading
import time

import torch
import torch.distributed as dist

from .. import numerics, sagemaker_host
from ..call import Call
from ..errors import PeerFailureError, ranks_said
from ..ops import LOW_PRECISION, RedOp
from ..scratch import DEFAULT_MAX_BYTES, Scratch
from .base import Capabilities, Transport, overlap
from .gloo_sockets import GlooSockets
from .local_peers import LocalPeers
from .peer_hosts import PeerHosts
from .refusals import POLL, POLL_S, explained

_TORCH_OP = {
    RedOp.SUM: dist.ReduceOp.SUM,
    RedOp.PRODUCT: dist.ReduceOp.PRODUCT,
    RedOp.MIN: dist.ReduceOp.MIN,
    RedOp.MAX: dist.ReduceOp.MAX,
    RedOp.BAND: dist.ReduceOp.BAND,
    RedOp.BOR: dist.ReduceOp.BOR,
    RedOp.BXOR: dist.ReduceOp.BXOR,
}


_TIMED_OUT = "Timed out waiting"  # gloo's text when a pair's wait reaches the group's timeout
_SLICE_ENDED = "Operation timed out!"  # what c10d's Work.wait(timeout) raises when the bound passes

# Gloo aborts a rank that receives more bytes than it posted (ranks calling collectives of
# different sizes); the peer that sent them may finish its call without an error, and learns in
# its next one only that the connection closed. Nothing reaches this rank to tell the two apart.
_PEER_GONE_HINT = (" (a peer's process ended. If its output shows gloo's \"Received data size doesn't match "
                   "expected size\", ranks called collectives of different sizes: gloo aborted that rank, and "
                   "this rank's earlier result may be wrong. Without SMDDP_CHECK_COLLECTIVES=0 (the check is on by "
                   "default) every rank raises naming each rank's call instead, before any data moves.)")


# How long a rank whose peer's connection closed waits for the group's board to say why. The
# peer may have left because a rank on its own host died, which that host's survivors post
# within a shared-memory check (50 ms) of seeing it; gloo's error names only a socket address.
_NEWS_GRACE_S = 1.0


class _SliceEnded(Exception):
    """A bounded wait for gloo work ended before the work did."""


class GlooTransport(Transport):
    name = "gloo"
    # its reduce_scatter is an all_to_all of the inputs' blocks and a local sum, so 16-bit blocks
    # can cross as they are and be summed (and an AVG divided) in float32: the widened float32
    # blocks it received before gave the same bits in twice the bytes
    capabilities = Capabilities(reduce_scatters_16_bit=frozenset(LOW_PRECISION))

    def __init__(self, store, rank: int, world_size: int, timeout, scratch_max_bytes: int = DEFAULT_MAX_BYTES,
                 **shown) -> None:
        super().__init__(rank, world_size, **shown)
        shown_rank = self.peers_shown[rank] if self.peers_shown else rank
        self._local_peers = LocalPeers(store, shown_rank)
        self._peer_hosts = PeerHosts(store, shown_rank)
        sagemaker_host.use_job_interface_for_gloo()
        self._pg, self._sockets = GlooSockets.opened_while(
            lambda: dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), rank, world_size, timeout), store)
        self._left_running: list = []  # works whose wait raised before gloo finished them
        # every rank published before gloo's rendezvous let this one through
        self._local_peers.learn()
        self._peer_hosts.learn()
        # float32 working buffers of reduce_scatter's reduction (used only inside its finish(),
        # which a group runs one at a time, also when several reduce_scatters are in flight)
        self._scratch = Scratch(scratch_max_bytes)

    def _run(self, call: Call, op: str, work) -> None:
        try:
            while not self._waited_one_slice(call, op, work):
                self.raise_if_told(call, op)  # a peer never entering, or one found lost meanwhile
        except BaseException:
            if not work.is_completed():
                self._left_running.append(work)
            raise
        return None

    def _waited_one_slice(self, call: Call, op: str, work) -> bool:
        """Wait up to one refusal poll for ``work``; True once it is done. Waits that end sooner
        return at once, as an unbounded one would."""
        try:
            self._wait(call, op, work, POLL)
            return True
        except _SliceEnded:
            return False

    def _wait(self, call: Call, op: str, work, timeout) -> None:
        try:
            work.wait() if timeout is None else work.wait(timeout)
        except Exception as exc:
            if timeout is not None and _SLICE_ENDED in str(exc):
                raise _SliceEnded from None
            # a peer that raised for a reason it posted on the group's board (a mismatch it
            # found, a refusal) and then exited closes its connections before this rank's next
            # look there: its reason says more than gloo's "connection closed"
            said = self._news_of_failure(call, peer_left="by peer" in str(exc))
            if said is not None:
                raise explained(said, self.where(call, op)) from exc
            raise PeerFailureError(f"{self.where(call, op)} {self._peer_gone(call, str(exc))}gloo failed: "
                                   f"{exc}{_PEER_GONE_HINT if 'by peer' in str(exc) else ''}") from exc

    def _peer_gone(self, call: Call, error_text: str) -> str:
        """Which rank gloo's error is about, for its message: gloo's own text names the peer only
        by its socket address. A rank on this machine whose process ended is named (gloo may have
        aborted it: the hint says when), and its death told to the group's ranks on other hosts,
        whose own errors show only this host's address; else the ranks on the host whose address
        the error shows."""
        dead = self._local_peers.dead()
        if dead:
            if self.refusals is not None:
                self.refusals.announce_failure(call.index, f"on its host, {ranks_said(dead)} died (its process ended)")
            return f"{ranks_said(dead)} on this machine died (its process ended); "
        if _TIMED_OUT in error_text and self.world_size == 2:  # gloo's timeout names no peer; two ranks have one
            other = 1 - self.rank
            said = (f"rank {self.peers_shown[other] if self.peers_shown else other} did not do its part "
                    f"{self.role + ' ' if self.role else ''}within the process group timeout (it may be stopped, "
                    "stuck, or waiting for another rank)")
            if self.refusals is not None:
                self.refusals.announce_failure(call.index, said)
            return said + "; "
        if "by peer" not in error_text:
            return ""
        named = self._peer_hosts.named_in(error_text)
        if named is None:
            return ""
        ranks, host = named
        return f"{ranks_said(ranks)} on host {host} closed {'its' if len(ranks) == 1 else 'their'} connection; "

    def _news_of_failure(self, call: Call, peer_left: bool) -> str | None:
        """What the group's board says of why this rank's part of ``call`` failed; where a peer
        closed its connection (``peer_left``), looked up for up to _NEWS_GRACE_S unless a rank on
        this machine is seen dead (which names the rank). A timeout is not waited on further."""
        if self.refusals is None:
            return None
        deadline = time.monotonic() + (_NEWS_GRACE_S if peer_left else 0.0)
        while True:
            said = self.refusals.news(call.index)
            if said is not None or time.monotonic() >= deadline:
                return said
            if self._local_peers.dead():
                # a rank on this machine that heard of the failure first may have raised and
                # ended while this one looked: the board, not its end, says what happened
                return self.refusals.news(call.index)
            time.sleep(POLL_S)

    def all_reduce(self, call: Call, tensor: torch.Tensor, op: RedOp) -> None:
        self.all_reduce_async(call, tensor, op)()

    def all_reduce_async(self, call: Call, tensor: torch.Tensor, op: RedOp):
        """Start an all_reduce; returns a function that waits for it (and raises as all_reduce
        would). Gloo runs started collectives on its own threads, matched across ranks by the
        order in which they were started."""
        opts = dist.AllreduceOptions()
        opts.reduceOp = _TORCH_OP[op]
        work = self._pg.allreduce([tensor], opts)
        return lambda: self._run(call, "all_reduce", work)

    def broadcast(self, call: Call, tensor: torch.Tensor, root: int) -> None:
        self.broadcast_async(call, tensor, root)()

    def broadcast_async(self, call: Call, tensor: torch.Tensor, root: int):
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        work = self._pg.broadcast([tensor], opts)
        return lambda: self._run(call, "broadcast", work)

    def reduce(self, call: Call, tensor: torch.Tensor, root: int, op: RedOp) -> None:
        opts = dist.ReduceOptions()
        opts.rootRank, opts.reduceOp = root, _TORCH_OP[op]
        # Gloo uses non-root buffers as scratch; ours promise to leave them as they were.
        self._run(call, "reduce", self._pg.reduce([tensor if self.rank == root else tensor.clone()], opts))

    def all_gather(self, call: Call, output: torch.Tensor, input: torch.Tensor) -> None:
        self.all_gather_async(call, output, input)()

    def all_gather_async(self, call: Call, output: torch.Tensor, input: torch.Tensor):
        work = self._pg._allgather_base(output, input)
        return lambda: self._run(call, "all_gather", work)

    def reduce_scatter(self, call: Call, output: torch.Tensor, input: torch.Tensor, op: RedOp,
                       accumulate: torch.dtype | None = None, mean_of: int | None = None) -> None:
        """An all_to_all of the input's blocks, then this rank's reduction of the blocks it got.

        Gloo's own reduce_scatter (either form) ignores a bounded wait, so a rank waiting in it
        could not hear that a peer refused the call until the group timeout. The all_to_all
        moves what a ring reduce_scatter moves, (n - 1) / n of the input out of each rank, and
        with the local reduction it ran 1.08-3.9x faster than gloo's reduce_scatter on loopback
        (2 and 4 ranks, 64 KiB to 16 MiB: benchmarks/results/2026-11-23-reduce-scatter-gloo-
        transport.md); it needs one input-sized buffer for the blocks.

        ``accumulate``: reduce the received blocks in this dtype and round once into ``output``
        (float32 for 16-bit blocks, which is the default: 16 bits on the network, float32
        arithmetic). ``output`` may then differ from ``input`` in dtype (the hierarchical
        transport's inter-host step). ``mean_of``: how many ranks an AVG averages (default: the
        group's size; more where each rank's blocks hold a sum over several ranks, a host's): its
        sum is divided before that rounding."""
        self.reduce_scatter_async(call, output, input, op, accumulate, mean_of)()

    def reduce_scatter_async(self, call: Call, output: torch.Tensor, input: torch.Tensor, op: RedOp,
                             accumulate: torch.dtype | None = None, mean_of: int | None = None):
        """Start a reduce_scatter; returns the function that waits for its blocks, reduces them
        into ``output`` and raises as reduce_scatter would."""
        if accumulate is None and input.dtype in LOW_PRECISION:
            accumulate = torch.float32
        received = torch.empty_like(input)
        work = self._pg.alltoall_base(received, input, [], [], dist.AllToAllOptions())

        def finish() -> None:
            self._run(call, "reduce_scatter", work)
            blocks = received.view(self.world_size, -1)
            dtype = accumulate or blocks.dtype
            n = blocks.shape[1]
            total = output if output.dtype == dtype else self._scratch.get("total", dtype, n)
            # block by block, in rank order: one widening copy of each 16-bit block into a buffer
            # that stays mapped, then an elementwise op. torch.sum(blocks, 0) over a float32 copy of
            # all blocks takes 15.5 ms for 16 MiB of bfloat16 where this takes 2.5, and a
            # mixed-dtype add makes its own fresh float32 copy (page faults from 32 MiB)
            widen_in = self._scratch.get("block", dtype, n) if blocks.dtype != dtype else None
            numerics.reduce_blocks_(total, blocks, op, mean_of or self.world_size,
                                    into=() if total is output else (output,), widen_in=widen_in)

        return finish

    def all_to_all(self, call: Call, output: torch.Tensor, input: torch.Tensor) -> None:
        self.all_to_all_async(call, output, input)()

    def all_to_all_async(self, call: Call, output: torch.Tensor, input: torch.Tensor):
        work = self._pg.alltoall_base(output, input, [], [], dist.AllToAllOptions())
        return lambda: self._run(call, "all_to_all", work)

    def all_to_all_v(self, call: Call, output: torch.Tensor, input: torch.Tensor, sends: list[list[int]]) -> None:
        input_splits, output_splits = self.splits(sends)
        work = self._pg.alltoall_base(output, input, output_splits, input_splits, dist.AllToAllOptions())
        self._run(call, "all_to_all", work)

    def gather(self, call: Call, output: torch.Tensor | None, input: torch.Tensor, root: int) -> None:
        # gloo's own: only the root receives (the default all_gather sends every rank everything)
        opts = dist.GatherOptions()
        opts.rootRank = root
        outputs = [list(output.view(self.world_size, -1))] if output is not None else []
        self._run(call, "gather", self._pg.gather(outputs, [input], opts))

    def scatter(self, call: Call, output: torch.Tensor, input: torch.Tensor | None, root: int) -> None:
        # gloo's own: each rank receives its block only (the default broadcasts the root's whole input)
        opts = dist.ScatterOptions()
        opts.rootRank = root
        if input is not None and overlap(input, output):  # gloo writes the root's block while it still sends the others
            input = input.clone()
        inputs = [list(input.view(self.world_size, -1))] if input is not None else []
        self._run(call, "scatter", self._pg.scatter([output], inputs, opts))

    def barrier(self, call: Call) -> None:
        self._run(call, "barrier", self._pg.barrier(dist.BarrierOptions()))

    def send_async(self, call: Call, tensor: torch.Tensor, dst: int, tag: int):
        """Start sending ``tensor`` to rank ``dst``, matched by ``tag`` with its recv_async (a
        step of a collective: the hierarchical broadcast's chain); returns its wait."""
        return self._waited_aside(call, "send", self._pg.send([tensor], dst, tag))

    def recv_async(self, call: Call, tensor: torch.Tensor, src: int, tag: int):
        return self._waited_aside(call, "recv", self._pg.recv([tensor], src, tag))

    def _waited_aside(self, call: Call, op: str, work):
        """A wait for gloo send or recv work, which cannot be waited in slices as collectives are:
        gloo fails a pair whose bounded wait ran out ("Timed out waiting 50ms for recv"), and its
        is_completed() stays False until wait() returns. So a thread waits for it unbounded (gloo
        bounds it by the group's timeout), and the wait returned looks for refusals meanwhile."""
        ended, failure = threading.Event(), []

        def wait() -> None:
            try:
                self._wait(call, op, work, None)
            except Exception as exc:  # handed to the caller's wait
                failure.append(exc)
            finally:
                ended.set()

        threading.Thread(target=wait, name=f"smddp-gloo-{op}", daemon=True).start()

        def finish() -> None:
            while not ended.wait(POLL_S):
                try:
                    self.raise_if_told(call, op)
                except BaseException:
                    self._left_running.append(work)
                    raise
            if failure:
                raise failure[0]
        return finish

    def close(self) -> None:
        # a call left running (a survivor's, after a loss) would hold the group's teardown, which
        # joins gloo's worker threads, until the group's timeout; ending its sockets ends it now
        if any(not work.is_completed() for work in self._left_running):
            self._sockets.shut_down()
        self._left_running = []
        self._pg = None
        self._scratch.release()
