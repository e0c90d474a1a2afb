"""Rank programs of test_sharded_step.py: the sharded compiled step against DDP + torch.optim."""

from __future__ import annotations

import copy
import os

import torch
import torch.distributed as dist

import smddp_lite

_OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=3e-3, weight_decay=0.01),
    "adam": lambda params: torch.optim.Adam(params, lr=3e-3, weight_decay=0.01),
    "sgd": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
}


def _model(width: int = 67) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(35, width), torch.nn.Tanh(), torch.nn.Linear(width, 5))


# a bucket per parameter, of 5, 335, 67 and 2345 elements: none a multiple of 2 or 3, so at 2
# and 3 ranks every bucket is padded and share boundaries cut through parameters
ONE_PER_BUCKET = dict(bucket_cap_mb=1e-6, first_bucket_mb=1e-6)


def _batch(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    teacher = torch.randn(35, 5, generator=torch.Generator().manual_seed(7))  # a learnable labelling
    x = torch.randn(16, 35, generator=gen)
    return x, (x @ teacher).argmax(1)


def _max_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max(float((p - q).abs().max()) for p, q in zip(a.parameters(), b.parameters()))


def parity(steps: int = 12, family: str = "adamw", clip: float | None = None, wire_dtype: str | None = None,
           scaler: bool = False, frozen: bool = False, no_sync_every: int = 0) -> dict:
    """The sharded step against DDP + torch.optim on the same per-rank batches, with a learning
    rate schedule. ``scaler``: a GradScaler on both sides, and at step 3 one element of rank 1's
    gradient made infinite, so both must skip that step on every rank: the element is the last of
    the largest bucket, in the last rank's share, so rank 0 neither holds it nor reduces it. ``frozen``: the first layer's bias frozen.
    ``no_sync_every``: accumulate that many backward passes under no_sync before each step."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    smddp_lite.init()
    rank = dist.get_rank()
    base = _model()
    if frozen:
        base[0].bias.requires_grad_(False)
    eager_module, compiled_module = copy.deepcopy(base), copy.deepcopy(base)
    eager = DDP(eager_module, bucket_cap_mb=0.01)
    opt_e = _OPTIMIZERS[family](eager.parameters())
    compiled, opt_c = smddp_lite.compile(compiled_module, _OPTIMIZERS[family](compiled_module.parameters()),
                                         wire_dtype=wire_dtype, max_grad_norm=clip, shard_optimizer_state=True,
                                         **ONE_PER_BUCKET)
    schedules = [torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.01, total_steps=steps) for o in (opt_e, opt_c)]
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2) if scaler else None
               for _ in range(2)]
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    now = {"step": 0}

    def one_infinite_element(grad: torch.Tensor) -> torch.Tensor:
        if not (scaler and now["step"] == 3 and rank == 1):
            return grad
        grad = grad.clone()
        grad.view(-1)[-1] = float("inf")
        return grad

    for module in (eager_module, compiled_module):
        module[0].weight.register_hook(one_infinite_element)
    losses: dict[str, list[float]] = {"eager": [], "compiled": []}
    scales: dict[str, list[float]] = {"eager": [], "compiled": []}
    for step in range(steps):
        now["step"] = step
        batches = [_batch(gen) for _ in range(no_sync_every + 1)]
        for (name, model, opt), schedule, grad_scaler in zip(
                (("eager", eager, opt_e), ("compiled", compiled, opt_c)), schedules, scalers):
            for k, (x, y) in enumerate(batches):
                loss = torch.nn.functional.cross_entropy(model(x), y)
                scaled = grad_scaler.scale(loss) if grad_scaler is not None else loss
                if k < no_sync_every:
                    with model.no_sync():
                        scaled.backward()
                else:
                    scaled.backward()
            if name == "eager" and clip is not None:
                if grad_scaler is not None:
                    grad_scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip, foreach=True)
            if grad_scaler is not None:
                grad_scaler.step(opt)
                grad_scaler.update()
                scales[name].append(float(grad_scaler.get_scale()))
            else:
                opt.step()
            opt.zero_grad()
            schedule.step()
            losses[name].append(loss.item())
    compiled.wait_for_parameters()
    diff = _max_diff(eager_module, compiled_module)
    # every rank holds the same parameters
    flat = torch.cat([p.detach().reshape(-1) for p in compiled_module.parameters()])
    copies = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(copies, flat)
    dist.destroy_process_group()
    return {"max_diff": diff, "replicas_differ": max(float((c - flat).abs().max()) for c in copies),
            "losses": losses, "scales": scales, "buckets": len(opt_c.buckets)}


def state_sizes(family: str = "adamw", width: int = 1000) -> dict:
    """Bytes of optimizer moments per rank (step counters, 4 bytes per bucket or parameter, left
    out): the sharded step, the unsharded one, torch.optim."""
    smddp_lite.init()
    world = dist.get_world_size()
    sizes, padding = {}, 0
    for sharded in (False, True):
        module = _model(width=width)
        compiled, opt = smddp_lite.compile(module, _OPTIMIZERS[family](module.parameters()), bucket_cap_mb=0.1,
                                           first_bucket_mb=0.01, shard_optimizer_state=sharded)
        x, y = _batch(torch.Generator().manual_seed(dist.get_rank()))
        torch.nn.functional.cross_entropy(compiled(x), y).backward()
        opt.step()
        moments = opt.state_bytes() - sum(t.numel() * t.element_size() for t in opt.steps)
        sizes["sharded" if sharded else "unsharded"] = moments
        if not sharded:  # the zeros between an arena's buckets, in each state tensor
            gaps = sum(a.numel - sum(b.padded_numel for b in a.buckets) for a in opt.arenas)
            sizes["alignment"] = gaps * 4 * len(opt.flat_state[0])
        if sharded:
            padding = max(b.padded_numel - b.numel for b in opt.buckets) * 4 * len(opt.flat_state[0])
    plain_module = _model(width=width)
    plain = _OPTIMIZERS[family](plain_module.parameters())
    torch.nn.functional.cross_entropy(plain_module(x), y).backward()
    plain.step()
    sizes["torch"] = sum(t.numel() * t.element_size() for entry in plain.state.values()
                         for key, t in entry.items() if key != "step")
    dist.destroy_process_group()
    return {**sizes, "world": world, "padding_bytes_per_bucket": padding}


def checkpoint_round_trips(directory: str, family: str = "adamw", steps: int = 4) -> dict:
    """A sharded run's state_dict is torch's full format (it equals an unsharded run's), it loads
    into plain torch.optim and into an unsharded compiled step, and theirs load into a sharded
    one; each continues as the run it came from would. Rank 0 also saves the sharded state for
    a job of another size (``resume_elsewhere``)."""
    smddp_lite.init()
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(100 + rank)
    batches = [_batch(gen) for _ in range(2 * steps)]

    def compiled_run(sharded: bool):
        module = _model()
        model, opt = smddp_lite.compile(module, _OPTIMIZERS[family](module.parameters()),
                                        shard_optimizer_state=sharded, **ONE_PER_BUCKET)
        return module, model, opt

    def train(model, opt, part: int) -> None:
        for x, y in batches[part * steps:(part + 1) * steps]:
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        if hasattr(model, "wait_for_parameters"):
            model.wait_for_parameters()

    sharded_module, sharded, sharded_opt = compiled_run(True)
    plain_module, plain, plain_opt = compiled_run(False)
    train(sharded, sharded_opt, 0)
    train(plain, plain_opt, 0)
    problems = []
    sd_sharded, sd_plain = sharded_opt.state_dict(), plain_opt.state_dict()
    if sorted(sd_sharded["state"]) != sorted(sd_plain["state"]):
        problems.append(f"state keys {sorted(sd_sharded['state'])} vs {sorted(sd_plain['state'])}")
    for key, entry in sd_plain["state"].items():
        for name, value in entry.items():
            other = sd_sharded["state"].get(key, {}).get(name)
            if other is None or other.shape != value.shape or not torch.allclose(other, value, rtol=1e-5, atol=1e-7):
                problems.append(f"state[{key}][{name}] differs from the unsharded step's")
    if rank == 0:
        torch.save({"model": sharded_module.state_dict(), "optimizer": sd_sharded}, os.path.join(directory, "ckpt.pt"))

    # sharded -> plain torch.optim (under DDP) and sharded -> unsharded, each against the sharded run going on
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch_module = _model()
    torch_module.load_state_dict(sharded_module.state_dict())
    torch_opt = _OPTIMIZERS[family](torch_module.parameters())
    torch_opt.load_state_dict(sd_sharded)
    unsharded_module, unsharded, unsharded_opt = compiled_run(False)
    unsharded_module.load_state_dict(sharded_module.state_dict())
    unsharded_opt.load_state_dict(sd_sharded)
    # plain torch.optim and an unsharded run -> sharded
    resharded_module, resharded, resharded_opt = compiled_run(True)
    resharded_module.load_state_dict(plain_module.state_dict())
    resharded_opt.load_state_dict(plain_opt.state_dict())
    del sd_sharded, sd_plain
    ddp = DDP(torch_module)
    train(sharded, sharded_opt, 1)
    train(ddp, torch_opt, 1)
    train(unsharded, unsharded_opt, 1)
    train(resharded, resharded_opt, 1)
    train(plain, plain_opt, 1)
    diffs = {"sharded->torch": _max_diff(sharded_module, torch_module),
             "sharded->unsharded": _max_diff(sharded_module, unsharded_module),
             "unsharded->sharded": _max_diff(plain_module, resharded_module)}
    dist.destroy_process_group()
    return {"problems": problems, "diffs": diffs}


def resume_elsewhere(directory: str, family: str = "adamw", steps: int = 4) -> dict:
    """Load the checkpoint another job size wrote into a sharded step and into DDP + torch.optim;
    both continue alike."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    smddp_lite.init()
    rank = dist.get_rank()
    saved = torch.load(os.path.join(directory, "ckpt.pt"), weights_only=True)
    runs = {}
    for sharded in (True, False):
        module = _model()
        module.load_state_dict(saved["model"])
        if sharded:
            model, opt = smddp_lite.compile(module, _OPTIMIZERS[family](module.parameters()),
                                            shard_optimizer_state=True, **ONE_PER_BUCKET)
        else:
            model, opt = DDP(module), _OPTIMIZERS[family](module.parameters())
        opt.load_state_dict(saved["optimizer"])
        gen = torch.Generator().manual_seed(200 + rank)
        for _ in range(steps):
            x, y = _batch(gen)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        if sharded:
            model.wait_for_parameters()
        runs[sharded] = module
    diff = _max_diff(runs[True], runs[False])
    dist.destroy_process_group()
    return {"max_diff": diff}


def distributed_checkpoint(directory: str) -> dict:
    """torch.distributed.checkpoint's get/set_state_dict and dcp.save/load with a sharded step:
    a resumed run continues exactly as the run that saved."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    smddp_lite.init()
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(100 + rank)
    batches = [_batch(gen) for _ in range(6)]

    def run():
        module = _model()
        return (module, *smddp_lite.compile(module, torch.optim.AdamW(module.parameters(), lr=3e-3),
                                            shard_optimizer_state=True, **ONE_PER_BUCKET))

    def train(model, opt, part) -> None:
        for x, y in batches[part * 3:(part + 1) * 3]:
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        model.wait_for_parameters()

    module, model, opt = run()
    train(model, opt, 0)
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=directory)
    train(model, opt, 1)

    resumed_module, resumed, resumed_opt = run()
    torch.nn.init.zeros_(resumed_module[0].weight)  # nothing of the fresh run may survive the load
    model_sd, optim_sd = get_state_dict(resumed, resumed_opt)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=directory)
    set_state_dict(resumed, resumed_opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    train(resumed, resumed_opt, 1)
    diff = _max_diff(module, resumed_module)
    dist.destroy_process_group()
    return {"max_diff": diff}


def compile_again_after_unfreezing(steps: int = 3) -> dict:
    """Freeze the first layer, train, unfreeze and compile again with the compiled optimizer:
    sharded and unsharded runs end alike (the sharded one's state is gathered to be carried over)."""
    smddp_lite.init()
    gen = torch.Generator().manual_seed(100 + dist.get_rank())
    batches = [_batch(gen) for _ in range(2 * steps)]
    ends = []
    for sharded in (True, False):
        module = _model()
        module[0].requires_grad_(False)
        model, opt = smddp_lite.compile(module, torch.optim.AdamW(module.parameters(), lr=3e-3),
                                        shard_optimizer_state=sharded, **ONE_PER_BUCKET)
        for k, (x, y) in enumerate(batches):
            if k == steps:
                module[0].requires_grad_(True)
                model, opt = smddp_lite.compile(module, opt, shard_optimizer_state=sharded, **ONE_PER_BUCKET)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        model.wait_for_parameters()
        ends.append(module)
    diff = _max_diff(*ends)
    dist.destroy_process_group()
    return {"max_diff": diff}


def _sharded_after_one_step():
    """(module, compiled model, optimizer) of a sharded step that has taken one step."""
    smddp_lite.init()
    module = _model()
    model, opt = smddp_lite.compile(module, torch.optim.AdamW(module.parameters(), lr=3e-3),
                                    shard_optimizer_state=True, **ONE_PER_BUCKET)
    x, y = _batch(torch.Generator().manual_seed(dist.get_rank()))
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    return module, model, opt


def what_waits_for_the_gathers() -> dict:
    """After a step every bucket's gather is in flight; a forward of the last layer alone waits
    for the buckets holding that layer's parameters and no others; state_dict() waits for all."""
    module, model, opt = _sharded_after_one_step()
    gathers = model._gathers
    seen = {"after step": gathers.in_flight()}
    with torch.no_grad():
        module[2](torch.zeros(1, 67))
    seen["after the last layer's forward"] = gathers.in_flight()
    module.state_dict()
    seen["after state_dict"] = gathers.in_flight()
    seen["last layer's buckets"] = sorted({b.index for b in opt.buckets for p in b.params
                                           if any(p is q for q in module[2].parameters())})
    dist.destroy_process_group()
    return seen


def state_dict_on_one_rank(wait_s: float = 2.0) -> dict:
    """The checkpoint pattern of DDP scripts, ``if rank == 0: torch.save(optimizer.state_dict())``,
    with a sharded step: rank 0's call must say what is wrong instead of waiting forever."""
    import smddp_lite.compiler.sharding as sharding

    sharding.ARRIVAL_WAIT_S = wait_s  # this rank's process runs this one program, then exits
    _, _, opt = _sharded_after_one_step()
    error = None
    if dist.get_rank() == 0:
        try:
            opt.state_dict()
        except RuntimeError as exc:
            error = str(exc)
    dist.barrier()
    dist.destroy_process_group()
    return {"error": error}
