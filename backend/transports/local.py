"""The one-rank transport: every collective of a group of one is a copy or nothing."""

from __future__ import annotations

import torch

from ..call import Call
from ..ops import RedOp
from .base import Capabilities, Transport


class LocalTransport(Transport):
    name = "local"
    # nothing is summed, and nobody can disagree
    capabilities = Capabilities(accumulates_low_precision=True, runs_inline=True, checks_signatures=True)

    def __init__(self, **shown) -> None:
        super().__init__(0, 1, **shown)

    def all_reduce(self, call: Call, tensor: torch.Tensor, op: RedOp) -> None:
        return  # the only contribution is already in place

    def broadcast(self, call: Call, tensor: torch.Tensor, root: int) -> None:
        return  # the root is this rank

    def reduce(self, call: Call, tensor: torch.Tensor, root: int, op: RedOp) -> None:
        return  # the only contribution is already in place

    def all_gather(self, call: Call, output: torch.Tensor, input: torch.Tensor) -> None:
        output.copy_(input)

    def reduce_scatter(self, call: Call, output: torch.Tensor, input: torch.Tensor, op: RedOp) -> None:
        output.copy_(input)

    def all_to_all(self, call: Call, output: torch.Tensor, input: torch.Tensor) -> None:
        output.copy_(input)

    def all_to_all_v(self, call: Call, output: torch.Tensor, input: torch.Tensor, sends: list[list[int]]) -> None:
        output.copy_(input)

    def gather(self, call: Call, output: torch.Tensor | None, input: torch.Tensor, root: int) -> None:
        output.copy_(input)

    def scatter(self, call: Call, output: torch.Tensor, input: torch.Tensor | None, root: int) -> None:
        output.copy_(input)

    def barrier(self, call: Call) -> None:
        return  # nobody to wait for
