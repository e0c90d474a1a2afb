"""The interface every transport implements.

Tensors arrive flat (1-D), contiguous and on the CPU (except the block views a transport with
``Capabilities.takes_block_views`` is given by the hierarchical transport); the algorithms layer has already turned AVG
into SUM (except the 16-bit AVGs a transport takes itself: ``Capabilities.reduce_scatters_16_bit``,
``all_reduces_16_bit_avg``), bool into uint8 and, when ``accumulates_low_precision`` is False,
16-bit floats into float32. A transport declares what it can do once, in its class's
``capabilities``; the algorithms layer reads them and decides the numerics. Every collective
method takes the ``Call`` (call.py) it runs a step of, blocks until this rank's part is done and
raises ``SMDDPError`` (with the transport's own error text) on failure. What describes a transport to its user (its refusal board, the ranks and
role its messages name) is given to its constructor, and nothing else sets its attributes.
"""

from __future__ import annotations

import abc
import dataclasses
import itertools
from typing import ClassVar

import torch

from ..call import Call
from ..errors import PeerFailureError, where
from ..ops import RedOp


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What a transport does itself, declared once per transport class."""

    accumulates_low_precision: bool = False
    """True when the transport itself sums float16/bfloat16 in float32 (so callers need not
    upcast before sending)."""
    reduce_scatters_16_bit: frozenset = frozenset()
    """16-bit float dtypes whose SUM and AVG reduce_scatter this transport takes as they are: it
    sums them in float32 and divides an AVG before its last rounding into the output, so the
    algorithms layer need not widen them to float32, which doubles the bytes moved (FSDP2 sends
    bfloat16 AVG with reduce_dtype=bfloat16, ZeRO 16-bit SUM)."""
    all_reduces_16_bit_avg: frozenset = frozenset()
    """16-bit float dtypes whose AVG all_reduce this transport takes as it is: it sums in float32
    and divides before the last rounding, so the algorithms layer need not widen the tensor to
    float32 (twice the bytes, on every link) to divide it there (FSDP2's HSDP replicas average
    bfloat16 gradients with an AVG all_reduce)."""
    checks_signatures: bool = False
    """True when every collective already verifies op, dtype and size across ranks."""
    takes_block_views: bool = False
    """True when reduce_scatter's input and all_gather's output may also be (world_size, rows,
    columns) views of any strides, with the output (input) (rows, columns): block q is
    ``view[q]``. The transport copies every block into its staging memory anyway, so a caller
    whose blocks lie apart in a larger tensor (the hierarchical transport's, grouped by local
    index) need not first copy them together: that copy cost 5-7 ms of CPU per 10 MB call on
    2 simulated hosts x 2 ranks, a quarter of the call's CPU."""
    runs_inline: bool = False
    """True when collectives should run on the caller's thread. Transports whose work is the
    CPU's own copying and adding (shared memory, one rank) gain nothing from a communication
    thread and pay for the hand-off: 44 us against 58 us per small all_reduce, and far more
    when other threads (a gloo group's, say) share the process. Network-bound transports keep
    the thread so that DDP overlaps their waiting with backward compute."""


