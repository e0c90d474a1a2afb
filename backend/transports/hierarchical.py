"""Hierarchical collectives for ranks on several hosts (the Herring / SMDDP scheme).

all_reduce: reduce-scatter inside each host (shared memory), all-reduce of each rank's shard
with the ranks of the same local index on the other hosts (so every host's link carries 1/L of
the data, L ranks per host, and every rank talks), then all-gather inside the host.
reduce_scatter is its first half: reduce-scatter inside the host, then a reduce-scatter with the
same-index ranks. all_gather is its second half in the other order: all-gather with the
same-index ranks, then inside the host, so each host's data crosses each link once. broadcast
shares the root's tensor inside its host, sends 1/L of it from each of that host's ranks to
their same-index peers, and all-gathers the parts inside each other host. barrier meets inside
the hosts, then among their first ranks, then inside the hosts again. Everything else, and
broadcasts and sums that would be rounded between hosts (16-bit, or with a wire dtype) below
``hierarchical_min_bytes``, take gloo over all ranks.

An all_reduce larger than ``hierarchical_chunk_bytes`` is pipelined over pieces: each piece is
reduced inside the host and its inter-host step started at once (gloo runs started collectives
on its own threads, matched across ranks by start order), and each piece is gathered inside the
host as soon as its inter-host step ends. The network then stays busy from the first piece's
reduce-scatter to the last piece's all-gather, and the host-local copying of the other pieces
happens while it works. Measured on 2 simulated hosts x 2 ranks at 1 Gbit/s (bfloat16 wire,
DDP on a 21 MB model): 172 ms per step with one inter-host step at a time, 156 ms with several in flight,
182 ms without pieces. A reduce_scatter is pipelined the same way, over pieces of every rank's
block (a bfloat16 one of 16 MiB: 115 ms in one piece, 71 ms in four), and an all_gather over
pieces of every rank's input (32 MiB: 231 ms in one piece, 141 ms in eight).

Between hosts, a floating-point SUM can travel as bfloat16/float16: the shard is exchanged in
the wire dtype with an all-to-all, each rank sums its slice in float32, and the sums travel
back in the wire dtype (between two hosts gloo's ring does the same in one addition; with
``inter_node_accumulate="wire"`` it also serves more hosts, rounding on every hop, with one flow
per link and less CPU work than the all-to-all). A 16-bit input (the
compiled step's wire dtype) takes that path in its own dtype, so gradients stay 16-bit on the
network and are still accumulated in float32. The sums come back from the network already
rounded to the wire dtype, so the all-gather inside the host moves them in that dtype too (half
the bytes through shared memory, the same bits) and widens them once, into the caller's tensor.
A bfloat16 AVG (FSDP2's HSDP replicas) takes the all-to-all even between two hosts: the rank
that sums a slice in float32 divides it there, before its one rounding, which gloo's ring cannot
do; widened to float32 instead, it sent twice the bytes (2 x 2 hosts at 1 Gbit/s: 2.0x faster
from 1 MiB, benchmarks/results/2026-11-23-hierarchical-bf16-avg-all-reduce.md). A float16 AVG
does the same with each host's mean in place of its sum, as a float16 host sum can overflow where
the mean cannot (widened to float32 instead, it too sent twice the bytes, and with a bfloat16
wire dtype it crossed in bfloat16, with 3 mantissa bits fewer than its own dtype).
A reduce_scatter's step between hosts (ZeRO's and FSDP's gradients) is an all-to-all of the
host-reduced blocks with the sum taken where they arrive, so 16-bit blocks cross as they are and
are summed in float32, and with a wire dtype set a float32 SUM crosses in it, as above.
"""

from __future__ import annotations

import functools
import logging
import math
from typing import Any, Callable

import torch
import torch.distributed as dist

from smddp_lite.config import QUANTIZED_WIRE_DTYPES

from .. import numerics
from ..call import Call
from ..ops import LOW_PRECISION, RedOp
from ..scratch import Scratch
from .base import Capabilities, Transport
from .gloo import GlooTransport
from .refusals import RefusalBoard

log = logging.getLogger("smddp_lite")
QUANTIZED_WIRES = tuple(getattr(torch, name) for name in QUANTIZED_WIRE_DTYPES)


def _shown_to_host(op: Callable) -> Callable:
    """A collective that first shows this rank's host-mates which call it is in (Transport.entering):
    a host-mate that times out waiting for it while it waits between hosts then knows it is not
    the rank at fault, and looks for what the ranks between hosts found."""

    @functools.wraps(op)
    def entered(self, call: Call, *args, **kwargs):
        self.intra.entering(call)
        return op(self, call, *args, **kwargs)

    return entered


