"""What every rank's ``compile`` must agree on, checked across ranks before anything is compiled.

Each rank's compiled step makes its collectives from its own model, optimizer and options. Where
they differ the collectives do not line up, and what users saw was far from the cause: a
mismatch error about a broadcast, gloo aborting a rank, or, worst, nothing at all: a rank that
clips gradients (or rounds them to its own wire dtype) while the others do not trains on
silently, its parameters drifting apart from theirs. So compile compares, in one small
all_gather, a fingerprint of what shapes the collectives and the update; only where
fingerprints differ does a second all_gather bring each rank's words, and every rank raises the
same error naming what differs, its value on each rank, and what to change (the exchange, the
comparison and the words are backend/agreement.py's).
"""

from __future__ import annotations

import json
import zlib

import torch

from ..backend import agreement
from ..config import QUANTIZED_WIRE_DTYPES
from .sharding import ALL_GATHER

SAME_MODEL = "build the same model on every rank, with the same parameters trainable (requires_grad)"
SAME_OPTIONS = "pass the same compile options (or SMDDP_* variables) on every rank"


def _tensors(tensors: list[torch.Tensor]) -> tuple[str, str]:
    """(count and size in words, a fingerprint of every shape and dtype in order)."""
    said = f"{len(tensors)} tensor{'s' if len(tensors) != 1 else ''} of {sum(t.numel() for t in tensors)} elements"
    shapes = repr([(tuple(t.shape), str(t.dtype)) for t in tensors])
    return said, f"shapes and dtypes #{zlib.crc32(shapes.encode()):08x}"


BUCKETS = "buckets (bucket_cap_mb, first_bucket_mb; SMDDP_BUCKET_CAP_MB, SMDDP_FIRST_BUCKET_MB)"
# what each family's update reads from a param group
UPDATE_KEYS = {"adam": ("lr", "betas", "eps", "weight_decay"), "adamw": ("lr", "betas", "eps", "weight_decay"),
               "sgd": ("lr", "momentum", "dampening", "weight_decay", "nesterov")}


def _number(value):
    """A setting as plain numbers: a tensor learning rate or beta as its value."""
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    return tuple(map(_number, value)) if isinstance(value, (tuple, list)) else value


def _hyperparameters(param_groups: list[dict], family: str) -> str:
    """Each param group's update settings in words."""
    return "; ".join(f"group {i}: " + ", ".join(f"{k}={_number(g[k])!r}" for k in UPDATE_KEYS[family] if k in g)
                     for i, g in enumerate(param_groups))


def what_must_agree(model: torch.nn.Module, trainable: list[torch.Tensor], buckets, family: str,
                    param_groups: list[dict], config) -> list[tuple[str, str, str]]:
    """(what, this rank's value in words, how to fix a difference), in the order differences
    are reported."""
    trained, trained_shapes = _tensors(trainable)
    kept = [p for p in model.parameters() if not p.requires_grad] + list(model.buffers())
    broadcast, broadcast_shapes = _tensors(kept)
    sizes = repr([(b.numel, str(b.dtype)) for b in buckets])
    return [
        ("trainable parameters", trained, SAME_MODEL),
        ("trainable parameters", trained_shapes, SAME_MODEL),
        ("frozen parameters and buffers (broadcast from rank 0)", broadcast, SAME_MODEL),
        ("frozen parameters and buffers (broadcast from rank 0)", broadcast_shapes, SAME_MODEL),
        ("optimizer", f"{family} with {len(param_groups)} param group{'s' if len(param_groups) != 1 else ''}",
         "build the same optimizer on every rank"),
        # a rank alone with another learning rate trains its replica apart from the others
        ("optimizer settings", _hyperparameters(param_groups, family),
         "give the optimizer the same settings on every rank (a learning rate scaled by rank, or a scheduler "
         "stepped before compile on some ranks only, trains the replicas apart)"),
        ("wire_dtype (SMDDP_WIRE_DTYPE)", str(config.wire_dtype or "unset"), SAME_OPTIONS),
        ("wire_block (SMDDP_WIRE_BLOCK)",
         str(config.wire_block) if config.wire_dtype in QUANTIZED_WIRE_DTYPES else "unused", SAME_OPTIONS),
        ("max_grad_norm (SMDDP_MAX_GRAD_NORM)", str(config.max_grad_norm), SAME_OPTIONS),
        ("shard_optimizer_state (SMDDP_SHARD_OPTIMIZER_STATE)", str(config.shard_optimizer_state), SAME_OPTIONS),
        # compiled blocks round differently from eager ones: the replicas would drift apart
        ("torch_compile (SMDDP_TORCH_COMPILE)", str(config.torch_compile), SAME_OPTIONS),
        # without buffers it changes nothing
        ("broadcast_buffers (SMDDP_BROADCAST_BUFFERS)",
         str(config.broadcast_buffers) if any(b.numel() for b in model.buffers()) else "unused", SAME_OPTIONS),
        (BUCKETS, f"{len(buckets)} bucket{'s' if len(buckets) != 1 else ''}, sizes #{zlib.crc32(sizes.encode()):08x}", SAME_OPTIONS),
    ]


def check_ranks_agree(group, rank: int, world: int, device: torch.device, entries: list[tuple[str, str, str]]) -> None:
    """Raise one ValueError on every rank where ``entries`` (``what_must_agree``) differ across
    the ranks of ``group``. Collective: every rank must call it; one all_gather of two numbers
    where the ranks agree."""
    published = agreement.exchange_in_group(json.dumps([value for _, value, _ in entries]), world,
                                            lambda out, mine: ALL_GATHER(out, mine, group=group), device)
    if agreement.agreed(published):
        return
    values = [json.loads(p) for p in published]
    raise ValueError(f"smddp_lite.compile (rank {rank}/{world}): the ranks compiled different models or options, "
                     "so their collectives would not line up (a hang, an abort, or parameters that drift apart): "
                     f"{_differences(entries, values)} Nothing was compiled: the model and optimizer are as they "
                     "were.")


def _differences(entries: list[tuple[str, str, str]], values: list[list[str]]) -> str:
    """What differs, each with every rank's value, then what to do about it."""
    said, named, fixes = [], set(), []
    for i, (what, _, fix) in enumerate(entries):
        column = [theirs[i] for theirs in values]
        # a count that differs is named once (not again by its shapes), and models that differ
        # make other buckets anyway
        if agreement.agreed(column) or what in named or (what == BUCKETS and SAME_MODEL in fixes):
            continue
        named.add(what)
        said.append(f"{what}: {agreement.said(column)}")
        fixes += [] if fix in fixes else [fix]
    return f"{'; '.join(said)}. " + " ".join(f"{fix[0].upper()}{fix[1:]}." for fix in fixes)
