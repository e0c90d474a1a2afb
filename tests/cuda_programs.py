"""Programs for CUDA tests (test_cuda.py): run on every rank of a job on a machine with a GPU.
Every rank uses cuda:0, which the staged path allows and NCCL does not (world size 1 there)."""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist

import smddp_lite

from .rank_helpers import error_of, still_works


def _device() -> torch.device:
    torch.cuda.set_device(0)
    return torch.device("cuda", 0)


def stream_ordering() -> dict:
    """A kernel on the caller's stream writes the input just before an async collective; the
    collective must see those values and the caller's next kernel must see the result, with no
    explicit synchronisation anywhere."""
    device = _device()
    smddp_lite.init()
    rank, world = dist.get_rank(), dist.get_world_size()
    n = 1 << 20
    x = torch.zeros(n, device=device)
    out = torch.empty(world * n, device=device)
    # the first collective on a device makes its NCCL communicator, which blocks the host (as
    # with torch's nccl): made here, so that the timed call below shows a steady-state launch
    dist.all_gather_into_tensor(out, x)
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time on the current stream before the write
    x.fill_(rank + 1)
    start = time.monotonic()
    work = dist.all_gather_into_tensor(out, x, async_op=True)
    returned_s = time.monotonic() - start
    work.wait()
    doubled = out * 2  # on the current stream, after wait()
    summed = torch.full((n,), float(rank + 1), device=device)
    chained = dist.all_reduce(summed, async_op=True).get_future().then(lambda fut: fut.value()[0] * 3)
    got = doubled.view(world, n)[:, 0].tolist()
    result = {"gathered": got, "want": [2.0 * (r + 1) for r in range(world)],
              "all_equal": bool((doubled.view(world, n) == doubled.view(world, n)[:, :1]).all()),
              "chained": float(chained.wait()[0]), "chained_want": 3.0 * world * (world + 1) / 2,
              "host_returned_s": returned_s, "transport": smddp_lite_cuda_transport()}
    dist.destroy_process_group()
    return result


def smddp_lite_cuda_transport() -> str:
    paths = dist.distributed_c10d._get_default_group()._cuda  # the group object is smddp's own
    return "none" if paths is None else ("nccl" if paths.nccl is not None else "staged")


def ddp_parity(steps: int = 8) -> dict:
    """DDP on CUDA with "smddp" against DDP on CUDA with torch's own backend for CUDA tensors
    ("nccl" at world size 1, "gloo" where several ranks share the GPU): same parameters."""
    device = _device()
    smddp_lite.init()
    rank, world = dist.get_rank(), dist.get_world_size()
    reference = dist.new_group(backend="nccl" if world == 1 else "gloo")
    finals = {}
    for name, group in (("smddp", None), ("reference", reference)):
        torch.manual_seed(0)
        module = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8)).to(device)
        model = torch.nn.parallel.DistributedDataParallel(module, device_ids=[device.index], process_group=group)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        gen = torch.Generator().manual_seed(rank)
        for _ in range(steps):
            x = torch.randn(16, 64, generator=gen).to(device)
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
        finals[name] = torch.cat([p.detach().reshape(-1) for p in module.parameters()]).cpu()
    diff = float((finals["smddp"] - finals["reference"]).abs().max())
    dist.destroy_process_group()
    return {"max_diff": diff}