class Transport(abc.ABC):
    name: str = "?"
    capabilities: ClassVar[Capabilities] = Capabilities()
    refusals = None
    """The group's RefusalBoard (refusals.py) for transports whose waits cannot otherwise learn
    that a peer refused the call they wait in, or called a different one (gloo, MPI, the
    hierarchical transport's parts)."""
    shown_as: tuple[int, int] | None = None
    """(rank, world size) that error messages name, when not this transport's own: the
    hierarchical transport's parts are groups of their own, whose ranks users never see."""
    peers_shown: list[int] | None = None
    """The rank the user's group gives each of this transport's ranks, when not their own (a
    hierarchical transport's part), for messages that name peers (shm's)."""
    role: str = ""
    """What this transport's steps are to the user's group (the hierarchical transport's parts:
    "within the host", "between hosts"), for error messages."""
    interrupted: str | None = None
    """Why this rank's calls must end (``interrupt``), or None."""

    def __init__(self, rank: int, world_size: int, *, refusals=None, shown_as: tuple[int, int] | None = None,
                 peers_shown: list[int] | None = None, role: str = "") -> None:
        self.rank = rank
        self.world_size = world_size
        self.refusals, self.shown_as, self.peers_shown, self.role = refusals, shown_as, peers_shown, role

    def interrupt(self, reason: str) -> None:
        """End the call this rank waits in, and every later one, with a PeerFailureError saying
        ``reason``: something outside the call found a peer lost that the call's own waits cannot
        see before the group's timeout (a rank stopped, or cut off, found by its heartbeat).
        Safe from any thread; waits look for it as often as they look for a peer's refusal."""
        self.interrupted = reason

    def peer_left(self) -> str | None:
        """Why a peer of this rank left the group's protocol (it failed or was interrupted in a
        call), or None. A call can complete on what its peers posted before they left, where
        peers post to shared memory; over sockets the peers' leaving fails the call itself."""
        return None

    def raise_if_told(self, call: Call, op: str) -> None:
        """Raise in a wait of ``call`` if this rank was interrupted, or (where the group has a
        board) a peer refused the call, failed in it or called another."""
        if self.interrupted is not None:
            raise PeerFailureError(f"{self.where(call, op)} {self.interrupted}")
        if self.refusals is not None:
            self.refusals.raise_if_told(call.index, self.where(call, op))

    def where(self, call: Call, op: str) -> str:
        """The prefix of this transport's error messages (errors.where), naming the rank as the
        user's process group numbers it."""
        return where(*(self.shown_as or (self.rank, self.world_size)), self.shown_op(call, op))

    def shown_op(self, call: Call, op: str) -> str:
        """``op`` (this transport's) as error messages name it: the user's call, and the step of
        it that ``op`` is when they differ ("all_reduce (reduce_scatter step within the host)")."""
        role = f" {self.role}" if self.role else ""
        if not call.op.startswith(op):  # all_gather_into_tensor runs all_gather
            return f"{call.op} ({op} step{role})"
        return f"{call.op} ({self.role})" if self.role else call.op

    def entering(self, call: Call) -> None:
        """A call of the group begins on this rank. The part of a hierarchical transport inside a
        host shows it to its host-mates (ShmTransport), so that one waiting for this rank while it
        waits between hosts does not take it for the rank at fault."""

    @abc.abstractmethod
    def all_reduce(self, call: Call, tensor: torch.Tensor, op: RedOp) -> None: ...

    @abc.abstractmethod
    def broadcast(self, call: Call, tensor: torch.Tensor, root: int) -> None: ...

    @abc.abstractmethod
    def reduce(self, call: Call, tensor: torch.Tensor, root: int, op: RedOp) -> None: ...

    @abc.abstractmethod
    def all_gather(self, call: Call, output: torch.Tensor, input: torch.Tensor) -> None:
        """``output`` (world_size * n,) receives every rank's ``input`` (n,) in rank order."""

    @abc.abstractmethod
    def reduce_scatter(self, call: Call, output: torch.Tensor, input: torch.Tensor, op: RedOp) -> None:
        """``output`` (n,) receives the reduction of block ``rank`` of every rank's ``input``."""

    @abc.abstractmethod
    def all_to_all(self, call: Call, output: torch.Tensor, input: torch.Tensor) -> None:
        """Block ``q`` of ``input`` (world_size equal blocks) goes to rank ``q``'s block ``rank``."""

    @abc.abstractmethod
    def barrier(self, call: Call) -> None: ...

    @abc.abstractmethod
    def gather(self, call: Call, output: torch.Tensor | None, input: torch.Tensor, root: int) -> None:
        """``output`` (world_size * n,) on ``root`` receives every rank's ``input`` (n,) in rank
        order; ``output`` is None on the other ranks."""

    @abc.abstractmethod
    def scatter(self, call: Call, output: torch.Tensor, input: torch.Tensor | None, root: int) -> None:
        """``output`` (n,) receives block ``rank`` of the root's ``input`` (world_size * n,);
        ``input`` is None on the other ranks."""

    @abc.abstractmethod
    def all_to_all_v(self, call: Call, output: torch.Tensor, input: torch.Tensor, sends: list[list[int]]) -> None:
        """``sends[p][q]``: the elements rank p sends rank q, for every pair, the same on every
        rank (the algorithms layer has gathered and checked them). Block ``q`` of ``input``
        (``sends[rank][q]`` elements) goes to rank ``q``; block ``p`` of ``output``
        (``sends[p][rank]``) comes from rank ``p``; blocks lie in rank order."""

    def splits(self, sends: list[list[int]]) -> tuple[list[int], list[int]]:
        """This rank's (input, output) block sizes in an all_to_all_v of ``sends``."""
        return list(sends[self.rank]), [row[self.rank] for row in sends]

    def all_gather_v(self, call: Call, output: torch.Tensor, input: torch.Tensor, sizes: list[int]) -> None:
        """``output`` receives every rank's ``input``, rank p's of ``sizes[p]`` elements, in rank
        order; ``sizes`` is the same on every rank (the algorithms layer has checked them). Here
        an all_to_all_v whose every block is the input (world_size copies of it): for transports
        without a form of their own (gloo has none; shm and MPI override this)."""
        w = self.world_size
        self.all_to_all_v(call, output, input.repeat(w), [[n] * w for n in sizes])

    def gather_split_sizes(self, call: Call, output: torch.Tensor, input: torch.Tensor) -> None:
        """The all_gather of every rank's split sizes that an uneven all_to_all starts with.
        Transports that check headers (shm) name it apart, so that a rank here is told of a peer
        that makes a plain all_gather of the same size instead (a list all_gather whose ranks
        disagree on whether their sizes differ) rather than pairing with it."""
        self.all_gather(call, output, input)

    def signature_check(self, call: Call, signature: list[int]) -> list[list[int]]:
        """Every rank's ``signature`` (op, dtype, numel, arg), gathered with the transport itself."""
        mine = torch.tensor(signature, dtype=torch.int64)
        everyone = torch.empty(self.world_size * len(signature), dtype=torch.int64)
        self.all_gather(call, everyone, mine)
        return everyone.view(self.world_size, len(signature)).tolist()

    def reject(self, call_index: int, reason: str, learn_outcome: bool = True) -> str | None:
        """This rank refused call ``call_index`` that peers may be waiting in; tell them (so they
        raise now instead of at the timeout). Returns why this group cannot go on, if peers were
        left inside the call (RefusalBoard.post), else None. ``learn_outcome=False`` (the group
        can no longer be used anyway): tell them without waiting to hear back."""
        if self.refusals is not None:
            return self.refusals.post(call_index, reason, learn_outcome)
        return None

    def close(self) -> None:
        """Release resources. Idempotent."""


def overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory of (contiguous) ``a`` and ``b`` overlaps."""
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def block_offsets(counts: list[int]) -> list[int]:
    """Where each of consecutive blocks of ``counts`` elements starts."""
    return [0, *itertools.accumulate(counts)][: len(counts)]
