"""One process-group call, as the layers below the process group see it.

The process group numbers each call and makes its ``Call``; the algorithms layer completes it for
each step it runs (the step's signature, the dtype whose bytes it moves) and hands it to every
transport method as an argument. No layer keeps another's per-call state: a transport learns which
call it runs, for its headers, its waits on the refusal board and its error messages, from the
``call`` it is given.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class Call(NamedTuple):
    """(A NamedTuple: immutable, and made in a third of a frozen dataclass's time, twice per
    collective on the hot path.)"""

    index: int
    """The group's call number: identical on every rank that makes the same calls, so peers find
    each other's refusals and signatures under it."""
    op: str
    """The collective as the user called it (all_reduce, all_gather_into_tensor, ...), so an error
    in a step of it (a hierarchical part's reduce_scatter, the signature check's all_gather) names
    the call the user made."""
    signature: tuple[int, ...] | None = None
    """The (op, dtype, numel, arg) signature (signatures.signature) of the step being run: the
    hierarchical transport's host part publishes it in its headers beside its own step's."""
    carrying: torch.dtype | None = None
    """The user's dtype while a moving op's tensors travel as their uint8 bytes, so that headers
    (shm) tell bool, uint8 and float8 apart; sizes stay in the bytes moved."""

    def step(self, signature: list[int], carrying: torch.dtype | None = None) -> Call:
        """This call running one step (one per dtype of its tensors) of ``signature``."""
        return Call(self.index, self.op, tuple(signature), carrying)