def compiled_parity(steps: int = 10, wire_dtype: str | None = None, poison: tuple[int, ...] = (4,)) -> dict:
    """smddp_lite.compile on CUDA (buckets reduced over smddp, the fused Triton update compiled for
    the GPU) against DDP on torch's own backend + torch.optim.AdamW, both with a GradScaler and
    clipping to 0.5, on the same per-rank batches; step ``poison`` has an infinite loss, which
    both must skip. Reports the largest parameter difference and the largest difference of the
    .grad each leaves after the last step (unscaled and clipped, which the fused kernel writes)."""
    import copy

    device = _device()
    smddp_lite.init()
    rank, world = dist.get_rank(), dist.get_world_size()
    reference = dist.new_group(backend="nccl" if world == 1 else "gloo")
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(33, 256), torch.nn.Tanh(), torch.nn.Linear(256, 5)).to(device)
    eager_module, compiled_module = copy.deepcopy(base), copy.deepcopy(base)
    eager = torch.nn.parallel.DistributedDataParallel(eager_module, device_ids=[device.index],
                                                      process_group=reference, bucket_cap_mb=0.01)
    opt_e = torch.optim.AdamW(eager.parameters(), lr=3e-3, weight_decay=0.01)
    compiled, opt_c = smddp_lite.compile(compiled_module, torch.optim.AdamW(compiled_module.parameters(), lr=3e-3,
                                                                             weight_decay=0.01),
                                         bucket_cap_mb=0.01, first_bucket_mb=0.001, wire_dtype=wire_dtype,
                                         max_grad_norm=0.5)
    scalers = {name: torch.amp.GradScaler("cuda", init_scale=1024.0, growth_interval=3) for name in ("eager", "compiled")}
    teacher = torch.randn(33, 5, generator=torch.Generator().manual_seed(7))
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    losses = {"eager": [], "compiled": []}
    grads = {}
    for step in range(steps):
        x = torch.randn(16, 33, generator=gen)
        y = (x @ teacher).argmax(1)
        x, y = x.to(device), y.to(device)
        for name, model, opt in (("eager", eager, opt_e), ("compiled", compiled, opt_c)):
            scaler = scalers[name]
            loss = torch.nn.functional.cross_entropy(model(x), y)
            losses[name].append(loss.item())
            if step in poison:
                loss = loss * float("inf")
            scaler.scale(loss).backward()
            if name == "eager":
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5, foreach=True)
            scaler.step(opt)
            scaler.update()
            if step == steps - 1:
                grads[name] = [p.grad.detach().clone() for p in model.parameters()]
            opt.zero_grad()
    params = zip(eager_module.parameters(), compiled_module.parameters())
    moved = zip(base.parameters(), compiled_module.parameters())  # base keeps the starting weights
    result = {"max_diff": max(float((a - b).abs().max()) for a, b in params),
              "moved": max(float((a - b).abs().max()) for a, b in moved),
              "max_abs": max(float(p.abs().max()) for p in eager_module.parameters()),
              "grad_diff": max(float((a - b).abs().max()) for a, b in zip(grads["eager"], grads["compiled"])),
              "grad_abs": max(float(g.abs().max()) for g in grads["eager"]),
              "scales": {name: s.get_scale() for name, s in scalers.items()},
              "steps_taken": int(opt_c.state_dict()["state"][0]["step"].item()),
              "losses": losses, "buckets": len(opt_c.buckets), "transport": smddp_lite_cuda_transport(),
              "bucket_device": str(opt_c.buckets[0].grad_flat.device)}
    dist.destroy_process_group()
    return result


