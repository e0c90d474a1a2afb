"""Per-call latency distribution of a small all_reduce (or send/recv round trip), for several backends side by side.

nccl-tests style means hide the tail; this prints p50/p90/p99/max of single calls, alternating
backends in rounds so that machine noise hits them alike. On CUDA a call returns once it is
enqueued, so the times are the host's cost of a call (the device is synchronised after each
round); ``--profile`` adds where that time goes in the first backend (cProfile, by own time).

    torchrun --standalone --nproc-per-node 2 benchmarks/latency.py --backends smddp,gloo
    torchrun --standalone --nproc-per-node 1 benchmarks/latency.py --device cuda --backends smddp,nccl \
        --profile smddp-calls.txt
    torchrun --standalone --nproc-per-node 2 benchmarks/latency.py --op pingpong --profile p2p.txt
    torchrun --standalone --nproc-per-node 1 benchmarks/latency.py --device cuda --backends smddp,nccl \
        --op all_reduce,all_gather --modes sync,async --calls 4000

A backend may carry settings for its group: ``--backends smddp:SMDDP_TRANSPORT=gloo:SMDDP_CHECK_COLLECTIVES=0,gloo``.
Under mpiexec, ``mpi4py`` as a backend times MPI's own calls on the same buffers (``Allreduce``,
``Allgather``, ``Barrier``, ``Send``/``Recv``; no process group), the floor the others are held to:

    mpiexec -n 2 python benchmarks/latency.py --backends mpi4py,smddp:SMDDP_TRANSPORT=shm,gloo --bytes 8
``--op pingpong`` times round trips between ranks 0 and 1 (rank 0 sends, rank 1 sends back;
other ranks wait at the end); ``--op barrier`` times barriers (``--bytes`` is then unused).
``--modes sync,async`` times each op both ways: a blocking call, and ``async_op=True`` then
``wait()`` (which on CUDA returns once the caller's stream waits for the collective).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import os
import pstats
import time

import torch
import torch.distributed as dist

import smddp_lite


OPS = ("all_reduce", "all_gather", "barrier", "pingpong")
MPI_DIRECT = "mpi4py"  # MPI's own calls, no process group (see the module's docstring)


def _mpi_call(op: str, mode: str, tensor: torch.Tensor, gathered: torch.Tensor) -> None:
    """``op`` as MPI's own call on the tensors' memory (CPU only), blocking or started and waited."""
    from mpi4py import MPI

    comm, data, out = MPI.COMM_WORLD, tensor.numpy(), gathered.numpy()
    if op == "all_reduce":
        if mode == "async":
            comm.Iallreduce(MPI.IN_PLACE, data, op=MPI.SUM).Wait()
        else:
            comm.Allreduce(MPI.IN_PLACE, data, op=MPI.SUM)
    elif op == "all_gather":
        if mode == "async":
            comm.Iallgather(data, out).Wait()
        else:
            comm.Allgather(data, out)
    elif op == "barrier":
        if mode == "async":
            comm.Ibarrier().Wait()
        else:
            comm.Barrier()
    elif comm.Get_rank() == 0:
        comm.Send(data, 1)
        comm.Recv(data, 1)
    elif comm.Get_rank() == 1:
        comm.Recv(data, 0)
        comm.Send(data, 0)


def profile_table(profile: cProfile.Profile, calls: int, what: str, rows: int = 45) -> str:
    """The functions that took the most time of their own, in microseconds per collective call
    (cProfile's own table rounds to milliseconds per function call, which hides all of this)."""
    stats = pstats.Stats(profile).stats  # (file, line, name) -> (primitive calls, calls, own s, total s, callers)
    lines = [f"# {calls} {what}, under cProfile (which slows every Python call alike)",
             f"# {'own us':>8} {'total us':>9} {'calls':>6}  function (per collective call)"]
    for (file, line, name), (_, n, own, total, _) in sorted(stats.items(), key=lambda kv: -kv[1][2])[:rows]:
        place = f"{os.path.relpath(file) if file.startswith('/') else file}:{line}({name})"
        lines.append(f"  {own / calls * 1e6:8.2f} {total / calls * 1e6:9.2f} {n / calls:6.1f}  {place}")
    return "\n".join(lines) + "\n"


def _backend_and_settings(entry: str) -> tuple[str, dict[str, str]]:
    """``smddp:SMDDP_TRANSPORT=gloo:SMDDP_CHECK_COLLECTIVES=0`` -> ("smddp", {those variables})."""
    backend, *pairs = entry.split(":")
    settings = dict(pair.split("=", 1) for pair in pairs if "=" in pair)
    if len(settings) != len(pairs):
        raise SystemExit(f"--backends: {entry!r}: expected BACKEND[:VARIABLE=VALUE...]")
    return backend, settings


@contextlib.contextmanager
def _environment(settings: dict[str, str]):
    saved = {k: os.environ.get(k) for k in settings}
    os.environ.update(settings)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="smddp,gloo")
    parser.add_argument("--bytes", type=int, default=256, help="message size (float32)")
    parser.add_argument("--calls", type=int, default=3000, help="timed calls per backend")
    parser.add_argument("--rounds", type=int, default=6, help="alternations between backends")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--profile", metavar="PATH",
                        help="write a cProfile of the calls of the first torch.distributed backend here")
    parser.add_argument("--op", default="all_reduce",
                        help="what one timed call is, comma-separated for several: all_reduce, all_gather "
                             "(all_gather_into_tensor), barrier, or pingpong (a send/recv round trip between "
                             "ranks 0 and 1)")
    parser.add_argument("--modes", default="sync",
                        help="sync (async_op=False), async (async_op=True, then wait()), or both: sync,async")
    args = parser.parse_args()

    backends = args.backends.split(",")
    for entry in backends:
        _backend_and_settings(entry)  # a malformed entry fails before any group starts
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)  # before init, so NCCL-like backends bind this GPU
    settle = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if all(_backend_and_settings(entry)[0] == MPI_DIRECT for entry in backends):
        raise SystemExit(f"--backends: name a torch.distributed backend beside {MPI_DIRECT} (it makes the job's group)")
    if MPI_DIRECT in (_backend_and_settings(entry)[0] for entry in backends) and args.device != "cpu":
        raise SystemExit(f"--backends: {MPI_DIRECT} times CPU buffers only (--device cpu)")
    groups = {}
    for entry in backends:
        backend, settings = _backend_and_settings(entry)
        if backend == MPI_DIRECT:
            groups[entry] = MPI_DIRECT
            continue
        with _environment(settings):  # smddp reads its SMDDP_* settings as each group starts
            if not dist.is_initialized():
                smddp_lite.init(backend=backend)
                groups[entry] = dist.group.WORLD
            else:
                groups[entry] = dist.new_group(backend=backend)
    tensor = torch.ones(max(1, args.bytes // 4), device=device)
    gathered = torch.empty(tensor.numel() * dist.get_world_size(), device=device)
    ops_ = args.op.split(",")
    modes = args.modes.split(",")
    for name in ops_:
        if name not in OPS:
            raise SystemExit(f"--op: {name!r} is not one of {', '.join(OPS)}")
    for mode in modes:
        if mode not in ("sync", "async"):
            raise SystemExit(f"--modes: {mode!r} is not sync or async")
    if "pingpong" in ops_ and dist.get_world_size() < 2:
        raise SystemExit("--op pingpong needs at least 2 ranks")
    rank = dist.get_rank()

    def call(op: str, mode: str, group) -> None:
        if group is MPI_DIRECT:
            return _mpi_call(op, mode, tensor, gathered)
        async_op = mode == "async"
        if op == "all_reduce":
            work = dist.all_reduce(tensor, group=group, async_op=async_op)
        elif op == "all_gather":
            work = dist.all_gather_into_tensor(gathered, tensor, group=group, async_op=async_op)
        elif op == "barrier":
            work = dist.barrier(group=group, async_op=async_op)
        elif rank == 0:
            dist.send(tensor, 1, group=group)
            dist.recv(tensor, 1, group=group)
            work = None
        elif rank == 1:
            dist.recv(tensor, 0, group=group)
            dist.send(tensor, 0, group=group)
            work = None
        if async_op and work is not None:
            work.wait()

    cases = [(op, mode) for op in ops_ for mode in (modes if op != "pingpong" else ["sync"])]
    samples: dict[tuple[str, str, str], list[float]] = {(op, mode, b): [] for op, mode in cases for b in backends}
    for op, mode in cases:
        for _ in range(args.rounds):
            for backend, group in groups.items():
                for _ in range(50):  # warm-up after switching
                    call(op, mode, group)
                settle()
                times = samples[(op, mode, backend)]
                for _ in range(args.calls // args.rounds):
                    start = time.perf_counter()
                    call(op, mode, group)
                    times.append(time.perf_counter() - start)
                settle()
    if args.profile:
        op, mode = cases[0]
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(args.calls // args.rounds):
            call(op, mode, dist.group.WORLD)  # the job's group: the first torch.distributed backend's
        settle()
        profile.disable()
        if dist.get_rank() == 0:
            with open(args.profile, "w") as f:
                f.write(profile_table(profile, args.calls // args.rounds, f"{mode} {op} calls of {next(b for b, g in groups.items() if g is dist.group.WORLD)} "
                                      f"on {device}, rank 0"))
    dist.barrier()  # ranks other than 0 and 1 had nothing to time in a ping-pong
    if dist.get_rank() == 0:
        size = f"{tensor.numel() * 4} B float32"
        print(f"# {dist.get_world_size()} ranks ({device.type}), {args.calls} calls per backend and case in "
              f"{args.rounds} alternating rounds (rank 0's view); all_gather is all_gather_into_tensor of {size} "
              f"per rank, all_reduce of {size}, pingpong a send/recv round trip between ranks 0 and 1; async: "
              "async_op=True, then wait()")
        width = max(8, *map(len, backends))
        print(f"# {'op':<10} {'mode':<5} {'backend':<{width}} {'p50 us':>8} {'p90 us':>8} {'p99 us':>8} "
              f"{'max us':>8} {'mean us':>8}")
        for (op, mode, backend), values in samples.items():
            us = torch.tensor(values, dtype=torch.float64) * 1e6
            q = [float(us.quantile(p)) for p in (0.5, 0.9, 0.99)]
            print(f"  {op:<10} {mode:<5} {backend:<{width}} {q[0]:8.1f} {q[1]:8.1f} {q[2]:8.1f} "
                  f"{float(us.max()):8.1f} {float(us.mean()):8.1f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
