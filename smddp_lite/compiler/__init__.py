"""``smddp_lite.compile``: gradient buckets, overlapped collectives and a fused optimizer step.

Policy (``buckets``: which parameters share a bucket) is kept apart from mechanism (``reducer``:
when collectives launch and complete; ``kernels``: the arithmetic of one update).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import warnings
import weakref

import torch
import torch.distributed as dist

from ..config import QUANTIZED_WIRE_DTYPES, compile_config
from .agreement import check_ranks_agree, what_must_agree
from .buckets import describe, materialize, plan_buckets
from .graph import compile_graphs, repeated_blocks, uncompile_graphs
from .model import CompiledModel
from .optimizer import CompiledOptimizer, optimizer_family, step_counts, torch_state
from .quantized_wire import QuantizedWire, host_layout, refuse_what_an_8_bit_wire_does_not_carry
from .reducer import GradReducer
from .sharding import ParameterGathers, Shard

log = logging.getLogger("smddp_lite")
# the reducer (and, sharded, the parameter gathers) of each module compiled so far: compiling it
# again (after unfreezing parameters) detaches the old ones' hooks
_ATTACHED: "weakref.WeakKeyDictionary[torch.nn.Module, list]" = weakref.WeakKeyDictionary()
__all__ = ["compile", "detach", "CompiledModel", "CompiledOptimizer"]


def compile(model: torch.nn.Module, optimizer: torch.optim.Optimizer, **options) -> tuple[CompiledModel, CompiledOptimizer]:
    """Bucket ``model``'s gradients for data-parallel training and fuse ``optimizer``'s step.

    Args:
        model: the bare module (not DDP-wrapped), its parameters on one device.
        optimizer: torch.optim.AdamW, Adam or SGD over the model's trainable parameters, or the
            optimizer an earlier compile returned (to compile again after unfreezing parameters:
            the state carries over). Use the returned optimizer from now on; the one passed in
            is left behind.
        **options: ``bucket_cap_mb``, ``first_bucket_mb``, ``wire_dtype``, ``wire_block``,
            ``max_grad_norm``, ``write_back_grads``, ``shard_optimizer_state``,
            ``broadcast_buffers``, ``torch_compile``, ``debug`` (see ``smddp_lite.config.CompileConfig``); ``SMDDP_*`` variables set defaults.

    Returns:
        ``(model, optimizer)`` used like a DDP model and a torch optimizer: forward, backward
        (``.grad`` then holds the gradient averaged over ranks), ``step()``, ``zero_grad()``,
        ``state_dict()``. Without an initialised process group it runs on one rank, and
        raises when a launcher started several (initialise the group first).

    Example::

        model, optimizer = smddp_lite.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                                              max_grad_norm=1.0, wire_dtype=torch.bfloat16)
        loss_fn(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    """
    config = compile_config(options)
    if config.wire_dtype in QUANTIZED_WIRE_DTYPES:
        refuse_what_an_8_bit_wire_does_not_carry(model, config)
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise ValueError("smddp_lite.compile: pass the bare module, not a DistributedDataParallel wrapper (use .module)")
    compiled_whole = _warn_of_a_whole_model_graph(model)
    family = optimizer_family(optimizer)
    ordered = _ordered_params(model, optimizer)
    devices = {p.device for _, p in ordered}
    if len(devices) > 1:
        raise ValueError(
            f"smddp_lite.compile: parameters are on several devices ({', '.join(map(str, sorted(devices, key=str)))}); "
            "move the model to one device first (model.to(device))"
        )
    if not dist.is_initialized():
        _refuse_a_lone_rank_of_a_larger_job()
    device = next(iter(devices), torch.device("cpu"))
    graph = config.torch_compile if config.torch_compile is not None else device.type == "cuda"
    blocks = repeated_blocks(model) if graph and not compiled_whole else []
    config = dataclasses.replace(config, torch_compile=graph)
    group = dist.group.WORLD if dist.is_initialized() else None
    world = dist.get_world_size() if group is not None else 1
    mib = 2**20
    state = torch_state(optimizer)
    # parameters that stepped apart (some unfrozen after the others) go to separate buckets,
    # each with its own step count, as torch.optim keeps one per parameter
    buckets = plan_buckets(ordered, int(config.bucket_cap_mb * mib), int(config.first_bucket_mb * mib),
                           step_counts(state, family))
    if world > 1:  # before anything changes: a rank that differs would otherwise hang, abort or drift
        check_ranks_agree(group, dist.get_rank(), world, device,
                          what_must_agree(model, [p for _, p in ordered], buckets, family,
                                          optimizer.param_groups, config))
    for previous in _ATTACHED.pop(model, []):
        previous.detach()
    shard = Shard(dist.get_rank(), world) if config.shard_optimizer_state and world > 1 else None
    wire = getattr(torch, config.wire_dtype) if config.wire_dtype and world > 1 else None
    quantized = config.wire_dtype in QUANTIZED_WIRE_DTYPES
    # an 8-bit wire cuts each bucket into one piece of whole blocks per rank
    pad_to = world if shard is not None else world * config.wire_block if quantized and wire is not None else 1
    arenas = materialize(buckets, pad_to=pad_to, wire_dtype=None if quantized else wire)
    if world > 1:  # start every rank from rank 0's weights, as DDP does, frozen ones included
        for arena in arenas:
            dist.broadcast(arena.param_flat, src=0)
        with torch.no_grad():
            for p in model.parameters():
                if not p.requires_grad:
                    dist.broadcast(p.data, src=0)
        for buf in model.buffers():
            dist.broadcast(buf, src=0)
    uncompile_graphs(model)
    graphs = compile_graphs(model, blocks, config.debug)
    gathers = ParameterGathers(buckets, shard, group, model, graphs) if shard is not None else None
    wires = None
    if quantized and wire is not None:
        layout = host_layout(world)
        wires = [QuantizedWire(b, wire, config.wire_block, group, world, layout) for b in buckets]
    reducer = GradReducer(buckets, group, world, want_norm=config.max_grad_norm is not None, shard=shard,
                          gathers=gathers, quantized=wires)
    _ATTACHED[model] = [reducer] + ([gathers] if gathers is not None else [])
    compiled_optimizer = CompiledOptimizer(optimizer, family, arenas, reducer, config.max_grad_norm, gathers, state,
                                           write_back_grads=config.write_back_grads)
    if config.debug and (group is None or dist.get_rank() == 0):
        names = {id(p): n for n, p in model.named_parameters()}
        log.info("smddp_lite.compile: %s, %d buckets in %d update arenas, world size %d, wire dtype %s, clipping %s, %s\n%s",
                 type(optimizer).__name__, len(buckets), len(arenas), world, config.wire_dtype or "as parameters",
                 config.max_grad_norm, "optimizer state sharded" if shard is not None else "optimizer state on every rank",
                 describe(buckets, names, wires))
        if graph:
            log.info("smddp_lite.compile: torch.compile of %d repeated block(s) of %s%s", len(blocks),
                     ", ".join(sorted({type(b).__name__ for b in blocks})) or "none",
                     "" if blocks else " (no nn.ModuleList of two or more like blocks: forward and backward stay eager)")
    return CompiledModel(model, reducer, config.broadcast_buffers, gathers, watch_shapes=bool(blocks),
                         config=config), compiled_optimizer


def detach(model: torch.nn.Module) -> None:
    """Undo ``compile`` on ``model`` (the bare module): its gradients are no longer reduced, its
    sharded gathers are finished, and its blocks run eagerly again. The parameters keep their
    values; the compiled optimizer must not step it again."""
    for previous in _ATTACHED.pop(model, []):
        previous.detach()
    uncompile_graphs(model)


def _warn_of_a_whole_model_graph(model: torch.nn.Module) -> bool:
    """A module torch.compile'd whole runs its backward as one autograd node: every gradient is
    ready only at its end, so no bucket's collective can overlap backward. Returns whether
    ``model`` is one (its own graph then stands: no block of it is compiled again)."""
    dynamo = sys.modules.get("torch._dynamo")  # imported wherever a module was compiled
    whole = dynamo is not None and isinstance(model, dynamo.eval_frame.OptimizedModule)
    if whole:
        warnings.warn(
            "smddp_lite.compile: the model is torch.compile'd as a whole, so its backward is one graph and no "
            "gradient bucket can be sent before all of backward ends. Pass the module itself "
            "(model._orig_mod) with torch_compile=True: each repeated block is then compiled on its own and "
            "the buckets overlap backward", stacklevel=3)
    return whole


def _ordered_params(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[tuple[int, torch.nn.Parameter]]:
    """(param group index, parameter) in the order gradients become ready (reverse definition)."""
    group_of = {}
    for gi, g in enumerate(optimizer.param_groups):
        for p in g["params"]:
            group_of[id(p)] = gi
    trainable = [p for p in model.parameters() if p.requires_grad]
    missing = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in group_of]
    if missing:
        raise ValueError(
            f"smddp_lite.compile: trainable parameter(s) {missing[:5]} are not in the optimizer; add them "
            "or set requires_grad=False"
        )
    # frozen parameters may be in the optimizer (AdamW(model.parameters()) on a partly frozen
    # model): torch.optim skips them while they get no gradient, and so does the compiled step
    own = {id(p) for p in model.parameters()}
    strangers = sum(1 for key in group_of if key not in own)
    if strangers:
        raise ValueError(
            f"smddp_lite.compile: the optimizer holds {strangers} parameter(s) that are not this model's; "
            "build the optimizer from this model's parameters"
        )
    return [(group_of[id(p)], p) for p in reversed(trainable)]


# the job's size as each launcher announces it to its processes
_LAUNCHER_WORLD_SIZE = ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")


def _refuse_a_lone_rank_of_a_larger_job() -> None:
    """Without a process group every rank would train alone and their weights drift apart, with
    no error. Raising is chosen over initialising here: the group's backend, timeout and
    rendezvous are the script's to choose, and the script owns the group's end
    (destroy_process_group) and every other collective made on it."""
    for name in _LAUNCHER_WORLD_SIZE:
        value = os.environ.get(name, "")
        if value.isdigit() and int(value) > 1:
            raise RuntimeError(
                f"smddp_lite.compile: {name}={value} says this job runs {value} processes, but no process group "
                "is initialised, so each would train alone and their weights would drift apart. Call "
                "smddp_lite.init() (or torch.distributed.init_process_group(backend=\"smddp\")) before "
                "smddp_lite.compile")