def moved_dtypes() -> dict:
    """Ops that only move data, on dtypes NCCL has no type for: each must give the input back
    (world size 1) and none may be sent through host memory (the debug log says when one is)."""
    import logging

    device = _device()
    staged: list[str] = []

    class Staged(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "goes through host memory" in record.getMessage():
                staged.append(record.getMessage())

    logger = logging.getLogger("smddp_lite")
    logger.addHandler(Staged())
    logger.setLevel(logging.DEBUG)
    smddp_lite.init()
    world = dist.get_world_size()
    wrong = []
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.int16, torch.complex64):
        # compared as bytes: float8's NaN patterns and complex values are then compared exactly
        x = torch.randn(4 * world, 3, dtype=dtype if dtype.is_complex else torch.float32, device=device).to(dtype)
        b = x.clone()
        dist.broadcast(b, 0)
        gathered = torch.empty(world * x.shape[0], 3, dtype=dtype, device=device)
        dist.all_gather_into_tensor(gathered, x)
        listed = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(listed, x)
        exchanged = torch.empty_like(x)
        dist.all_to_all_single(exchanged, x)
        split = torch.empty_like(x)
        dist.all_to_all_single(split, x, [x.shape[0] // world] * world, [x.shape[0] // world] * world)
        for name, got in (("broadcast", b), ("all_gather_into_tensor", gathered[: x.shape[0]]), ("all_gather", listed[0]),
                          ("all_to_all_single", exchanged), ("all_to_all_single with splits", split)):
            if not torch.equal(got.view(torch.uint8), x.view(torch.uint8)):
                wrong.append(f"{name} {dtype}")
    torch.cuda.synchronize()
    result = {"wrong": wrong, "staged": staged, "transport": smddp_lite_cuda_transport()}
    dist.destroy_process_group()
    return result


def bad_input() -> dict:
    """Tensors on two devices in one call: a clear error at once, and the group still works."""
    device = _device()
    smddp_lite.init()
    errors = {}
    try:
        dist.all_gather_into_tensor(torch.empty(2 * dist.get_world_size(), device=device), torch.ones(2))
    except ValueError as exc:
        errors["mixed"] = str(exc)
    t = torch.ones(4, device=device)
    dist.all_reduce(t)
    ok = bool((t == dist.get_world_size()).all())
    dist.destroy_process_group()
    return {"errors": errors, "still_works": ok}


def peer_stuck() -> dict:
    """Rank 1 skips a collective: rank 0's wait raises within the group timeout, not never."""
    _device()
    smddp_lite.init(timeout=timedelta(seconds=3))
    t = torch.ones(8, device="cuda")
    start = time.monotonic()
    error = None
    if dist.get_rank() == 0:
        try:
            dist.all_reduce(t)
            torch.cuda.synchronize()
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
    else:
        time.sleep(8)
    return {"error": error, "seconds": time.monotonic() - start}


def graph_capture() -> dict:
    """An all_reduce captured into a CUDA graph with the kernels around it (as with torch's nccl):
    a first capture before any warm-up is refused clearly; after one eager call, each replay
    reduces what the graph's own kernel wrote. An eager collective stays in flight through the
    whole capture, so the watchdog queries its event meanwhile: in CUDA's default (global) capture
    mode that query would invalidate the capture unless the watchdog's thread is thread-local."""
    device = _device()
    smddp_lite.init()
    world = dist.get_world_size()
    static = torch.zeros(1 << 16, device=device)
    errors = {}
    try:
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            dist.all_reduce(static)
    except Exception as exc:  # noqa: BLE001 (the message is what is checked)
        errors["before_warm_up"] = f"{type(exc).__name__}: {exc}"
    dist.all_reduce(torch.ones(4, device=device))  # warm-up: communicator and stream exist now
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    torch.cuda._sleep(1_000_000_000)  # ~0.5 s on the current stream, which the capture does not wait for
    pending = dist.all_reduce(torch.ones(4, device=device), async_op=True)  # in flight during the capture
    gathered = torch.empty(world * static.numel(), device=device)
    dist.all_gather_into_tensor(gathered, static)  # warm-up of the second captured op too
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        graph.capture_begin()
        static.mul_(2)
        dist.all_reduce(static)
        # out of place: NCCL must copy even at world size 1, so the graph holds NCCL's own work
        dist.all_gather_into_tensor(gathered, static)
        time.sleep(0.3)  # the watchdog polls every 0.1 s while the capture is open
        graph.capture_end()
    pending.wait()
    replays = []
    for value in (1.0, 3.0):
        static.fill_(value)
        gathered.zero_()
        graph.replay()
        torch.cuda.synchronize()
        replays.append({"got": static[:4].tolist(), "want": [2 * value * world] * 4,
                        "all_equal": bool((static == static[0]).all()),
                        "gathered_all_equal": bool((gathered == 2 * value * world).all())})
    time.sleep(0.3)  # several watchdog rounds
    after = torch.full((4,), 2.0, device=device)
    dist.all_reduce(after)
    result = {"errors": errors, "replays": replays, "after": after.tolist(), "after_want": [2.0 * world] * 4}
    dist.destroy_process_group()
    return result


def fast_calls() -> dict:
    """The fast path (backend/cuda/fast_path.py) at world size 1 over NCCL: which calls take it,
    what they compute, when the host returns, and that the watchdog gives its events back."""
    from torch._C._distributed_c10d import AllgatherOptions

    device = _device()
    smddp_lite.init()
    group = dist.distributed_c10d._get_default_group()
    out: dict = {"kinds": {}, "wrong": []}
    dist.all_reduce(torch.ones(4, device=device))  # the general route makes the communicator and stream

    def kind(work) -> str:
        return type(work).__name__

    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.uint8, torch.bool):
        x = (torch.arange(1000, device=device) % 7).to(dtype)
        want = x.clone()
        for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.AVG):
            if op == dist.ReduceOp.AVG and not dtype.is_floating_point:
                continue
            opts = dist.AllreduceOptions()
            opts.reduceOp, opts.asyncOp = op, False
            y = x.clone()
            work = group.allreduce([y], opts)
            work.wait()
            out["kinds"][f"all_reduce {dtype} {op}"] = kind(work)
            if not torch.equal(y, want):
                out["wrong"].append(f"all_reduce {dtype} {op}")
        b = x.clone()
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor, opts.asyncOp = 0, 0, True
        work = group.broadcast([b], opts)
        work.wait()
        out["kinds"][f"broadcast {dtype} async"] = kind(work)
        gathered = torch.empty_like(x)
        opts = AllgatherOptions()
        opts.asyncOp = False
        work = group._allgather_base(gathered, x, opts)
        work.wait()
        out["kinds"][f"all_gather {dtype}"] = kind(work)
        if not (torch.equal(b, want) and torch.equal(gathered, want)):
            out["wrong"].append(f"broadcast/all_gather {dtype}")
    # what the fast path leaves to the general route
    strided = torch.ones(8, 2, device=device)[:, 0]
    opts = dist.AllreduceOptions()
    opts.asyncOp = False
    work = group.allreduce([strided], opts)
    work.wait()
    out["kinds"]["all_reduce strided"] = kind(work)
    out["strided_right"] = bool((strided == 1).all())
    work = group.allreduce([torch.ones(3, device=device), torch.ones(3, device=device)], opts)
    work.wait()
    out["kinds"]["all_reduce two tensors"] = kind(work)
    # a synchronous call goes on the caller's stream; an asynchronous one on the group's, and
    # the host returns from both without waiting for the 0.1 s kernel before them
    x = torch.zeros(1 << 20, device=device)
    for mode in ("sync", "async"):
        torch.cuda._sleep(200_000_000)
        x.fill_(3.0)
        start = time.monotonic()
        work = dist.all_reduce(x, async_op=mode == "async")
        out[f"{mode}_returned_s"] = time.monotonic() - start
        if work is not None:
            out["async_completed_at_once"] = work.is_completed()
            work.wait()
        out[f"{mode}_value"] = float((x * 2)[-1])  # on the caller's stream, after the call
    torch.cuda.synchronize()
    time.sleep(0.35)  # the watchdog polls every 0.1 s
    nccl = group._cuda.nccl
    out["in_flight_after"] = nccl.watchdog.in_flight()
    out["pooled_events"] = len(nccl.fast._lanes[device.index].events._free)
    out["calls_numbered"] = group._calls
    dist.destroy_process_group()
    return out


