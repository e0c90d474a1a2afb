"""Mechanism: one bucket's gradients averaged over an 8-bit wire, with error feedback.

``compile(..., wire_dtype=torch.int8)`` (or a float8 dtype) sends each bucket as blockwise
quantized pieces (``kernels/quantize.py``: 8-bit values and a float32 scale per block) in two
collectives, on any transport:

1. each rank adds its residual to its gradient (divided by the world size), quantizes the sum
   once and keeps what the rounding lost as its next residual; an all-to-all hands rank ``q``
   every rank's piece ``q``;
2. each rank sums the pieces it received in float32, in rank order, adds the residual of its
   own piece's earlier sums, quantizes the sum once and keeps what that rounding lost; an
   all-gather brings every rank every piece's sum, which all of them dequantize alike.

So each rank sends ``2 (world - 1) / world`` of the bucket at one byte per element (and 4 bytes
per block), a quarter of a float32 ring all-reduce, and every value is rounded twice, whatever
the world size, where a ring rounds on every hop. On several hosts with as many ranks each
(``HostLayout``), the bucket is first reduce-scattered in float32 inside each host, and the
exchange runs among the ranks holding the same part on each host: only each host's sums are
quantized and cross, as the hierarchical transport's own 8-bit wire does.

What both roundings lose is added to the next step's gradient (error feedback, as in 1-bit
Adam's worker and server compensation), so over many steps the parameters follow float32
training instead of drifting with the rounding.

Residuals are per rank and kept in the gradient's units: with GradScaler, a residual carried
across a change of the loss scale is off by that change's factor (at most one rounding's error).
A block holding inf or nan (a step GradScaler skips) starts its residual afresh.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from ..kernels.quantize import blocks_of, check_format, dequantize_add, quantize
from .buckets import Bucket
from .sharding import ALL_GATHER, REDUCE_SCATTER

# bytes of one scale on the wire
_SCALE_BYTES = 4


@dataclasses.dataclass(frozen=True)
class HostLayout:
    """Ranks on several hosts, as many on each: a bucket is first reduce-scattered in float32
    inside each host, and only each host's sums cross between hosts, quantized (half the bytes
    between hosts of an exchange among all ranks, and 1/ranks-per-host of the quantizing)."""

    inside: object  # this rank's host: a group of ``per_host`` ranks
    across: object  # the ranks of this rank's place in its host, one per host
    hosts: int
    per_host: int
    piece_of: tuple[int, ...]  # by rank: the piece whose sum that rank makes and all-gathers


def host_layout(world: int) -> HostLayout | None:
    """The hosts of the default group's ranks, as the backend sees them (``SMDDP_HOSTNAME``
    overrides), or None when a hierarchy gains nothing (one host, one rank per host) or hosts
    hold different numbers of ranks. Collective: every rank calls it (it makes subgroups)."""
    from ..backend.transports.select import host_name
    from ..config import backend_config

    names: list = [None] * world
    dist.all_gather_object(names, host_name(backend_config()))
    by_host: dict[str, list[int]] = {}
    for rank, name in enumerate(names):
        by_host.setdefault(name, []).append(rank)
    hosts = list(by_host.values())
    if len(hosts) < 2 or len({len(h) for h in hosts}) != 1 or len(hosts[0]) < 2:
        return None
    per_host = len(hosts[0])
    across_lists = [sorted(h[local] for h in hosts) for local in range(per_host)]
    inside, _ = dist.new_subgroups_by_enumeration(hosts)
    across, _ = dist.new_subgroups_by_enumeration(across_lists)
    piece_of = [0] * world
    for local, members in enumerate(across_lists):
        for place, rank in enumerate(members):  # place: the rank's rank in its ``across`` group
            piece_of[rank] = local * len(hosts) + place
    return HostLayout(inside, across, len(hosts), per_host, tuple(piece_of))


class QuantizedWire:
    """One bucket's 8-bit exchange and its two residuals. ``start`` launches the first
    collective, ``exchange`` quantizes and launches the all-to-all, ``sum_and_gather`` sums this
    rank's piece and launches the all-gather, ``wait`` writes the averaged gradient back into the
    bucket; each does whatever earlier part is still left."""

    def __init__(self, bucket: Bucket, dtype: torch.dtype, block: int, group, world: int,
                 layout: HostLayout | None = None) -> None:
        """``bucket``: padded to a multiple of ``world x block`` (``materialize``)."""
        check_format(dtype, block)
        self.bucket, self.dtype, self.block, self.group, self.world = bucket, dtype, block, group, world
        self.layout = layout
        # each rank sums one piece of whole blocks, so pieces quantize, travel and land independently
        self.piece = bucket.padded_numel // world
        if self.piece * world != bucket.padded_numel or self.piece % block:
            raise ValueError(f"QuantizedWire: a bucket of {bucket.padded_numel} elements does not split into "
                             f"{world} pieces of whole blocks of {block}; materialize it with pad_to={world * block}")
        self.piece_blocks = self.piece // block
        self.row_bytes = self.piece * dtype.itemsize + self.piece_blocks * _SCALE_BYTES
        # the ranks the all-to-all runs among, and the pieces this rank quantizes
        self.peers = layout.hosts if layout is not None else world
        self.piece_of = layout.piece_of if layout is not None else tuple(range(world))
        device = bucket.device
        # what rounding this rank's part of the gradient lost (the pieces it sends), and what
        # rounding the sums of its own piece lost: both go into the next step
        self.residual = torch.zeros(self.peers * self.piece, dtype=torch.float32, device=device)
        self.sum_residual = torch.zeros(self.piece, dtype=torch.float32, device=device)
        self._values = torch.empty(self.peers * self.piece, dtype=dtype, device=device)
        self._scales = torch.empty(self.peers * self.piece_blocks, dtype=torch.float32, device=device)
        # one row per piece: its values, then its scales
        self._rows = torch.empty(self.peers, self.row_bytes, dtype=torch.uint8, device=device)
        self._received = torch.empty(self.peers, self.row_bytes, dtype=torch.uint8, device=device)
        self._mine = torch.empty(self.row_bytes, dtype=torch.uint8, device=device)
        # the all-gather reuses the sent rows where they are as many: the all-to-all is done by then
        self._gathered = self._rows if self.peers == world else \
            torch.empty(world, self.row_bytes, dtype=torch.uint8, device=device)
        # this host's float32 sums of this rank's part, from the reduce-scatter inside the host
        self._host_sums = None if layout is None else \
            torch.empty(self.peers * self.piece, dtype=torch.float32, device=device)
        self._landing = (None if bucket.dtype == torch.float32 else
                         torch.empty(bucket.padded_numel, dtype=torch.float32, device=device))
        self._work = None
        self._stage = "idle"

    def bytes_sent(self) -> int:
        """Bytes this rank hands the transport per step for other ranks: its rows in the
        all-to-all, and its own row for each other rank in the all-gather (the float32
        reduce-scatter inside a host, under a HostLayout, not counted)."""
        return (self.peers - 1 + self.world - 1) * self.row_bytes

    def residual_bytes(self) -> int:
        return (self.residual.numel() + self.sum_residual.numel()) * 4

    def describe(self) -> str:
        how = (f"reduce-scattered in float32 inside each of {self.layout.hosts} hosts, then "
               if self.layout is not None else "")
        float32 = (self.peers - 1 + self.world - 1) * self.piece * 4
        return (f"{how}{str(self.dtype).replace('torch.', '')} wire in blocks of {self.block}, {self.bytes_sent()} "
                f"bytes sent per step by each rank (as float32 pieces: {float32}), residuals "
                f"{self.residual_bytes()} bytes")

    def _values_of(self, rows: torch.Tensor, q: int) -> torch.Tensor:
        return rows[q, : self.piece * self.dtype.itemsize].view(self.dtype)

    def _scales_of(self, rows: torch.Tensor, q: int) -> torch.Tensor:
        return rows[q, self.piece * self.dtype.itemsize :].view(torch.float32)

    def start(self) -> None:
        if self.layout is None:
            self._stage = "reduced"
            self.exchange()
            return
        grad = self.bucket.grad_flat
        self._work = REDUCE_SCATTER(self._host_sums, grad if grad.dtype == torch.float32 else grad.float(),
                                    group=self.layout.inside, async_op=True)
        self._stage = "reducing"

    def exchange(self) -> None:
        if self._stage not in ("reducing", "reduced"):
            return
        if self._stage == "reducing":
            self._work.wait()
        part = self.bucket.grad_flat if self.layout is None else self._host_sums
        r = self.residual
        # r becomes the value to send (this rank's part of the average plus what earlier
        # roundings lost), then, once rounded, what this rounding lost
        r.add_(part, alpha=1.0 / self.world)
        quantize(r, self.dtype, self.block, out=(self._values, self._scales))
        _keep_what_rounding_lost(r, self._values, self._scales, self.block)
        values, scales = self._values.view(self.peers, self.piece), self._scales.view(self.peers, self.piece_blocks)
        self._rows[:, : self.piece * self.dtype.itemsize].view(self.dtype).copy_(values)
        self._rows[:, self.piece * self.dtype.itemsize :].view(torch.float32).copy_(scales)
        across = self.group if self.layout is None else self.layout.across
        self._work = dist.all_to_all_single(self._received, self._rows, group=across, async_op=True)
        self._stage = "exchanging"

    def sum_and_gather(self) -> None:
        self.exchange()
        if self._stage != "exchanging":
            return
        self._work.wait()
        total = self.sum_residual  # the sums, and once rounded, what their rounding lost
        for q in range(self.peers):  # in rank order: the same bits on every rank
            dequantize_add(total, self._values_of(self._received, q), self._scales_of(self._received, q), self.block)
        mine = self._mine.view(1, -1)
        values, scales = self._values_of(mine, 0), self._scales_of(mine, 0)
        quantize(total, self.dtype, self.block, out=(values, scales))
        _keep_what_rounding_lost(total, values, scales, self.block)
        self._work = ALL_GATHER(self._gathered, self._mine, group=self.group, async_op=True)
        self._stage = "gathering"

    def wait(self) -> None:
        """Write the averaged gradient into the bucket (``.grad``)."""
        if self._stage == "idle":
            return
        self.sum_and_gather()
        self._work.wait()
        self._work, self._stage = None, "idle"
        n, grad = self.bucket.numel, self.bucket.grad_flat
        landing = grad if self._landing is None else self._landing
        landing[:n].zero_()
        for rank, k in enumerate(self.piece_of):  # row ``rank`` holds the sums of piece k
            lo, hi = k * self.piece, min(n, (k + 1) * self.piece)
            if lo >= hi:
                continue
            length = hi - lo
            dequantize_add(landing[lo:hi], self._values_of(self._gathered, rank)[:length],
                           self._scales_of(self._gathered, rank)[: blocks_of(length, self.block)], self.block)
        if landing is not grad:
            grad[:n].copy_(landing[:n])

    # checkpoints: each rank's residuals are its own ------------------------------------------
    def state(self) -> dict[str, torch.Tensor]:
        return {"residual": self.residual, "sum_residual": self.sum_residual}

    def fits(self, state: dict) -> bool:
        return (tuple(state.get("residual", torch.empty(0)).shape) == tuple(self.residual.shape)
                and tuple(state.get("sum_residual", torch.empty(0)).shape) == tuple(self.sum_residual.shape))

    def load(self, state: dict | None) -> None:
        """Residuals from a checkpoint of this rank, or zeros."""
        if state is None:
            self.residual.zero_()
            self.sum_residual.zero_()
            return
        self.residual.copy_(state["residual"])
        self.sum_residual.copy_(state["sum_residual"])


def refuse_what_an_8_bit_wire_does_not_carry(model: torch.nn.Module, config) -> None:
    """Checked at compile whatever the world size, so that a script tried on one rank fails
    there and not when it first runs on several."""
    if config.shard_optimizer_state:
        raise ValueError(
            f"smddp_lite.compile: wire_dtype={config.wire_dtype} with shard_optimizer_state=True is not supported: "
            "the 8-bit wire averages whole buckets. Use wire_dtype=torch.bfloat16 with sharded optimizer state, "
            "or shard_optimizer_state=False")
    if any(p.dtype == torch.float64 for p in model.parameters() if p.requires_grad):
        raise ValueError(
            f"smddp_lite.compile: wire_dtype={config.wire_dtype} carries float32 sums, and the model has float64 "
            "parameters, whose gradients would lose their precision on it. Use wire_dtype=None for a float64 model")


def _keep_what_rounding_lost(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, block: int) -> None:
    """``x`` -= its quantized values, in place: what rounding ``x`` lost. A block that held inf
    or nan (its scale NaN) keeps nothing: its step is skipped, and NaN would spread to every
    later step."""
    dequantize_add(x, values, -scales, block)
    bad = ~torch.isfinite(scales)
    # on a GPU, asking whether any is bad would wait for the device; filling nothing is cheaper
    if x.device.type != "cpu" or bad.any():
        x.view(-1, block).masked_fill_(bad[:, None], 0.0)
