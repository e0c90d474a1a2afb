"""Policy: which parameters share a communication bucket, and in which order buckets go.

A bucket holds parameters of one param group, device and dtype, so one fused kernel with one
set of hyperparameters updates it. Gradients become ready roughly in reverse order of
definition (autograd reaches the last layers first), so buckets are filled in that order; the
first is small so that the first collective starts early in backward.

Buckets that one set of hyperparameters updates (one param group, device, dtype and step count)
live side by side in one arena: their flat buffers are slices of one allocation per stream, so
the optimizer step updates every bucket of an arena with one launch, however many buckets the
collectives want.

As in DDP, a bucket closes once it holds its cap or more: the parameter that crosses the cap
stays in it. Opening a new bucket for that parameter instead would leave the first bucket with
only the last layer's bias whenever its weight is larger than the first cap, and send that
weight with the last, largest bucket, when backward has ended (MLP 256-2048-2048-256, 2
simulated hosts x 2 ranks at 1 Gbit/s: a 1 KiB first bucket and a 20 MiB second one).
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class Bucket:
    """One flat buffer of gradients (and of the parameters and optimizer state it updates)."""

    index: int
    group: int  # index into optimizer.param_groups
    params: list[torch.nn.Parameter]
    offsets: list[int]  # element offset of each parameter in the flat buffers
    numel: int
    dtype: torch.dtype
    device: torch.device
    # the step count its parameters' optimizer state starts from (buckets apart when they differ)
    start_step: float = 0.0
    # set by materialize():
    padded_numel: int = 0  # numel rounded up to a multiple of the world size when sharded
    arena: int = -1  # index of the arena whose buffers hold this bucket's
    start: int = 0  # element offset of the bucket in its arena's buffers
    param_flat: torch.Tensor | None = None  # (numel,) every parameter's storage
    grad_flat: torch.Tensor | None = None  # (numel,) every parameter's .grad
    # (padded_numel,) the gradients in the wire dtype, when they travel in another dtype; sharded
    # with a bfloat16 wire, the updates travel back in it too (sharding.ParameterGathers)
    wire_flat: torch.Tensor | None = None

    def view(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        p = self.params[i]
        return flat[self.offsets[i] : self.offsets[i] + p.numel()].view_as(p)


# Each bucket starts at a multiple of this many elements in its arena (512 bytes of float32):
# NCCL and vector loads want aligned buffers, and the gaps cost under 0.1% of a 25 MiB bucket.
ALIGN = 128


@dataclasses.dataclass
class Arena:
    """Consecutive buckets that one fused launch updates: their param group, device, dtype and
    step count are the same, and their flat buffers are slices of this arena's.

    The gaps between buckets (``ALIGN``) hold zeros in every stream; an Adam or SGD update
    of zeros with a zero gradient leaves zeros, so the update runs over the whole arena."""

    index: int
    group: int
    dtype: torch.dtype
    device: torch.device
    buckets: list[Bucket]
    numel: int = 0  # every bucket's padded_numel, each started at a multiple of ALIGN
    param_flat: torch.Tensor | None = None  # (numel,)
    grad_flat: torch.Tensor | None = None  # (numel,)

    def part(self, flat: torch.Tensor, b: Bucket) -> torch.Tensor:
        """Bucket ``b``'s slice of an arena-sized buffer."""
        return flat[b.start:b.start + b.padded_numel]