def cuda_paths_compared(without_nccl: list[int] | None = None, setting: str = "auto") -> dict:
    """How the ranks of a group agree on the way CUDA tensors move, without a GPU.

    With ``without_nccl`` (rank numbers): ``agree_on_path`` itself, the listed ranks saying NCCL
    did not load and the others that it did, through the job's real store. Without it: the
    group's ``CudaPaths`` made on every rank under ``setting``, where cupy is missing on every
    rank (CI), so every rank has the same answer."""
    import warnings

    from smddp_lite.backend.cuda import CudaPaths, agree_on_path
    from smddp_lite.config import backend_config

    smddp_lite.init(timeout=timedelta(seconds=20))
    rank, world = dist.get_rank(), dist.get_world_size()
    store = dist.PrefixStore("cuda-paths-test", dist.distributed_c10d._get_default_store())
    if without_nccl is not None:
        why = "cupy is not installed (test)" if rank in without_nccl else None
        report = error_of(lambda: agree_on_path(store, rank, world, timedelta(seconds=20), setting, why))
        # the group's next CUDA call makes its CudaPaths again: it must be refused again, not pass
        # on the counts the first comparison left in the store (at 2 ranks 1 + 1 NCCL = 2)
        report["again"] = error_of(lambda: agree_on_path(store, rank, world, timedelta(seconds=20), setting, why))
    else:
        made = {}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            report = error_of(lambda: made.update(paths=CudaPaths(store, rank, world, timedelta(seconds=20),
                                                                   backend_config({"SMDDP_CUDA_TRANSPORT": setting}),
                                                                   lambda reason: None)))
        report["staged"] = "paths" in made and made["paths"].nccl is None
        report["warnings"] = [str(w.message) for w in caught]
    report["usable_after"] = still_works()
    dist.destroy_process_group()
    return report
