"""What the framework examples report, so that a run on "smddp" can be compared with one on gloo."""

from __future__ import annotations

import json

import torch
import torch.distributed as dist


def write(path: str | None, losses: list[float], model: torch.nn.Module, **more) -> None:
    """Rank 0 writes the losses, every parameter's sum and ``more`` to ``path`` (JSON), when given."""
    if path is None or dist.get_rank() != 0:
        return
    sums = {name: float(p.detach().double().sum()) for name, p in model.named_parameters()}
    with open(path, "w") as out:
        json.dump({"losses": losses, "parameter_sums": sums, "world_size": dist.get_world_size(), **more}, out)


def arguments(description: str, compiled_step: bool = False, accumulate: bool = False):
    import argparse

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--backend", default="smddp", help="smddp, or gloo to compare")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", help="write the losses and parameter sums here (JSON, rank 0)")
    parser.add_argument("--compile", action="store_true",
                        help="compile the model with torch.compile, through the framework's own switch")
    if accumulate:
        parser.add_argument("--accumulate", type=int, default=1, help="batches whose gradients make one step")
    if compiled_step:
        parser.add_argument("--compiled-step", action="store_true",
                            help="train with smddp_lite.compile (gradient buckets, fused optimizer step)")
    return parser.parse_args()