def plan_buckets(ordered: list[tuple[int, torch.nn.Parameter]], cap_bytes: int, first_cap_bytes: int,
                 steps: dict[int, float] | None = None) -> list[Bucket]:
    """Group ``(param group index, parameter)`` pairs, given in gradient-ready order, into buckets.
    ``steps``: each parameter's optimizer step count (by ``id``), where they differ: the fused
    update keeps one per bucket, so parameters that stepped apart (some unfrozen later) do not
    share one."""
    steps = steps or {}
    buckets: list[Bucket] = []
    open_by_key: dict[tuple, Bucket] = {}
    for group, p in ordered:
        key = (group, p.device, p.dtype, steps.get(id(p), 0.0))
        bucket = open_by_key.get(key)
        if bucket is None:
            bucket = Bucket(len(buckets), group, [], [], 0, p.dtype, p.device, key[3])
            buckets.append(bucket)
            open_by_key[key] = bucket
        bucket.params.append(p)
        bucket.offsets.append(bucket.numel)
        bucket.numel += p.numel()
        cap = first_cap_bytes if bucket is buckets[0] else cap_bytes
        if bucket.numel * p.element_size() >= cap:  # full: the next parameter of this key opens another
            del open_by_key[key]
    return buckets


def plan_arenas(buckets: list[Bucket]) -> list[Arena]:
    """Group buckets that one update launch can serve (same param group, device, dtype and
    step count) into arenas, keeping bucket order inside each."""
    arenas: dict[tuple, Arena] = {}
    for b in buckets:
        key = (b.group, b.device, b.dtype, b.start_step)
        if key not in arenas:
            arenas[key] = Arena(len(arenas), b.group, b.dtype, b.device, [])
        arenas[key].buckets.append(b)
        b.arena = arenas[key].index
    return list(arenas.values())


def materialize(buckets: list[Bucket], pad_to: int = 1, wire_dtype: torch.dtype | None = None) -> list[Arena]:
    """Move every parameter's storage into its bucket's flat buffer and make ``.grad`` a view of
    the flat gradient buffer, so the optimizer and the collectives see one tensor per bucket, and
    the buckets' buffers slices of their arena's, so an update sees one tensor per arena.
    ``pad_to``: the flat buffers' length is a multiple of it (the world size, when each rank
    owns one equal share of every bucket); the zeros after the last parameter belong to none.
    ``wire_dtype``: the dtype gradients travel in, where it differs from a bucket's."""
    arenas = plan_arenas(buckets)
    for arena in arenas:
        for b in arena.buckets:
            b.padded_numel = -(-b.numel // pad_to) * pad_to
            b.start = -(-arena.numel // ALIGN) * ALIGN
            arena.numel = b.start + b.padded_numel
        arena.param_flat = torch.zeros(arena.numel, dtype=arena.dtype, device=arena.device)
        arena.grad_flat = torch.zeros(arena.numel, dtype=arena.dtype, device=arena.device)
        for b in arena.buckets:
            b.param_flat, b.grad_flat = arena.part(arena.param_flat, b), arena.part(arena.grad_flat, b)
    for b in buckets:
        if wire_dtype is not None and wire_dtype != b.dtype:
            b.wire_flat = torch.zeros(b.padded_numel, dtype=wire_dtype, device=b.device)
        for i, p in enumerate(b.params):
            view = b.view(b.param_flat, i)
            view.copy_(p.detach())
            p.data = view
            p.grad = b.view(b.grad_flat, i)
    return arenas


def describe(buckets: list[Bucket], names: dict[int, str], wires: list | None = None) -> str:
    """One line per bucket: its parameters, size, and the wire its gradients take."""
    lines = []
    for b in buckets:
        first, last = names.get(id(b.params[0]), "?"), names.get(id(b.params[-1]), "?")
        mib = b.numel * torch.empty(0, dtype=b.dtype).element_size() / 2**20
        if wires is not None:
            wire = wires[b.index].describe()
        else:
            on_wire = b.wire_flat if b.wire_flat is not None else b.grad_flat
            wire = (f"{str(on_wire.dtype).replace('torch.', '')} wire, "
                    f"{b.numel * on_wire.element_size()} bytes reduced per step")
        lines.append(f"  bucket {b.index}: group {b.group}, {len(b.params)} params ({first} .. {last}), "
                     f"{b.numel} x {str(b.dtype).replace('torch.', '')} = {mib:.2f} MiB on {b.device}; {wire}")
    return "\n".join(lines)
