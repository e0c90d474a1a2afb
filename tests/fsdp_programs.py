"""Programs of test_fsdp.py: FSDP2, HSDP, DCP and functional collectives over smddp.

Each program runs on every rank of a test job (see harness.py) and returns what it observed."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

import smddp_lite

from .rank_helpers import (
    let_gloo_workers_finish,
    parity_batches,
    parity_model,
    train_side_by_side,
)


def checkpoint_paths(directory: str) -> dict:
    """torch's checkpoint code asks the group which devices it serves: loading a full state dict
    into an FSDP2 model with broadcast_from_rank0 (rank 0 alone holds the checkpoint), DCP's
    async_save, and the default device older code asks for. Each failed on "smddp" (the group
    reported no devices). Returns what each gave."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
    )
    from torch.distributed.fsdp import fully_shard

    smddp_lite.init(timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    torch.manual_seed(0)
    saved = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)).state_dict()
    expected = {k: v.clone() for k, v in saved.items()}  # set_model_state_dict changes what it is given
    torch.manual_seed(1 + rank)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    fully_shard(model)
    set_model_state_dict(model, saved if rank == 0 else {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    report = {"loaded_rank_0s": all(torch.equal(p.full_tensor(), expected[k]) for k, p in model.state_dict().items())}
    torch.manual_seed(2)  # a replicated state dict: the same on every rank (DCP writes one copy)
    plain = torch.nn.Linear(4, 4)
    dcp.async_save({"m": plain.state_dict()}, checkpoint_id=directory).result()
    restored = {"m": torch.nn.Linear(4, 4).state_dict()}
    dcp.load(restored, checkpoint_id=directory)
    report["async_saved"] = all(torch.equal(restored["m"][k], v) for k, v in plain.state_dict().items())
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "will be deprecated"; FSDP1's optimizer state dict asks it
        report["default_device"] = str(dist.distributed_c10d._get_pg_default_device())
    report["object_device"] = dist.distributed_c10d._get_object_coll_device()
    dist.destroy_process_group()
    return report


def fsdp_parity(steps: int = 6, param_dtype: str | None = None, divide_factor: float | None = None) -> dict:
    """The same model sharded with FSDP2 (fully_shard) on "smddp" and on "gloo", side by side in
    one job: FSDP gathers parameters with all_gather_into_tensor and reduces gradients with
    reduce_scatter_tensor. The smddp model takes fully_shard's default mesh (the default group,
    as a user's script would); ``param_dtype`` sets a MixedPrecisionPolicy for both (gradients
    then reduced in that dtype). With ``divide_factor`` the smddp model divides its gradients by
    it (``set_gradient_divide_factor``: FSDP2 then reduce-scatters with PREMUL_SUM, which gloo
    refuses); the gloo model averages them and multiplies by world size / factor instead."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    smddp_lite.init()
    rank = dist.get_rank()
    gloo = dist.new_group(backend="gloo")
    dtype = getattr(torch, param_dtype) if param_dtype else None
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype)

    def sharded(mesh) -> torch.nn.Module:
        model = parity_model()
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh, mp_policy=policy)
        return fully_shard(model, mesh=mesh, mp_policy=policy)

    variants = {"smddp": sharded(None), "gloo": sharded(DeviceMesh.from_group(gloo, "cpu"))}
    if divide_factor is not None:  # the setting is per fully_shard module
        for module in variants["smddp"].modules():
            if hasattr(module, "set_gradient_divide_factor"):
                module.set_gradient_divide_factor(divide_factor)

    def before_step(name: str, model: torch.nn.Module) -> None:
        if divide_factor is not None and name == "gloo":
            for p in model.parameters():
                p.grad.mul_(dist.get_world_size() / divide_factor)

    losses = train_side_by_side(variants, rank, steps, before_step=before_step)
    full = {k: [p.full_tensor() for p in m.parameters()] for k, m in variants.items()}
    result = {"max_diff": max(float((p - q).abs().max()) for p, q in zip(full["smddp"], full["gloo"])),
              "max_abs": max(float(p.abs().max()) for p in full["gloo"]),
              "losses": losses["smddp"], "gloo_losses": losses["gloo"]}
    let_gloo_workers_finish()
    dist.destroy_process_group()
    return result


def hsdp_parity(steps: int = 6, param_dtype: str | None = None) -> dict:
    """FSDP2 as HSDP (a 2-D mesh: shard across the ranks of a host, replicate across hosts) on
    "smddp" and on "gloo", side by side in one job, on 2 hosts x 2 ranks. Gradients are
    reduce-scattered inside each host and then all-reduced across hosts, both with AVG (FSDP2's
    choice for float32 and bfloat16), on subgroups of the default group."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    smddp_lite.init()
    rank, world = dist.get_rank(), dist.get_world_size()
    layout = torch.arange(world).view(2, world // 2)  # rows: hosts (replicas); columns: shards
    dtype = getattr(torch, param_dtype) if param_dtype else None
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype)

    def mesh_of(backend: str) -> DeviceMesh:
        # every rank makes every group, in the same order, as new_group requires
        replicate = [dist.new_group(col.tolist(), backend=backend) for col in layout.t()]
        shard = [dist.new_group(row.tolist(), backend=backend) for row in layout]
        mine = replicate[rank % layout.shape[1]], shard[rank // layout.shape[1]]
        return DeviceMesh.from_group(list(mine), "cpu", mesh=layout.tolist(), mesh_dim_names=("replicate", "shard"))

    def sharded(mesh: DeviceMesh) -> torch.nn.Module:
        model = parity_model()
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh, mp_policy=policy)
        return fully_shard(model, mesh=mesh, mp_policy=policy)

    variants = {"smddp": sharded(mesh_of("smddp")), "gloo": sharded(mesh_of("gloo"))}
    optims = {k: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for k, m in variants.items()}
    for x, y in parity_batches(rank, steps):
        for name, model in variants.items():
            optims[name].zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optims[name].step()
    full = {k: [p.full_tensor() for p in m.parameters()] for k, m in variants.items()}
    result = {"max_diff": max(float((p - q).abs().max()) for p, q in zip(full["smddp"], full["gloo"])),
              "max_abs": max(float(p.abs().max()) for p in full["gloo"])}
    let_gloo_workers_finish()
    dist.destroy_process_group()
    return result


def functional_collectives() -> dict:
    """torch's functional collectives (what DTensor, tensor parallelism and compiled code call):
    they find the process group by its name in c10d's registry."""
    import torch.distributed._functional_collectives as funcol

    smddp_lite.init()
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    result = {
        "all_reduce": funcol.all_reduce(torch.full((4,), rank + 1.0), "sum", group).tolist(),
        "all_gather": funcol.all_gather_single(torch.full((2,), float(rank)), 0, group).tolist(),
        "reduce_scatter": funcol.reduce_scatter_single(torch.arange(2.0 * world), "sum", 0, group).tolist(),
        "group_name": group.group_name,
    }
    dist.destroy_process_group()
    return result