class Topology:
    """Which global ranks share a host: ``local[k]`` lists host k's ranks, lowest first."""

    def __init__(self, hosts: list[str]) -> None:
        names = list(dict.fromkeys(hosts))  # hosts in order of their first rank
        self.local = [[r for r, h in enumerate(hosts) if h == name] for name in names]
        self.names = names
        self.node_of = {r: k for k, ranks in enumerate(self.local) for r in ranks}

    @property
    def uniform(self) -> bool:
        return len({len(ranks) for ranks in self.local}) == 1

    def describe(self) -> str:
        return f"{len(self.local)} hosts x {len(self.local[0])} ranks" if self.uniform else \
            f"{len(self.local)} hosts with {[len(r) for r in self.local]} ranks"


class HierarchicalTransport(Transport):
    name = "hierarchical"
    # shm sums 16-bit in float32; so does the inter-host step. A 16-bit AVG crosses hosts in its
    # own dtype: its last step sums in float32, so it can divide there before its one rounding
    # (_start_compressed_sum, and gloo's reduce_scatter). A float16 host sum can overflow where
    # the mean cannot, so float16 averages inside the host first (_averaged_in_host); bfloat16
    # has float32's range and sends its host sums, as a SUM does.
    capabilities = Capabilities(accumulates_low_precision=True, reduce_scatters_16_bit=frozenset(LOW_PRECISION),
                                all_reduces_16_bit_avg=frozenset(LOW_PRECISION))

    def __init__(self, store, rank: int, world_size: int, topology: Topology, intra_factory, timeout, config) -> None:
        # A refusal of one of this group's calls is posted under the group's call index, and every
        # part looks for it there, so a rank waiting in any of them hears of it: a peer on another
        # host refusing the call (in gloo), or a peer on this host waiting in shared memory for a
        # rank that raised when it heard of a refusal. Failures are heard too: a rank that finds a
        # peer on its host dead says so there (ShmSegment.announce): ranks on other hosts would see
        # only their exchange with this host stall, until the group's timeout, naming no rank.
        super().__init__(rank, world_size, refusals=RefusalBoard(store, rank, world_size, timeout,
                                                                 hears_failures=True))
        self.topo = topology
        self.node = topology.node_of[rank]
        self.local_rank = topology.local[self.node].index(rank)
        self.nodes, self.per_node = len(topology.local), len(topology.local[0])
        self.min_bytes = config.hierarchical_min_bytes
        self.chunk_bytes = config.hierarchical_chunk_bytes
        self.always = config.algorithm == "hierarchical"
        self.wire = getattr(torch, config.inter_node_wire_dtype) if config.inter_node_wire_dtype else None
        self.wire_block = config.inter_node_wire_block  # elements per scale of an 8-bit wire
        self.exact_16bit_sums = config.inter_node_accumulate == "float32"
        self.debug = config.debug
        # the parts' errors name the rank the user knows, not the part's, and shm's messages name
        # peers (gloo's name none)
        shown = dict(refusals=self.refusals, shown_as=(rank, world_size))
        self.intra = intra_factory(dist.PrefixStore(f"intra{self.node}", store), self.local_rank, self.per_node,
                                   role="within the host", peers_shown=topology.local[self.node], **shown)
        self.inter = GlooTransport(dist.PrefixStore(f"inter{self.local_rank}", store), self.node, self.nodes, timeout,
                                   config.scratch_max_bytes, role="between hosts",
                                   peers_shown=[topology.local[k][self.local_rank] for k in range(self.nodes)], **shown)
        self.flat = GlooTransport(dist.PrefixStore("flat", store), rank, world_size, timeout, config.scratch_max_bytes,
                                  **shown)
        # (L, N): for each local index j, the ranks with that index, host by host; the order in
        # which the inter-host groups' blocks sit after the step inside the host
        self.by_local_index = [topology.local[k][j] for j in range(self.per_node) for k in range(self.nodes)]
        self._grid_strides = _grid_strides(self.by_local_index, self.per_node, self.nodes)
        self._logged: set[tuple[str, bool, bool]] = set()
        # the pieces' working buffers, kept from call to call (backend/scratch.py says why): each
        # piece's own where they stay in flight while later pieces start (_piece_buffer), one for
        # all pieces where a piece's follow-up consumes them before the next piece's finish runs.
        # Calls run one at a time and end every piece before they return, so no call meets another's.
        self._scratch = Scratch(config.scratch_max_bytes)

    def _hierarchical(self, op: str, nbytes: int, sums: torch.dtype | None = None) -> bool:
        """Whether a call takes the hierarchical path (else gloo over all ranks).
        Under "auto" every size does, as it crosses hosts in fewer steps: 1.4-2.2x faster
        all_reduces and 1.0-1.9x faster all_gathers than the flat ring from 256 B to 256 KiB on
        2 x 2, 4 x 2 and 2 x 4 simulated hosts (benchmarks/results/2026-11-25-small-messages-
        hierarchical.md). Except, below ``min_bytes``:
        - sums (``sums``: the dtype reduced) that would be rounded between hosts, 16-bit inputs or
          float sums with a wire dtype: those go flat, summed in float32 and rounded once, so a
          loss or a count all-reduced for logging is not rounded on its way, where saving
          bandwidth would save nothing;
        - broadcasts: a small one waits on latency, not bytes, and the hierarchical path's two
          steps in shared memory cost more than the bytes it saves (up to 64 KiB on 2 x 2 and
          4 x 2 simulated hosts, benchmarks/results/2026-11-25-hierarchical-broadcast.md)."""
        rounds = sums is not None and (sums in LOW_PRECISION or (
            self.wire is not None and sums.is_floating_point and sums != torch.float64))
        small_flat = rounds or op == "broadcast"
        use = self.always or nbytes >= self.min_bytes or not small_flat
        if self.debug and self.rank == 0 and (op, use, small_flat) not in self._logged:
            self._logged.add((op, use, small_flat))
            why = "every size" if not small_flat else \
                f"{'sums rounded between hosts' if rounds else 'broadcasts'} go flat below {self.min_bytes} bytes"
            log.info("smddp: %s of %d bytes runs %s (%s, %s)", op, nbytes, "hierarchical" if use else "flat",
                     self.topo.describe(), "forced" if self.always else why)
        return use

    # all_reduce ---------------------------------------------------------------------------------
    @_shown_to_host
    def all_reduce(self, call: Call, tensor: torch.Tensor, op: RedOp) -> None:
        if not self._hierarchical("all_reduce", tensor.numel() * tensor.element_size(), tensor.dtype):
            return self._flat_all_reduce(call, tensor, op)
        # AVG (16-bit only: all_reduces_16_bit_avg) is a SUM whose step between hosts divides in
        # float32 before its rounding; each host's sum (float16: mean) is rounded once on the way
        in_host, op, mean_of = self._averaged_in_host(op, tensor.dtype)
        n, L = tensor.numel(), self.per_node
        piece = max(L, self.chunk_bytes // tensor.element_size() // L * L)  # whole shards per piece
        started = []
        for index, start in enumerate(range(0, n, piece)):
            part = tensor[start : start + piece]
            padded, shard = self._reduce_in_host(call, part, in_host, index)
            started.append((self._start_inter_all_reduce(call, shard, op, mean_of, index),
                            lambda total, part=part, padded=padded: self._gather_in_host(call, part, padded, total)))
        _end_in_start_order(started)

    def _piece_buffer(self, use: str, index: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """A working buffer of piece ``index`` of an all_reduce, reduce_scatter or all_gather that
        stays in use while later pieces start: one per piece, kept from call to call. A piece is
        at most hierarchical_chunk_bytes of the message, and so is each of its buffers (give or
        take the padding to whole shards and blocks): the pieces' buffers of one use are kept
        while they fit in scratch_max_bytes together, and the pieces past that get fresh ones.
        Fresh ones cost page faults: a DDP bucket of 2.6M float32 sums between 2 hosts on an int8
        wire took 17 ms of CPU in fresh buffers and 9 ms in kept ones (one rank, 6 pieces)."""
        if (index + 1) * self.chunk_bytes > self._scratch.max_bytes:
            return torch.empty(numel, dtype=dtype)
        return self._scratch.get(f"{use} {index}", dtype, numel)

    def _averaged_in_host(self, op: RedOp, dtype: torch.dtype) -> tuple[RedOp, RedOp, int | None]:
        """(the op inside the host, the op between hosts, how many ranks the AVG between hosts
        averages: its last float32 sum is divided by it before its rounding) for ``op`` on ``dtype``.

        An AVG is a SUM divided at the end, except in float16: a host's sum of float16 values can
        exceed float16's largest value (65504) where their mean cannot, and it is rounded to
        float16 before it crosses. So each host averages its ranks (shared memory sums in float32
        and divides before rounding), and the hosts' means are averaged between hosts. Hosts hold
        equal numbers of ranks here (Topology.uniform), so that is the mean over all ranks."""
        if op is not RedOp.AVG:
            return op, op, None
        if dtype is torch.float16:
            return RedOp.AVG, RedOp.AVG, self.nodes  # the hosts' means
        return RedOp.SUM, RedOp.AVG, self.world_size  # the hosts' sums

    def _reduce_in_host(self, call: Call, tensor: torch.Tensor, op: RedOp,
                        index: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(``tensor`` padded to L equal shards, this rank's shard summed over its host), both
        kept for piece ``index`` until its all-gather inside the host."""
        n, L = tensor.numel(), self.per_node
        s = math.ceil(n / L)
        padded = tensor
        if n != s * L:  # zeros past the end: they are summed, and quantized beside the values
            padded = self._piece_buffer("padded", index, tensor.dtype, s * L)
            padded[:n].copy_(tensor)
            padded[n:].zero_()
        shard = self._piece_buffer("shard", index, tensor.dtype, s)
        self.intra.reduce_scatter(call, shard, padded, op)
        return padded, shard

    def _gather_in_host(self, call: Call, tensor: torch.Tensor, padded: torch.Tensor, total: torch.Tensor) -> None:
        """All-gather each local rank's ``total`` (its shard's sum over all hosts) into ``tensor``;
        a ``total`` in a 16-bit wire dtype is gathered as it is and widened once at the end. The
        gathered wire values are consumed here, before the next piece's: one buffer serves all."""
        if total.dtype != padded.dtype:
            padded = self._scratch.get("gathered", total.dtype, padded.numel())
        self.intra.all_gather(call, padded, total)
        if padded is not tensor:
            tensor.copy_(padded[: tensor.numel()])

    def _start_inter_all_reduce(self, call: Call, shard: torch.Tensor, op: RedOp,
                                mean_of: int | None = None, index: int = 0) -> Callable[[], torch.Tensor]:
        """Start reducing ``shard`` with the same-index ranks of the other hosts; returns the
        function that waits and returns the result: ``shard`` itself, or the sums as they came
        off a 16-bit wire (every local rank's in the same dtype, since all see the same config).
        An AVG (16-bit, of ``mean_of`` ranks): the float32 sums are divided before rounding.
        ``index``: the piece of the all_reduce, whose buffers stay in flight beside the others'.
        What the function returns is consumed (gathered inside the host) before the next piece's
        function runs, so the buffers it is made in may serve every piece."""
        floating = shard.dtype.is_floating_point
        wire = self.wire if shard.dtype not in LOW_PRECISION else shard.dtype
        if op is RedOp.AVG:
            # gloo's ring would round the sum before the division could happen; the exchange of
            # _start_compressed_sum sums in float32 on one rank per slice, which can divide first
            return self._start_compressed_sum(call, shard, shard.dtype, op, mean_of, index)
        if op is RedOp.SUM and shard.dtype == torch.float32 and wire in QUANTIZED_WIRES:
            return self._start_quantized_sum(call, shard, wire, index)
        if op is RedOp.SUM and floating and wire is not None and shard.dtype != torch.float64:
            if self.nodes > 2 and self.exact_16bit_sums:
                return self._start_compressed_sum(call, shard, wire, index=index)
            # two hosts: one addition per element, which gloo's own ring rounds to the wire dtype
            # once, exactly as a float32 sum rounded at the end; and its ring pipelines sending
            # with adding, where the all-to-all + all-gather of _start_compressed_sum run as two
            # exposed phases (2 simulated hosts x 2 ranks, 1 Gbit/s: 16 MiB in 96 ms against 125 ms).
            # More hosts with inter_node_accumulate="wire": the same ring, rounding on every hop.
            on_wire = shard if shard.dtype == wire else \
                self._piece_buffer("on wire", index, wire, shard.numel()).copy_(shard)
        elif shard.dtype in LOW_PRECISION:  # gloo alone would sum 16-bit floats in 16 bits at every hop
            on_wire = self._piece_buffer("widened", index, torch.float32, shard.numel()).copy_(shard)
        else:
            on_wire = shard
        wait = self.inter.all_reduce_async(call, on_wire, op)

        def finish() -> torch.Tensor:
            wait()
            if on_wire.dtype == wire:  # rounded to the wire dtype: gather it as it is
                return on_wire
            if on_wire is not shard:  # widened for gloo: back to the caller's dtype
                shard.copy_(on_wire)
            return shard

        return finish

    def _start_quantized_sum(self, call: Call, shard: torch.Tensor, wire: torch.dtype,
                             index: int = 0) -> Callable[[], torch.Tensor]:
        """Sum float32 ``shard`` across hosts with 8-bit values on the network: as
        _start_compressed_sum, but each slice travels blockwise quantized (kernels/quantize.py),
        its float32 scales beside it. Each host's values are quantized once, summed in float32
        where they land, and the sums come back quantized once: two roundings, whatever the
        number of hosts, where a ring would round on every hop.

        The values and scales sent and received stay in flight until this piece's finish, and
        are the piece's own (``index``); the sums, their quantized values and what they
        dequantize to are made in the finish and consumed before the next piece's, in buffers
        every piece shares."""
        from smddp_lite.kernels.quantize import blocks_of, dequantize_add, quantize

        N, s, block = self.nodes, shard.numel(), self.wire_block
        sub = blocks_of(blocks_of(s, N), block) * block  # each host's slice: whole blocks
        per_slice = sub // block
        if self.debug and ("quantized", s) not in self._logged:
            self._logged.add(("quantized", s))
            # each rank sends N - 1 slices of values and scales in the all-to-all, and its own
            # slice's sums to N - 1 hosts in the all-gather
            sent = 2 * (N - 1) * (sub * wire.itemsize + per_slice * 4)
            log.info("smddp: rank %d sends %d float32 sums to %d other hosts as %s in blocks of %d, %d bytes "
                     "per call (float32: %d)", self.rank, s, N - 1, str(wire).replace("torch.", ""), block, sent,
                     2 * (N - 1) * blocks_of(s, N) * 4)
        # the slices are whole blocks, so the blocks of ``shard`` are those of ``shard`` padded with
        # zeros to N slices: quantized where it lies, the padding is zero values and zero scales
        values = self._piece_buffer("quantized values", index, torch.uint8, N * sub)
        scales = self._piece_buffer("quantized scales", index, torch.float32, N * per_slice)
        filled = blocks_of(s, block)
        quantize(shard, wire, block, out=(values[:s].view(wire), scales[:filled]))
        values[s:].zero_()  # 0 in every 8-bit format
        scales[filled:].zero_()
        got_values = self._piece_buffer("received values", index, torch.uint8, N * sub)
        got_scales = self._piece_buffer("received scales", index, torch.float32, N * per_slice)
        moved = [self.inter.all_to_all_async(call, got_values, values),
                 self.inter.all_to_all_async(call, got_scales, scales)]  # block q: host q's part of my slice

        def finish() -> torch.Tensor:
            _wait_for_all(moved)  # both, also after a failure: the buffers are this piece's until then
            got = got_values.view(wire)
            total = self._scratch.get("quantized total", torch.float32, sub).zero_()
            for q in range(N):  # in host order, as every rank's slice is: the same bits everywhere
                dequantize_add(total, got[q * sub : (q + 1) * sub], got_scales[q * per_slice : (q + 1) * per_slice],
                               block)
            mine = self._scratch.get("quantized sums", torch.uint8, sub)
            my_scales = self._scratch.get("quantized sum scales", torch.float32, per_slice)
            quantize(total, wire, block, out=(mine.view(wire), my_scales))
            self.inter.all_gather(call, values, mine)  # the all-to-all is over: its buffers are free
            self.inter.all_gather(call, scales, my_scales)
            # only the first s sums are the caller's: the rest is the padding's
            summed = self._scratch.get("quantized summed", torch.float32, s).zero_()
            dequantize_add(summed, values[:s].view(wire), scales[:filled], block)
            return summed

        return finish

    def _start_compressed_sum(self, call: Call, shard: torch.Tensor, wire: torch.dtype, op: RedOp = RedOp.SUM,
                              mean_of: int | None = None, index: int = 0) -> Callable[[], torch.Tensor]:
        """Sum ``shard`` across hosts with ``wire`` on the network and float32 arithmetic: an
        all-to-all of wire-dtype slices (started now), then each host sums one slice (and
        divides it, for an AVG of ``mean_of`` ranks) and the results are all-gathered (when
        finished). The slices sent and received are piece ``index``'s own; the sum, made in the
        finish, is in a buffer every piece shares."""
        N, s = self.nodes, shard.numel()
        sub = math.ceil(s / N)
        if N * sub == s and shard.dtype == wire:
            send = shard
        else:
            send = self._piece_buffer("compressed send", index, wire, N * sub)
            send[:s].copy_(shard)
            send[s:].zero_()
        slices = self._piece_buffer("compressed slices", index, wire, N * sub)
        exchanged = self.inter.all_to_all_async(call, slices, send)  # block q: host q's values of my slice

        def finish() -> torch.Tensor:
            exchanged()
            # each slice is summed by one host only, in host order
            total = numerics.reduce_blocks_(self._scratch.get("compressed total", torch.float32, sub),
                                            slices.view(N, sub), op, mean_of)
            on_wire = self._scratch.get("compressed sum", wire, sub).copy_(total)
            gathered = slices  # consumed above: reuse it for the sums
            self.inter.all_gather(call, gathered, on_wire)
            return gathered[:s]

        return finish

    def _flat_all_reduce(self, call: Call, tensor: torch.Tensor, op: RedOp) -> None:
        if tensor.dtype in LOW_PRECISION:  # widened, as in _start_inter_all_reduce
            wide = tensor.float()
            self.flat.all_reduce(call, wide, numerics.across_ranks(op))
            numerics.finish_(wide, op, self.world_size, into=tensor)
        else:
            self.flat.all_reduce(call, tensor, op)

    # all_gather / reduce_scatter -----------------------------------------------------------------
    @_shown_to_host
    def all_gather(self, call: Call, output: torch.Tensor, input: torch.Tensor) -> None:
        if not self._hierarchical("all_gather", output.numel() * output.element_size()):
            return self.flat.all_gather(call, output, input)
        m, N = input.numel(), self.nodes
        # Between hosts first: each rank gathers the inputs of the ranks with its local index, one
        # per host, so each host's link carries every other host's data once. (Gathering the
        # host's L inputs first and exchanging those sends them L times, once per local index:
        # 2 simulated hosts x 2 ranks at 1 Gbit/s ran at 0.54-0.75x torch gloo's ring that way.)
        # Pieces of hierarchical_chunk_bytes of the output, the same columns of every rank's
        # input: all exchanges start at once, on gloo's threads, and each piece is gathered
        # inside the host and put in rank order while the later ones cross.
        rows = output.view(self.world_size, m)
        started = []
        for index, columns in enumerate(self._pieces(m, input.element_size())):
            across = self._piece_buffer("across", index, input.dtype, N * (columns.stop - columns.start))  # (N, width)
            started.append((self.inter.all_gather_async(call, across, input[columns]),
                            lambda _, columns=columns, across=across:
                            self._gather_in_host_in_rank_order(call, rows[:, columns], across)))
        _end_in_start_order(started)

    def _pieces(self, m: int, element_size: int) -> list[slice]:
        """The column ranges of a reduce_scatter's or all_gather's pieces: the same columns of
        each of the world_size blocks of m elements, hierarchical_chunk_bytes in all."""
        width = max(1, self.chunk_bytes // element_size // self.world_size)
        return [slice(start, min(m, start + width)) for start in range(0, m, width)]

    def _gather_in_host_in_rank_order(self, call: Call, rows: torch.Tensor, across: torch.Tensor) -> None:
        """Gather every local rank's ``across`` (its same-index peers' values, host by host) and
        put them into ``rows`` (world_size, width), one row per rank."""
        width = rows.shape[1]
        if self.per_node == 1:  # nothing to gather: across holds a row for every rank already
            self._put_in_rank_order(rows, across.view(self.nodes, width))
            return
        grid = self._local_index_view(rows)
        if grid is not None:  # the host's all_gather writes each row where it belongs
            self.intra.all_gather(call, grid, across.view(self.nodes, width))
            return
        # (L, N, width), consumed here before the next piece's: one buffer serves all
        gathered = self._scratch.get("gathered rows", across.dtype, self.world_size * width)
        self.intra.all_gather(call, gathered, across)
        self._put_in_rank_order(rows, gathered.view(self.world_size, width))

    def _local_index_view(self, rows: torch.Tensor) -> torch.Tensor | None:
        """``rows`` (world_size, width) as an (L, N, width) view in by_local_index order, where
        the ranks' layout on the hosts is regular (consecutive or interleaved ranks) and the part
        inside the host takes such views; else None."""
        if self._grid_strides is None or not self.intra.capabilities.takes_block_views:
            return None
        first, along_local, along_hosts = self._grid_strides
        row, column = rows.stride()
        return rows.as_strided((self.per_node, self.nodes, rows.shape[1]), (along_local * row, along_hosts * row, column),
                               rows.storage_offset() + first * row)

    def _put_in_rank_order(self, rows: torch.Tensor, grouped: torch.Tensor) -> None:
        # one copy per row: an indexed assignment of the rows took 3x as long
        for position, rank in zip(range(grouped.shape[0]), self.by_local_index):
            rows[rank].copy_(grouped[position])

    @_shown_to_host
    def reduce_scatter(self, call: Call, output: torch.Tensor, input: torch.Tensor, op: RedOp) -> None:
        # AVG (16-bit only: reduce_scatters_16_bit) is a SUM whose last, float32 step divides
        # before rounding; each host's sum (float16: mean) is rounded once on the way, as in a SUM
        if not self._hierarchical("reduce_scatter", input.numel() * input.element_size(), input.dtype):
            return self.flat.reduce_scatter(call, output, input, op, accumulate=_float32_for_16_bit(input))
        in_host, op, mean_of = self._averaged_in_host(op, input.dtype)
        m, N = output.numel(), self.nodes
        blocks = input.view(self.world_size, m)
        # Pieces of every block, as the all_reduce's: each piece's exchange between hosts runs on
        # gloo's threads while this rank reduces the next piece inside the host. A piece is
        # hierarchical_chunk_bytes of the input: columns [start, start + width) of every block.
        started = []
        for index, columns in enumerate(self._pieces(m, input.element_size())):
            width = columns.stop - columns.start
            host_sums = self._piece_buffer("host sums", index, input.dtype, N * width)
            grouped = self._local_index_view(blocks[:, columns])  # the piece, in (L, N) order
            if grouped is not None:
                self.intra.reduce_scatter(call, host_sums.view(N, width), grouped, in_host)
            else:
                # read by the reduction inside the host before it returns: one buffer serves all pieces
                grouped = self._scratch.get("grouped", input.dtype, self.world_size * width)
                grouped = grouped.view(self.world_size, width)
                for position, rank in enumerate(self.by_local_index):
                    grouped[position].copy_(blocks[rank, columns])
                self.intra.reduce_scatter(call, host_sums, grouped.view(-1), in_host)
            # host_sums: my index's blocks, summed over my host
            sent = self._reduce_scatter_wire(host_sums, op, index)
            started.append((self.inter.reduce_scatter_async(call, output[columns], sent, op, mean_of=mean_of,
                                                            accumulate=_float32_for_16_bit(sent)), None))
        _end_in_start_order(started)

    def _reduce_scatter_wire(self, host_sums: torch.Tensor, op: RedOp, index: int = 0) -> torch.Tensor:
        """What this rank sends between hosts in a reduce_scatter; the receiving rank reduces
        16-bit blocks in float32. A 16-bit input travels as it is (half the bytes of widening it
        first, and the same result: every 16-bit value is exact in float32). A float32 SUM
        travels in ``SMDDP_INTER_NODE_WIRE_DTYPE`` when that is set: each host's sum rounded once,
        as in the all_reduce's inter-host step."""
        if host_sums.dtype is torch.float32 and op is RedOp.SUM and self.wire in LOW_PRECISION:
            return self._piece_buffer("reduce-scatter wire", index, self.wire, host_sums.numel()).copy_(host_sums)
        return host_sums

    # broadcast -----------------------------------------------------------------------------------
    @_shown_to_host
    def broadcast(self, call: Call, tensor: torch.Tensor, root: int) -> None:
        """The root's host shares the tensor in shared memory, then each of its L ranks sends its
        1/L of it to the ranks of its local index on the other hosts, and each other host
        all-gathers the L parts. gloo's own broadcast (a binomial tree over ranks, blind to
        hosts) sends it once per rank on the other hosts in its later rounds: L times over the
        root host's link. Pieces of hierarchical_chunk_bytes, all started at once, keep the link
        busy while earlier pieces are gathered.

        Between hosts the parts go down gloo's tree over hosts, or, where that is slower, a chain
        (``_chains``): the tree's root host sends each piece once per round (log2 N rounds), the
        chain's hosts each send it once, a host forwarding a piece as soon as it has it."""
        if not self._hierarchical("broadcast", tensor.numel() * tensor.element_size()):
            return self.flat.broadcast(call, tensor, root)
        root_node, L = self.topo.node_of[root], self.per_node
        sends = self.node == root_node
        piece = max(L, self.chunk_bytes // tensor.element_size() // L * L)  # whole parts per piece
        pieces = math.ceil(tensor.numel() / piece)
        chain = self._chains(pieces)
        logged = ("broadcast between hosts", chain, False)
        if self.debug and self.rank == 0 and self.nodes > 2 and logged not in self._logged:
            self._logged.add(logged)
            log.info("smddp: broadcast of %d bytes in %d piece%s crosses %d hosts in %s",
                     tensor.numel() * tensor.element_size(), pieces, "s" if pieces != 1 else "", self.nodes,
                     "a chain" if chain else "gloo's tree (fewer steps)")
        started, forwarded = [], []
        for index, start in enumerate(range(0, tensor.numel(), piece)):
            chunk = tensor[start : start + piece]
            size = math.ceil(chunk.numel() / L)  # each local rank's part; the last may be short or empty
            mine = chunk[self.local_rank * size : (self.local_rank + 1) * size]
            if sends and L > 1:
                self.intra.broadcast(call, chunk, self.topo.local[root_node].index(root))
            if sends or L == 1:  # sent from, or received straight into, the caller's tensor
                part, then = mine, None
            else:
                part = torch.empty(size, dtype=tensor.dtype)
                then = lambda _, chunk=chunk, part=part, size=size: self._gather_parts(call, chunk, part, size)
            # a part is empty on every host alike (same numel), so skipping it keeps gloo's order
            if not mine.numel():
                wait = lambda: None
            elif chain:
                wait = self._chain_link(call, part[: mine.numel()], root_node, index, forwarded)
            else:
                wait = self.inter.broadcast_async(call, part[: mine.numel()], root_node)
            started.append((wait, then))
        try:
            _end_in_start_order(started)
        finally:  # every send started ends, also after a failure (a raise here keeps the first)
            _end_in_start_order([(forward, None) for forward in forwarded])

    def _chains(self, pieces: int) -> bool:
        """Whether a broadcast of ``pieces`` pieces crosses hosts faster in a chain than in
        gloo's binomial tree, counting link times of one piece: the tree's root host sends every
        piece once in each of its ceil(log2 N) rounds; the chain's last host has every piece
        after pieces + N - 2 (it fills the chain's N - 1 links, then one piece follows another).
        Between two hosts both are one send; on 4 hosts a chain wins from 3 pieces."""
        return self.nodes > 2 and pieces + self.nodes - 2 < pieces * math.ceil(math.log2(self.nodes))

    def _chain_link(self, call: Call, part: torch.Tensor, root_node: int, index: int, forwarded: list) -> Callable[[], None]:
        """Start this host's link of the chain that carries piece ``index``'s ``part`` from the
        root's host through the others in host order; returns its wait. The root's host sends; a
        host in the middle receives, and in that wait starts sending it on (its wait goes to
        ``forwarded``); the last host receives."""
        N = self.nodes
        after, before = (self.node + 1) % N, (self.node - 1) % N
        if self.node == root_node:
            return self.inter.send_async(call, part, after, index)
        received = self.inter.recv_async(call, part, before, index)
        if after == root_node:
            return received

        def wait() -> None:
            received()
            forwarded.append(self.inter.send_async(call, part, after, index))
        return wait

    def _gather_parts(self, call: Call, chunk: torch.Tensor, part: torch.Tensor, size: int) -> None:
        """All-gather the L local ranks' parts (``size`` elements each, the last ones possibly
        padding) of ``chunk`` inside the host."""
        whole = chunk if chunk.numel() == size * self.per_node else torch.empty(size * self.per_node, dtype=chunk.dtype)
        self.intra.all_gather(call, whole, part)
        if whole is not chunk:
            chunk.copy_(whole[: chunk.numel()])

    # barrier -------------------------------------------------------------------------------------
    @_shown_to_host
    def barrier(self, call: Call) -> None:
        """Inside the host, then between hosts among each host's first rank, then inside the host
        again: once the first ranks have met, every rank of every host has entered, and the second
        step inside the host holds the others until then. gloo's barrier over all N L ranks
        exchanges messages among all of them across the hosts' links."""
        if not self._hierarchical("barrier", 0):
            return self.flat.barrier(call, )
        self.intra.barrier(call, )
        if self.local_rank == 0:
            self.inter.barrier(call, )
        self.intra.barrier(call, )

    # the rest is flat ----------------------------------------------------------------------------

    @_shown_to_host
    def reduce(self, call: Call, tensor: torch.Tensor, root: int, op: RedOp) -> None:
        if tensor.dtype in LOW_PRECISION:
            wide = tensor.float()
            self.flat.reduce(call, wide, root, op)
            if self.rank == root:
                tensor.copy_(wide)
        else:
            self.flat.reduce(call, tensor, root, op)

    @_shown_to_host
    def all_to_all(self, call: Call, output: torch.Tensor, input: torch.Tensor) -> None:
        self.flat.all_to_all(call, output, input)

    @_shown_to_host
    def all_to_all_v(self, call: Call, output: torch.Tensor, input: torch.Tensor, sends: list[list[int]]) -> None:
        self.flat.all_to_all_v(call, output, input, sends)

    # gloo's own gather and scatter: only the root receives, or each rank its block
    @_shown_to_host
    def gather(self, call: Call, output: torch.Tensor | None, input: torch.Tensor, root: int) -> None:
        self.flat.gather(call, output, input, root)

    @_shown_to_host
    def scatter(self, call: Call, output: torch.Tensor, input: torch.Tensor | None, root: int) -> None:
        self.flat.scatter(call, output, input, root)

    def interrupt(self, reason: str) -> None:
        super().interrupt(reason)
        for t in (self.intra, self.inter, self.flat):
            t.interrupt(reason)

    def peer_left(self) -> str | None:
        return self.intra.peer_left() if self.intra is not None else None

    def close(self) -> None:
        for t in (self.intra, self.inter, self.flat):
            t.close()
        self._scratch.release()


def _grid_strides(by_local_index: list[int], per_node: int, nodes: int) -> tuple[int, int, int] | None:
    """(first, along_local, along_hosts) such that the rank at local index j on host k is
    first + j * along_local + k * along_hosts, for each (j, k) of ``by_local_index`` (the
    layouts launchers make: consecutive ranks per host, or ranks dealt round-robin); None when
    no such numbers fit."""
    first = by_local_index[0]
    along_local = by_local_index[nodes] - first if per_node > 1 else 0
    along_hosts = by_local_index[1] - first if nodes > 1 else 0
    fits = all(by_local_index[j * nodes + k] == first + j * along_local + k * along_hosts
               for j in range(per_node) for k in range(nodes))
    return (first, along_local, along_hosts) if fits and along_local >= 0 and along_hosts >= 0 else None


def _end_in_start_order(started: list[tuple[Callable[[], Any], Callable[[Any], None] | None]]) -> None:
    """Wait for inter-host steps in the order they were started (gloo matches them across ranks
    by that order), handing each one's result to its follow-up (a step inside the host) while
    none has failed. After a failure the later steps are still waited for, so that every step
    started ends, and then the first failure is raised."""
    failure = None
    for finish, then in started:
        try:
            result = finish()
        except Exception as exc:
            failure = failure or exc
            continue
        if failure is None and then is not None:
            then(result)
    if failure is not None:
        raise failure


def _wait_for_all(waits: list[Callable[[], Any]]) -> None:
    """Call every wait, also after one has raised, then raise the first failure."""
    failure = None
    for wait in waits:
        try:
            wait()
        except Exception as exc:
            failure = failure or exc
    if failure is not None:
        raise failure


def _float32_for_16_bit(sent: torch.Tensor) -> torch.dtype | None:
    """The dtype a receiving rank reduces ``sent``'s blocks in: float32 for 16-bit floats (gloo
    alone would add them in 16 bits), their own dtype otherwise."""
    return torch.float32 if sent.dtype in LOW_PRECISION else None
