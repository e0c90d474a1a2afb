"""Programs that run on every rank of a test job (see harness.py); each returns what it observed."""

from __future__ import annotations

import contextlib
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

import smddp_lite
from smddp_lite.backend.ops import RedOp
from smddp_lite.backend.signatures import signature


def _error_of(fn) -> dict:
    """Run ``fn``; return the exception it raised (type, message, seconds until it raised)."""
    start = time.monotonic()
    try:
        fn()
    except Exception as exc:
        return {"type": type(exc).__name__, "message": str(exc), "seconds": time.monotonic() - start,
                "backend_error": isinstance(exc, dist.DistBackendError),
                "classes": [c.__name__ for c in type(exc).__mro__]}
    return {"type": None, "message": "", "seconds": time.monotonic() - start, "backend_error": False}


def _still_works() -> bool:
    t = torch.ones(5)
    dist.all_reduce(t)
    return bool((t == dist.get_world_size()).all())


def bad_input() -> dict:
    """Every kind of bad input a rank can pass, on every rank; the group stays usable after each."""
    smddp_lite.init()
    cases = {
        "dtype": lambda: dist.all_reduce(torch.ones(3, dtype=torch.float8_e4m3fn)),
        "device": lambda: dist.all_reduce(torch.ones(3, device="meta")),
        "quantized": lambda: dist.broadcast(torch.quantize_per_tensor(torch.ones(3), 0.5, 0, torch.qint8), src=0),
        "sparse": lambda: dist.all_reduce(torch.ones(3).to_sparse()),
        "avg_bool": lambda: dist.all_reduce(torch.ones(3, dtype=torch.bool), op=dist.ReduceOp.AVG),
        "bitwise_float": lambda: dist.all_reduce(torch.ones(3), op=dist.ReduceOp.BAND),
        "premul_sum": lambda: dist.all_reduce(torch.ones(3), op=dist._make_nccl_premul_sum(torch.tensor(2))),
        "premul_sum_int": lambda: dist.all_reduce(torch.ones(3, dtype=torch.int32), op=dist.ReduceOp.PREMUL_SUM(2.0)),
        "gather_size": lambda: dist.all_gather_into_tensor(torch.empty(5), torch.ones(3)),
        "scatter_size": lambda: dist.reduce_scatter_tensor(torch.empty(3), torch.ones(5)),
        "list_count": lambda: dist.all_gather([torch.empty(3)], torch.ones(3)),
        "root": lambda: dist.broadcast(torch.ones(3), src=dist.get_world_size() + 4),
        "recv_any_source": lambda: dist.recv(torch.ones(3)),
        "lazy_negative": lambda: dist.all_reduce(torch.tensor([1 + 2j]).conj().imag),
        "send_tag": lambda: dist.send(torch.ones(3), dst=(dist.get_rank() + 1) % dist.get_world_size(), tag=-1),
        "split_sum": lambda: dist.all_to_all_single(torch.empty(4), torch.ones(4), input_split_sizes=[1, 2]),
        "split_count": lambda: dist.all_to_all_single(torch.empty(4), torch.ones(4), output_split_sizes=[4]),
        "all_to_all_count": lambda: dist.all_to_all([torch.empty(3)], [torch.ones(3)]),
        "all_gather_own_size": lambda: dist.all_gather([torch.empty(3), torch.empty(4)], torch.ones(2)),
    }
    report = {}
    for name, fn in cases.items():
        report[name] = _error_of(fn)
        report[name]["usable_after"] = _still_works()
    dist.destroy_process_group()
    return report


def mismatch(kind: str) -> dict:
    """Ranks disagree on the size, dtype or op of one call: every rank must raise, promptly."""
    smddp_lite.init(timeout=timedelta(seconds=60))
    rank, last = dist.get_rank(), dist.get_world_size() - 1
    premul_input = torch.ones(10 + rank)  # PREMUL_SUM scales it in place, once the call goes ahead
    calls = {
        "size": lambda: dist.all_reduce(torch.ones(10 + rank)),
        # on hosts of two ranks, ranks of one host whose shares of the call inside it are the same
        "host_share_size": lambda: dist.all_reduce(torch.ones(100_000 - rank % 2)),
        "premul_all_reduce_size": lambda: dist.all_reduce(premul_input, op=dist.ReduceOp.PREMUL_SUM(2.0)),
        "premul_reduce_size": lambda: dist.reduce(premul_input, dst=0, op=dist.ReduceOp.PREMUL_SUM(2.0)),
        "dtype": lambda: dist.all_reduce(torch.ones(10, dtype=torch.float32 if rank == 0 else torch.float64)),
        "op": lambda: dist.all_reduce(torch.ones(10)) if rank == 0 else dist.broadcast(torch.ones(10), src=0),
        # the last rank float8, the others uint8: the same bytes, which shm moves as such; its
        # headers must still differ
        "moved_dtype": lambda: dist.all_gather_into_tensor(
            torch.empty(8 * dist.get_world_size(), dtype=torch.float8_e4m3fn if rank == last else torch.uint8),
            torch.zeros(8, dtype=torch.float8_e4m3fn if rank == last else torch.uint8)),
        # outputs of different sizes: rank 0 expects 4 elements from rank 1, which sends 5
        "all_gather_sizes": lambda: dist.all_gather([torch.empty(3), torch.empty(4 if rank == 0 else 5)],
                                                    torch.ones(3 if rank == 0 else 5)),
        # rank 0's outputs all match its input (the equal path); rank 1 expects 9 from it (the
        # uneven path), and its exchange of sizes (2 x 2 + 2 elements a rank on 2 ranks) is an
        # int64 all_gather as long as rank 0's
        "all_gather_paths": lambda: dist.all_gather(
            [torch.empty(6, dtype=torch.int64), torch.empty(6, dtype=torch.int64)] if rank == 0
            else [torch.empty(9, dtype=torch.int64), torch.empty(6, dtype=torch.int64)],
            torch.arange(6)),
    }
    report = _error_of(calls[kind])
    report["usable_after"] = _usable_after_error()
    report["premul_input_after"] = sorted(set(premul_input.tolist()))
    return report


# calls that differ between ranks in a way that leaves them waiting for each other (rather than
# pairing, or aborting the process as gloo does on sizes that differ): every rank must raise
# CollectiveMismatchError within seconds, without SMDDP_CHECK_COLLECTIVES. ``odd``: whether
# this rank makes the other call.
WAITING_MISMATCHES = {
    "op": lambda odd: dist.broadcast(torch.ones(10), src=0) if odd else dist.all_reduce(torch.ones(10)),
    # a collective that only some ranks call (logging under ``if rank == 0:``)
    "extra_call": lambda odd: (None if odd else dist.all_reduce(torch.ones(1)), dist.barrier()),
    # the last rank and rank 0: on hosts of the hierarchical transport, roots on two hosts, whose
    # ranks all send between hosts and none receives
    "root": lambda odd: dist.broadcast(torch.ones(10), src=dist.get_world_size() - 1 if odd else 0),
    # split sizes passed on some ranks only: those take the uneven path, the others the equal one
    "all_to_all_splits": lambda odd: dist.all_to_all_single(
        torch.empty(2 * dist.get_world_size()), torch.ones(2 * dist.get_world_size()),
        *(() if odd else ([2] * dist.get_world_size(), [2] * dist.get_world_size()))),
}


def mismatch_that_waits(kind: str, odd_ranks: list[int], late_rank: int = -1, late_s: float = 0.0) -> dict:
    """The ranks in ``odd_ranks`` make the other call of ``kind`` (WAITING_MISMATCHES);
    ``late_rank`` makes its call ``late_s`` after its peers (after they found the mismatch)."""
    smddp_lite.init(timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    if rank == late_rank:
        time.sleep(late_s)
    report = _error_of(lambda: WAITING_MISMATCHES[kind](rank in odd_ranks))
    report["usable_after"] = _usable_after_error()
    return report


def sizes_differ_on_gloo() -> dict:
    """Rank 0 all-reduces 10 elements and rank 1 eleven, without SMDDP_CHECK_COLLECTIVES: gloo
    aborts rank 0 (it received more than it posted); rank 1 reports its call and the next one."""
    smddp_lite.init(timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    report = {"call": _error_of(lambda: dist.all_reduce(torch.ones(10 + rank)))}
    report["next"] = _usable_after_error()
    return report


def slow_rank_matching_calls(slow_s: float = 1.4) -> dict:
    """The last rank makes each call ``slow_s`` after its peers, so they wait in it long enough to
    compare signatures through the store; the calls match, so every one must complete, with the
    right values. A call of two dtypes runs two steps; an uneven all_to_all gathers its sizes
    first."""
    smddp_lite.init(timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    slow = rank == world - 1

    def arrive() -> None:
        if slow:
            time.sleep(slow_s)

    start = time.monotonic()
    arrive()
    two_dtypes = [torch.full((3,), float(rank)), torch.full((2,), float(rank), dtype=torch.float64)]
    # the process group's own method takes a list of tensors (torch's dist.all_reduce takes one)
    dist.distributed_c10d._get_default_group().allreduce(two_dtypes).wait()
    arrive()
    rooted = torch.full((4,), float(rank))
    dist.broadcast(rooted, src=world - 1)
    arrive()
    # rank p sends p + 1 elements to every rank
    received = torch.empty(sum(p + 1 for p in range(world)))
    dist.all_to_all_single(received, torch.full(((rank + 1) * world,), float(rank)),
                           output_split_sizes=[p + 1 for p in range(world)], input_split_sizes=[rank + 1] * world)
    arrive()
    dist.barrier()
    report = {"sums": [t.tolist() for t in two_dtypes], "broadcast": rooted.tolist(), "received": received.tolist(),
              "seconds": time.monotonic() - start}
    dist.destroy_process_group()
    return report


def _usable_after_error() -> bool | str:
    """Whether the group still works after the error just raised (an all_reduce gives the sum),
    or the error that its next call raised."""
    try:
        return _still_works()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


def uneven_splits_disagree() -> dict:
    """Rank 0 expects other block sizes than rank 1 sends it (an uneven all_to_all_single):
    every rank must raise saying which, before any data moves, on every transport. Every rank
    found it in the same table, so the group must go on: an all_reduce, and then the uneven
    all_to_all with sizes that agree, must give the right results."""
    smddp_lite.init(timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    output = torch.empty(4 if rank == 0 else 3)
    report = _error_of(lambda: dist.all_to_all_single(
        output, torch.ones(3 + rank), output_split_sizes=[1, 3] if rank == 0 else [2, 1],
        input_split_sizes=[1, 2] if rank == 0 else [2, 2]))
    report["usable_after"] = _usable_after_error()
    # rank 0 sends [1, 2] (values 0, 1, 2), rank 1 sends [3, 1] (values 10..13)
    sent = torch.arange(3.0) if rank == 0 else torch.arange(10.0, 14.0)
    splits_in, splits_out = ([1, 2], [1, 3]) if rank == 0 else ([3, 1], [2, 1])
    received = torch.empty(sum(splits_out))
    dist.all_to_all_single(received, sent, output_split_sizes=splits_out, input_split_sizes=splits_in)
    report["agreed_after"] = received.tolist()
    dist.destroy_process_group()
    return report


def _reduce_scatter(dtype: torch.dtype = torch.float32) -> None:
    dist.reduce_scatter_tensor(torch.empty(3, dtype=dtype), torch.ones(3 * dist.get_world_size(), dtype=dtype))


# ops that only move data take any dtype: their refusals below are of tensors on the meta device
def _gather(device: str) -> None:
    n = dist.get_world_size()
    dist.gather(torch.ones(3, device=device), [torch.empty(3, device=device) for _ in range(n)]
                if dist.get_rank() == 0 else None, dst=0)


def _uneven_all_to_all(device: str) -> None:
    n = dist.get_world_size()
    dist.all_to_all_single(torch.empty(n * 2, device=device), torch.ones(n * 2, device=device),
                           [1, 3] + [2] * (n - 2), [1, 3] + [2] * (n - 2))


REFUSED_CALLS = {  # kind: (the call every other rank makes, the call the refusing rank makes)
    # refused by the tensor checks
    "dtype": (lambda: dist.all_reduce(torch.ones(3)), lambda: dist.all_reduce(torch.ones(3, dtype=torch.float8_e4m3fn))),
    # refused while reading the reduce op, before the checks
    "op": (lambda: dist.all_reduce(torch.ones(3)),
           lambda: dist.all_reduce(torch.ones(3), op=dist._make_nccl_premul_sum(torch.tensor(2)))),
    # the others wait in a reduce_scatter
    "reduce_scatter": (_reduce_scatter, lambda: _reduce_scatter(torch.float8_e4m3fn)),
    # the others wait in a gather (its own steps on shm, Igather on MPI)
    "gather": (lambda: _gather("cpu"), lambda: _gather("meta")),
    # the others wait in an uneven all_to_all's exchange of split sizes
    "all_to_all_uneven": (lambda: _uneven_all_to_all("cpu"), lambda: _uneven_all_to_all("meta")),
}


def _stay_until_peers_report(store, peers) -> None:
    """Keep this rank alive until each of ``peers`` set ``test-reported/<rank>``: the peers must
    learn of this rank's refusal from the group, not from its sockets closing as it exits.
    Polls: a blocking ``wait`` would hold the store client, which the communication thread
    needs to post the refusal (a TCPStore client serves one request at a time)."""
    keys = [f"test-reported/{r}" for r in peers]
    deadline = time.monotonic() + 60
    while not store.check(keys) and time.monotonic() < deadline:
        time.sleep(0.01)


def one_rank_refuses(retry: bool = False, kind: str = "dtype", peers_late: str | None = None) -> dict:
    """The last rank makes a call the backend refuses (``REFUSED_CALLS[kind]``) while the others
    wait inside theirs (after a call that works, so each transport is past its first, lazily
    connecting, call). With ``retry`` it then calls again at once with good input, as a script
    that catches the error and goes on does: that call must raise too, not pair with the call
    the others left. With ``peers_late`` (a path) the others enter the call only once the refuser
    retries, which it says by making that file: they first see a peer in another call."""
    smddp_lite.init(timeout=timedelta(seconds=60))
    dist.all_reduce(torch.ones(3))
    rank, refuser = dist.get_rank(), dist.get_world_size() - 1
    if peers_late:
        return _refused_before_peers_arrive(rank, refuser, REFUSED_CALLS[kind], Path(peers_late))
    # The others say when they start the call, and the refuser waits for that and then a while:
    # a peer that had not started it when the refusal came would refuse it too, rightly letting the
    # refuser's retry go on, and a plain half-second sleep let that happen on a loaded machine.
    store = dist.distributed_c10d._get_default_store()
    if rank == refuser:
        store.wait([f"test-inside/{r}" for r in range(refuser)])
        time.sleep(0.5)  # the others are inside the call by now
    else:
        store.set(f"test-inside/{rank}", "1")
    waits, refuses = REFUSED_CALLS[kind]
    error = _error_of(refuses if rank == refuser else waits)
    if rank == refuser:
        if retry:
            error["retry"] = _error_of(lambda: dist.all_reduce(torch.ones(3)))
        _stay_until_peers_report(store, range(refuser))
    else:
        store.set(f"test-reported/{rank}", "1")
    return error


def _refused_before_peers_arrive(rank: int, refuser: int, calls, flag: Path) -> dict:
    # a file says the refusal happened, not the store: the refuser's store client is busy
    # posting the refusal and waiting for its peers' outcome (a client serves one request at a time)
    store = dist.distributed_c10d._get_default_store()
    waits, refuses = calls
    if rank == refuser:
        error = _error_of(refuses)
        flag.touch()
        error["retry"] = _error_of(lambda: dist.all_reduce(torch.ones(3)))
        _stay_until_peers_report(store, range(refuser))
        return error
    deadline = time.monotonic() + 60
    while not flag.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)  # the refuser's retry is published by now
    error = _error_of(waits)
    store.set(f"test-reported/{rank}", "1")
    return error


def rooted_call_refused(op: str = "broadcast") -> dict:
    """The last rank refuses a broadcast or scatter from rank 0, whose part on some other ranks
    ends without it (MPI's root sends a small message without waiting; gloo's tree reaches some
    ranks without it). Then every rank all-reduces. Each rank's first error of the two calls,
    and the seconds both took: the group must be failed on every rank, well before the 60 s timeout."""
    smddp_lite.init(timeout=timedelta(seconds=60))
    dist.all_reduce(torch.ones(3))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = "meta" if rank == world - 1 else "cpu"
    calls = {
        "broadcast": lambda: dist.broadcast(torch.ones(3, device=device), src=0),
        "scatter": lambda: dist.scatter(torch.empty(3, device=device),
                                        [torch.ones(3) for _ in range(world)] if rank == 0 else None, src=0),
    }
    started = time.monotonic()
    report = _error_of(calls[op])
    if report["type"] is None:
        report = _error_of(lambda: dist.all_reduce(torch.ones(3)))
    report["seconds"] = time.monotonic() - started
    store = dist.distributed_c10d._get_default_store()
    if rank == world - 1:
        report["next"] = _error_of(lambda: dist.all_reduce(torch.ones(3)))["message"]
        _stay_until_peers_report(store, range(world - 1))
    else:
        store.set(f"test-reported/{rank}", "1")
    return report


def peer_dies() -> dict:
    """Rank 1 exits abruptly; rank 0's next collective must raise naming it, well before the
    timeout. Its call after that is refused (the group failed), and destroying the group then
    must neither wait for the dead rank nor leave the communication thread behind."""
    import threading

    smddp_lite.init(timeout=timedelta(seconds=120))
    dist.barrier()
    if dist.get_rank() == 1:
        os._exit(3)
    report = _error_of(lambda: dist.all_reduce(torch.ones(1000)))
    # refused at the call now that the group failed: still the DistBackendError type a retry
    # loop catches, as for a call made before the failure was found (and for a send, alike)
    report["next_call"] = _error_of(lambda: dist.all_reduce(torch.ones(10)))
    report["send_after"] = _error_of(lambda: dist.send(torch.ones(10), 1))
    start = time.monotonic()
    dist.destroy_process_group()
    report["destroy_seconds"] = time.monotonic() - start
    report["threads_after"] = [t.name for t in threading.enumerate() if t.name.startswith("smddp-comm")]
    return report


def mpi_peer_dies(reported: str) -> dict | None:
    """Under mpiexec -disable-auto-cleanup (the launcher lets the survivors live), the last rank
    exits abruptly; the others' next collective must raise naming it within seconds, not at the
    group's 120 s timeout. Each survivor then makes a file in the folder ``reported`` and waits
    for the others' (a survivor that left sooner would be a second death for the others to see),
    and leaves without MPI_Finalize, which would wait for the dead rank."""
    smddp_lite.init(timeout=timedelta(seconds=120))
    dist.barrier()
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == world - 1:
        os._exit(3)
    report = _error_of(lambda: dist.all_reduce(torch.ones(1000)))
    (Path(reported) / str(rank)).touch()
    deadline = time.monotonic() + 30
    while len(list(Path(reported).iterdir())) < world - 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    os.environ["TEST_SKIP_MPI_FINALIZE"] = "1"  # read by worker.py once this report is written
    return report


def rank_0_killed_while_others_map() -> dict | None:
    """Rank 0 publishes a shared-memory segment and is SIGKILLed while it waits for the others to
    map it (rank 1 comes a second late). Its name must not stay in /dev/shm: the last rank to map
    it removes it. Rank 1 then raises, naming rank 0; it reports its error. The segment is made
    directly, on a group of gloo's (init would line the ranks up before it)."""
    import glob
    import signal
    import threading

    from smddp_lite.backend.transports.shm_segment import ShmSegment

    smddp_lite.init(timeout=timedelta(seconds=20))  # under SMDDP_TRANSPORT=gloo: no segment of its own
    rank = dist.get_rank()
    store = dist.PrefixStore("segment-test", dist.distributed_c10d._get_default_store())
    if rank == 0:
        mine = f"/dev/shm/smddp-*-{os.getpid()}-*"

        def kill_once_published() -> None:
            while not glob.glob(mine):
                time.sleep(0.005)
            time.sleep(0.2)  # inside its wait for rank 1 by now
            os.kill(os.getpid(), signal.SIGKILL)

        threading.Thread(target=kill_once_published, daemon=True).start()
    else:
        time.sleep(1.0)
    return _error_of(lambda: ShmSegment(store, rank, 2, 4096, timedelta(seconds=20)))


def peer_stuck() -> dict:
    """Rank 1 never calls the collective; rank 0 raises once the group's 3 s timeout passes."""
    smddp_lite.init(timeout=timedelta(seconds=3))
    dist.barrier()
    store = dist.distributed_c10d._get_default_store()
    if dist.get_rank() == 1:  # alive, and out of the call, until rank 0 has raised (12 s at most)
        with contextlib.suppress(dist.DistStoreError):
            store.wait(["peer_stuck/raised"], timedelta(seconds=12))
        os._exit(0)
    error = _error_of(lambda: dist.all_reduce(torch.ones(1000)))
    store.set("peer_stuck/raised", "1")
    return error


def ddp_peer_dies(die_after_forward: int = 2, device: str = "cpu") -> dict:
    """Rank 1 exits abruptly between its forward and backward pass of a DDP step; the other ranks'
    backward, whose gradient all_reduce DDP's reducer takes through the work's future, must raise
    naming it (a future completed with the error as its value made the reducer crash instead).
    ``device="cuda"``: every rank on cuda:0 (the staged path allows that), through CudaWork."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    if device == "cuda":
        torch.cuda.set_device(0)
    smddp_lite.init(timeout=timedelta(seconds=120))
    model = DDP(torch.nn.Linear(256, 256).to(device))
    for step in range(die_after_forward + 1):
        loss = model(torch.randn(8, 256, device=device)).sum()
        if step == die_after_forward:
            if dist.get_rank() == 1:
                os._exit(3)
            return _error_of(loss.backward)
        loss.backward()
    raise AssertionError("unreachable")


def large_messages(numel: int) -> dict:
    """A broadcast, all_reduce and all_gather of ``numel`` float32 each, large enough that MPICH
    would copy them between ranks of a host with process_vm_readv: whether each result is exact
    (until the first error), the error, and MPICH's cross-memory-attach setting as the rank saw it."""
    smddp_lite.init(timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    expected = torch.arange(numel, dtype=torch.float32)
    exact = {}

    def run() -> None:
        b = expected.clone() if rank == 0 else torch.zeros(numel)
        dist.broadcast(b, 0)
        exact["broadcast"] = bool(torch.equal(b, expected))
        a = torch.full((numel,), float(rank + 1))
        dist.all_reduce(a)
        exact["all_reduce"] = bool((a == world * (world + 1) / 2).all())
        g = torch.empty(world * numel)
        dist.all_gather_into_tensor(g, torch.full((numel,), float(rank)))
        exact["all_gather"] = bool((g.view(world, numel) == torch.arange(world, dtype=torch.float32)[:, None]).all())

    error = _error_of(run)
    return {"exact": exact, "error": error, "cma": os.environ.get("MPIR_CVAR_CH4_CMA_ENABLE")}


def init_only() -> dict:
    """Start the default group (its transport's setup included) and report the error, if any."""
    return _error_of(lambda: smddp_lite.init(timeout=timedelta(seconds=60)))


def after_destroy() -> dict:
    smddp_lite.init()
    group = dist.group.WORLD
    dist.destroy_process_group()
    return {
        "module_api": _error_of(lambda: dist.all_reduce(torch.ones(3))),
        "stale_handle": _error_of(lambda: group.allreduce([torch.ones(3)]).wait()),
    }


def _parity_model() -> torch.nn.Module:
    """The small MLP the parity programs train, the same weights on every rank and call."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(33, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64),
                               torch.nn.ReLU(), torch.nn.Linear(64, 5))


def _train_side_by_side(variants: dict, rank: int, steps: int, momentum: float = 0.9,
                        before_step: Callable[[str, torch.nn.Module], None] | None = None) -> dict[str, list[float]]:
    """Train each of ``variants`` (name: model) with its own SGD on the same batches; returns
    each one's losses. ``before_step(name, model)`` runs between backward and step."""
    optims = {k: torch.optim.SGD(m.parameters(), lr=0.05, momentum=momentum) for k, m in variants.items()}
    losses = {k: [] for k in variants}
    for x, y in _parity_batches(rank, steps):
        for name, model in variants.items():
            optims[name].zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            if before_step is not None:
                before_step(name, model)
            optims[name].step()
            losses[name].append(loss.item())
    return losses


def _parity_batches(rank: int, steps: int):
    """``steps`` batches of 16 samples, each rank its own shard of data, labelled by a fixed
    random teacher (a learnable task)."""
    teacher = torch.randn(33, 5, generator=torch.Generator().manual_seed(7))
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        x = torch.randn(16, 33, generator=gen)
        yield x, (x @ teacher).argmax(1)


def _let_gloo_workers_finish() -> None:
    """Call before freeing what holds torch's own gloo group (a DDP, FSDP or pipeline model over
    it, or destroying the groups). Its worker thread frees a finished call's tensors after the
    wait returns and needs the GIL for it, while freeing the group (~ProcessGroupGloo) joins that
    thread holding the GIL: under load (1 run in about 25) a rank hung there at a program's
    return (py-spy). Sleeping lets the worker run first. A deadlock inside torch, not smddp."""
    time.sleep(0.1)


def ddp_parity(steps: int = 12) -> dict:
    """The same model trained with DDP on "smddp" and on "gloo", side by side in one job."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    smddp_lite.init()
    rank = dist.get_rank()
    gloo = dist.new_group(backend="gloo")

    variants = {
        "smddp": DDP(_parity_model(), process_group=dist.group.WORLD, bucket_cap_mb=0.01),
        "gloo": DDP(_parity_model(), process_group=gloo, bucket_cap_mb=0.01),
        "smddp_fp16_hook": DDP(_parity_model(), process_group=dist.group.WORLD, bucket_cap_mb=0.01),
        "gloo_fp16_hook": DDP(_parity_model(), process_group=gloo, bucket_cap_mb=0.01),
    }
    variants["smddp_fp16_hook"].register_comm_hook(dist.group.WORLD, default_hooks.fp16_compress_hook)
    variants["gloo_fp16_hook"].register_comm_hook(gloo, default_hooks.fp16_compress_hook)
    optims = {k: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for k, m in variants.items()}
    losses = {k: [] for k in variants}
    for step, (x, y) in enumerate(_parity_batches(rank, steps)):
        for name, ddp in variants.items():
            optims[name].zero_grad()
            if step % 4 == 3:  # gradient accumulation: one micro-batch under no_sync
                with ddp.no_sync():
                    torch.nn.functional.cross_entropy(ddp(x[:8]), y[:8]).backward()
                x_step, y_step = x[8:], y[8:]
            else:
                x_step, y_step = x, y
            loss = torch.nn.functional.cross_entropy(ddp(x_step), y_step)
            loss.backward()
            optims[name].step()
            losses[name].append(loss.item())

    def max_diff(a: str, b: str) -> float:
        pa, pb = variants[a].parameters(), variants[b].parameters()
        return max(float((p - q).abs().max()) for p, q in zip(pa, pb))

    result = {
        "plain": max_diff("smddp", "gloo"),
        "fp16_hook": max_diff("smddp_fp16_hook", "gloo_fp16_hook"),
        "losses": losses["smddp"],
    }
    _let_gloo_workers_finish()
    dist.destroy_process_group()
    return result


def ddp_powersgd_parity(steps: int = 12) -> dict:
    """DDP with torch's PowerSGD hook on "smddp" and on "gloo", side by side in one job. The
    hook's future callbacks all-reduce P and then Q and wait for each inside the callback, which
    runs on the thread that completed the first all_reduce: smddp's communication thread."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    smddp_lite.init(timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    gloo = dist.new_group(backend="gloo")
    variants = {"smddp": DDP(_parity_model(), process_group=dist.group.WORLD),
                "gloo": DDP(_parity_model(), process_group=gloo)}
    for name, group in (("smddp", dist.group.WORLD), ("gloo", gloo)):
        # compression from the third step on; every matrix compressed (min_compression_rate 0)
        state = powerSGD_hook.PowerSGDState(process_group=group, matrix_approximation_rank=2, start_powerSGD_iter=2,
                                            min_compression_rate=0.0, use_error_feedback=True)
        variants[name].register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    losses = _train_side_by_side(variants, rank, steps, momentum=0.0)
    diff = max(float((p - q).abs().max()) for p, q in zip(variants["smddp"].parameters(),
                                                          variants["gloo"].parameters()))
    _let_gloo_workers_finish()
    dist.destroy_process_group()
    return {"max_diff": diff, "losses": losses["smddp"], "gloo_losses": losses["gloo"]}


def _freed(ref) -> bool:
    """Whether ``ref``'s tensor is freed within 2 s: the communication thread lets go of a call
    just after its waiters (and future callbacks) are released, so it may take a moment."""
    deadline = time.monotonic() + 2.0
    while ref() is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    return ref() is None


def tensors_freed_after_calls() -> dict:
    """Whether each call's tensors are freed once the caller drops them and the Work, with the
    cyclic garbage collector off (a long training loop rarely runs it): a plain all_reduce, one
    whose future was asked for (DDP asks for every bucket's), and a send / recv. True: freed."""
    import gc
    import weakref

    smddp_lite.init(timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    gc.collect()
    gc.disable()
    try:
        freed = {}
        t = torch.ones(1000)
        ref = weakref.ref(t)
        dist.all_reduce(t)
        del t
        freed["all_reduce"] = _freed(ref)
        t = torch.ones(1000)
        ref = weakref.ref(t)
        work = dist.all_reduce(t, async_op=True)
        work.get_future().then(lambda f: f.value()).wait()
        del t, work
        freed["all_reduce_future"] = _freed(ref)
        t = torch.ones(1000)
        ref = weakref.ref(t)
        dist.send(t, 1) if rank == 0 else dist.recv(t, 0)
        del t
        freed["send_recv"] = _freed(ref)
    finally:
        gc.enable()
    dist.destroy_process_group()
    return freed


def checkpoint_paths(directory: str) -> dict:
    """torch's checkpoint code asks the group which devices it serves: loading a full state dict
    into an FSDP2 model with broadcast_from_rank0 (rank 0 alone holds the checkpoint), DCP's
    async_save, and the default device older code asks for. Each failed on "smddp" (the group
    reported no devices). Returns what each gave."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
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
        model = _parity_model()
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

    losses = _train_side_by_side(variants, rank, steps, before_step=before_step)
    full = {k: [p.full_tensor() for p in m.parameters()] for k, m in variants.items()}
    result = {"max_diff": max(float((p - q).abs().max()) for p, q in zip(full["smddp"], full["gloo"])),
              "max_abs": max(float(p.abs().max()) for p in full["gloo"]),
              "losses": losses["smddp"], "gloo_losses": losses["gloo"]}
    _let_gloo_workers_finish()
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
        model = _parity_model()
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh, mp_policy=policy)
        return fully_shard(model, mesh=mesh, mp_policy=policy)

    variants = {"smddp": sharded(mesh_of("smddp")), "gloo": sharded(mesh_of("gloo"))}
    optims = {k: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for k, m in variants.items()}
    for x, y in _parity_batches(rank, steps):
        for name, model in variants.items():
            optims[name].zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optims[name].step()
    full = {k: [p.full_tensor() for p in m.parameters()] for k, m in variants.items()}
    result = {"max_diff": max(float((p - q).abs().max()) for p, q in zip(full["smddp"], full["gloo"])),
              "max_abs": max(float(p.abs().max()) for p in full["gloo"])}
    _let_gloo_workers_finish()
    dist.destroy_process_group()
    return result


def init_explicit(method: str, port: int = 0, path: str = "") -> dict:
    """init with an explicit init_method and rank/world size (no torchrun variables)."""
    rank, world = int(os.environ["TEST_RANK"]), int(os.environ["TEST_WORLD_SIZE"])
    url = f"tcp://127.0.0.1:{port}" if method == "tcp" else f"file://{path}"
    smddp_lite.init(init_method=url, rank=rank, world_size=world)
    return _summary()


def init_auto() -> dict:
    """smddp_lite.init() with whatever the launcher provided (torchrun variables or MPI)."""
    smddp_lite.init()
    return _summary()


def init_refused() -> dict:
    """smddp_lite.init() expected to raise (a configuration that cannot work): its error, on
    each rank, and how long it took (the group's timeout is 60 s)."""
    return _error_of(lambda: smddp_lite.init(timeout=timedelta(seconds=60)))


def settings_differ(settings_of_rank: dict[str, dict[str, str]], numel: int = 1 << 20) -> dict:
    """Ranks whose SMDDP_* settings differ (``settings_of_rank``: rank -> variables, set before
    init): init's error on each rank, or, where init passed, what an all_reduce of ``numel``
    ones then returned (or raised)."""
    rank = int(os.environ["TEST_RANK"])
    os.environ.update(settings_of_rank.get(str(rank), {}))
    init = _error_of(lambda: smddp_lite.init(timeout=timedelta(seconds=30)))
    if init["type"] is not None:
        return {"init": init}
    t = torch.ones(numel)
    call = _error_of(lambda: dist.all_reduce(t))
    return {"init": init, "call": call, "sum_right": bool((t == dist.get_world_size()).all())}


def steps_differ_under_one_call() -> dict:
    """On one host of 2 ranks, under the hierarchical transport, the two ranks' shared-memory
    parts run different steps while naming the same user call (which settings that agree cannot
    cause: shared_settings.py): the error each raises."""
    smddp_lite.init(timeout=timedelta(seconds=30))
    from smddp_lite.backend.call import Call

    transport = dist.group.WORLD.transport
    call = Call(1, "all_reduce").step(signature("all_reduce", torch.float32, 8))  # the same on both ranks
    intra, t = transport.intra, torch.ones(8)
    step = (lambda: intra.all_reduce(call, t, RedOp.SUM)) if transport.local_rank == 0 else (
        lambda: intra.broadcast(call, t, 0))
    return _error_of(step)


def mpi_subgroups_on_simulated_hosts(per_host: int = 2) -> dict:
    """Under mpiexec, ranks on simulated hosts of ``per_host`` (SMDDP_HOSTNAME from the MPI
    rank): the default group is hierarchical, and a group inside one host (tensor parallel, HSDP's
    shard group) and one across hosts take MPI. Each group's transport and all_reduce sum."""
    os.environ["SMDDP_HOSTNAME"] = f"sim-host-{int(os.environ['PMI_RANK']) // per_host}"
    smddp_lite.init(timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    report = {"default": dist.group.WORLD.transport.name}
    for name, members in (("in_host", [0, 1]), ("across_hosts", [1, 2, 3])):
        group = dist.new_group(members)
        if rank in members:
            t = torch.full((3,), float(rank + 1))
            dist.all_reduce(t, group=group)
            report[name] = {"transport": group.transport.name, "sum": t.tolist()}
    dist.destroy_process_group()
    return report


def _summary() -> dict:
    t = torch.full((4,), float(dist.get_rank() + 1))
    dist.all_reduce(t)
    result = {"rank": dist.get_rank(), "world": dist.get_world_size(), "backend": dist.get_backend(),
              "sum": t.tolist(), "env_rank": os.environ.get("RANK")}
    dist.destroy_process_group()
    return result


def compiled_parity(steps: int = 10, wire_dtype: str | None = None, clip: float | None = None, width: int = 64,
                    bucket_cap_mb: float = 0.01, finish_on_completion: bool = False) -> dict:
    """smddp_lite.compile against DDP + torch.optim.AdamW on the same per-rank batches; a hidden
    layer of ``width`` units, buckets of ``bucket_cap_mb``. ``finish_on_completion``: take each
    bucket's norm from its collective's future, as on CUDA."""
    import copy

    from torch.nn.parallel import DistributedDataParallel as DDP

    smddp_lite.init()
    rank = dist.get_rank()
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(33, width), torch.nn.Tanh(), torch.nn.Linear(width, 5))
    eager_module, compiled_module = copy.deepcopy(base), copy.deepcopy(base)
    eager = DDP(eager_module, bucket_cap_mb=0.01)
    opt_e = torch.optim.AdamW(eager.parameters(), lr=3e-3, weight_decay=0.01)
    compiled, opt_c = smddp_lite.compile(compiled_module, torch.optim.AdamW(compiled_module.parameters(), lr=3e-3,
                                                                             weight_decay=0.01),
                                         bucket_cap_mb=bucket_cap_mb, first_bucket_mb=0.001, wire_dtype=wire_dtype,
                                         max_grad_norm=clip)
    compiled.reducer.finish_on_completion = finish_on_completion
    teacher = torch.randn(33, 5, generator=torch.Generator().manual_seed(7))  # a learnable labelling
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    losses = {"eager": [], "compiled": []}
    for _ in range(steps):
        x = torch.randn(16, 33, generator=gen)
        y = (x @ teacher).argmax(1)
        for name, model, opt in (("eager", eager, opt_e), ("compiled", compiled, opt_c)):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            if name == "eager" and clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip, foreach=True)
            opt.step()
            opt.zero_grad()
            losses[name].append(loss.item())
    diff = max(float((a - b).abs().max()) for a, b in zip(eager_module.parameters(), compiled_module.parameters()))
    scale = max(float(p.abs().max()) for p in eager_module.parameters())
    dist.destroy_process_group()
    return {"max_diff": diff, "max_abs": scale, "losses": losses, "buckets": len(opt_c.buckets),
            "arenas": len(opt_c.arenas)}


def compiled_wire_bytes(wire_dtype: str | None, steps: int = 3) -> dict:
    """Bytes one compiled step moves with ``wire_dtype`` on the wire: what the host's loopback
    carried per step (every rank's, on one host: gloo's sockets), and the dtype and bytes of
    every buffer the step handed the transport."""
    smddp_lite.init()
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Tanh(), torch.nn.Linear(256, 256))
    compiled, opt = smddp_lite.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-3), bucket_cap_mb=0.25,
                                       wire_dtype=wire_dtype)
    transport = dist.distributed_c10d._get_default_group().transport
    handed: list[tuple[str, str, int]] = []

    def counting(name: str):
        method = getattr(transport, name)

        def counted(*args, **kwargs):
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            sent = tensors[1] if name in ("all_to_all", "all_gather") else tensors[0]  # (output, input)
            handed.append((name, str(sent.dtype).replace("torch.", ""), sent.numel() * sent.element_size()))
            return method(*args, **kwargs)

        return counted

    x = torch.randn(32, 256, generator=torch.Generator().manual_seed(rank))

    def step() -> None:
        compiled(x).square().mean().backward()
        opt.step()
        opt.zero_grad()

    step()  # connections made, buffers allocated
    dist.barrier()
    before = _bytes_sent("lo")
    dist.barrier()
    for name in ("all_reduce", "all_to_all", "all_gather"):  # instance attributes: this group's only
        setattr(transport, name, counting(name))
    for _ in range(steps):
        step()
    for name in ("all_reduce", "all_to_all", "all_gather"):
        delattr(transport, name)
    dist.barrier()
    loopback = _bytes_sent("lo") - before
    dist.barrier()
    grads = sum(p.numel() for p in model.parameters())
    dist.destroy_process_group()
    return {"loopback_per_step": loopback / steps, "handed": handed[: len(handed) // steps],
            "gradient_bytes": 4 * grads}


def large_16_bit_sums(numel: int = 5_000_003) -> dict:
    """float16 and bfloat16 SUM and AVG all_reduces of ``numel`` small integers (several rounds
    of 16-bit pieces on gloo and MPI, the last one short and its share padded): which came out
    wrong, compared exactly."""
    smddp_lite.init()
    rank, world = dist.get_rank(), dist.get_world_size()
    pattern = torch.arange(numel, dtype=torch.int64).remainder_(5)
    wrong = []
    for dtype in (torch.float16, torch.bfloat16):
        for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            t = (pattern * world + rank).to(dtype)  # a mean that is an integer, exact in 16 bits
            dist.all_reduce(t, op=op)
            want = pattern * world * world + sum(range(world))
            if op == dist.ReduceOp.AVG:
                want = pattern * world + sum(range(world)) / world
            if not bool((t.double() == want.double()).all()):
                wrong.append(f"{dtype} {op}")
    dist.destroy_process_group()
    return {"wrong": wrong}


def integer_averages() -> dict:
    """AVG of integer tensors (a metric counter averaged by a training framework's DDP strategy,
    which torch's nccl accepts): all_reduce, reduce and reduce_scatter of int8, uint8, int32 and
    int64, against the sum divided by the group's size and truncated toward zero, as NCCL does.
    Values include negative sums and sums that are no multiple of the size. Which were wrong."""
    smddp_lite.init()
    rank, world = dist.get_rank(), dist.get_world_size()
    wrong = []
    for dtype in (torch.int8, torch.uint8, torch.int32, torch.int64):
        signed = dtype is not torch.uint8
        base = torch.arange(6 * world) % 7 - (3 if signed else 0)  # -3..3 (0..6 unsigned)

        def mine(r: int) -> torch.Tensor:
            return (base + r).to(dtype)

        total = sum(mine(r).to(torch.int64) for r in range(world))
        want = torch.div(total, world, rounding_mode="trunc").to(dtype)
        t = mine(rank)
        dist.all_reduce(t, op=dist.ReduceOp.AVG)
        if not torch.equal(t, want):
            wrong.append(f"all_reduce {dtype}: {t.tolist()} != {want.tolist()}")
        t = mine(rank)
        dist.reduce(t, dst=world - 1, op=dist.ReduceOp.AVG)
        if rank == world - 1 and not torch.equal(t, want):
            wrong.append(f"reduce {dtype}: {t.tolist()} != {want.tolist()}")
        out = torch.empty(6, dtype=dtype)
        dist.reduce_scatter_tensor(out, mine(rank), op=dist.ReduceOp.AVG)
        if not torch.equal(out, want[rank * 6 : (rank + 1) * 6]):
            wrong.append(f"reduce_scatter {dtype}: {out.tolist()} != {want[rank * 6 : (rank + 1) * 6].tolist()}")
    dist.destroy_process_group()
    return {"wrong": wrong}


def all_gather_coalesced_layout(backend: str = "smddp") -> dict:
    """``dist.all_gather_coalesced`` of two inputs of different shapes (torch requires one dtype)
    on ``backend``: what each rank's output lists hold (indexed by rank, then by input)."""
    import warnings

    warnings.filterwarnings("ignore", message=".*all_gather_coalesced.* will be deprecated")  # torch's own
    smddp_lite.init(backend=backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    inputs = [torch.full((2, 3), float(rank)), torch.arange(4.0) + 10 * rank]
    outputs = [[torch.empty_like(t) for t in inputs] for _ in range(world)]
    dist.all_gather_coalesced(outputs, inputs)
    report = {"outputs": [[t.tolist() for t in outs] for outs in outputs]}
    report["wrong_count"] = _error_of(lambda: dist.all_gather_coalesced(outputs[:1], inputs))
    dist.destroy_process_group()
    return report


def warnings_of_compile() -> dict:
    """Every warning raised while compiling a model and running two steps, with the file that
    raised it: none may come from this project's modules."""
    import warnings

    smddp_lite.init()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        compiled, opt = smddp_lite.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-3), max_grad_norm=1.0)
        for _ in range(2):
            compiled(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
    dist.destroy_process_group()
    return {"warnings": [f"{w.filename}:{w.lineno}: {w.category.__name__}: {w.message}" for w in caught]}


def compiled_apart(kind: str, steps: int = 2) -> dict:
    """``smddp_lite.compile`` where the last rank's model or options differ from the others'
    (``kind``): compile's error on each rank, or what training then did."""
    smddp_lite.init(timeout=timedelta(seconds=30))
    odd = dist.get_rank() == dist.get_world_size() - 1
    torch.manual_seed(0)
    width = 65 if odd and kind == "model" else 64
    model = torch.nn.Sequential(torch.nn.Linear(33, width), torch.nn.Tanh(), torch.nn.Linear(width, 5))
    if kind in ("buffers", "same"):  # running statistics: broadcast_buffers matters
        model.insert(1, torch.nn.BatchNorm1d(width))
    if kind == "frozen" and odd:
        model[0].bias.requires_grad_(False)
    options = {"bucket_cap_mb": 0.01}
    if odd:
        options.update({"bucket": {"bucket_cap_mb": 0.001, "first_bucket_mb": 0.001}, "wire": {"wire_dtype": "bfloat16"},
                        "clip": {"max_grad_norm": 0.01}, "buffers": {"broadcast_buffers": False},
                        "shard": {"shard_optimizer_state": True}}.get(kind, {}))
    made = {}
    lr = 2e-3 if odd and kind == "lr" else 1e-3
    compiled = _error_of(lambda: made.update(zip(("model", "optimizer"), smddp_lite.compile(
        model, torch.optim.AdamW(model.parameters(), lr=lr), **options))))
    if compiled["type"] is not None:
        return {"compile": compiled}
    def train() -> None:
        for _ in range(steps):
            made["model"](torch.randn(8, 33)).square().mean().backward()
            made["optimizer"].step()
            made["optimizer"].zero_grad()
    report = {"compile": compiled, "train": _error_of(train)}
    report["params"] = [p.detach().double().sum().item() for p in made["model"].parameters()]
    return report


def compiled_batchnorm_buffers(broadcast_buffers: bool = True) -> dict:
    """A BatchNorm model trained compiled and under DDP (broadcast_buffers, its default) side by
    side, each rank on its own batches: every rank must end with rank 0's running statistics,
    as under DDP, so that evaluation on any rank gives rank 0's answer. Returns this rank's
    buffers and evaluation output for both."""
    import copy

    from torch.nn.parallel import DistributedDataParallel as DDP

    smddp_lite.init()
    rank = dist.get_rank()
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(13, 17), torch.nn.BatchNorm1d(17), torch.nn.Tanh(),
                               torch.nn.Linear(17, 5))
    eager_module, compiled_module = copy.deepcopy(base), copy.deepcopy(base)
    eager = DDP(eager_module)
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.05, momentum=0.9)
    compiled, opt_c = smddp_lite.compile(compiled_module, torch.optim.SGD(compiled_module.parameters(), lr=0.05,
                                                                           momentum=0.9),
                                         broadcast_buffers=broadcast_buffers)
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(6):
        x, y = torch.randn(16, 13, generator=gen) * (1 + rank), torch.randint(0, 5, (16,), generator=gen)
        for model, opt in ((eager, opt_e), (compiled, opt_c)):
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    x_eval = torch.randn(8, 13, generator=torch.Generator().manual_seed(7))  # one batch on every rank
    report = {}
    for name, model in (("eager", eager), ("compiled", compiled)):
        model.eval()
        with torch.no_grad():
            out = model(x_eval)
        report[name] = {"buffers": [b.double().tolist() for b in model.module.buffers()], "eval": out.tolist()}
    dist.destroy_process_group()
    return report


def compiled_frozen_start() -> dict:
    """Each rank builds its model from its own seed, the first layer frozen: compile must start
    every rank from rank 0's weights, frozen ones included, as DDP does."""
    smddp_lite.init()
    rank = dist.get_rank()
    torch.manual_seed(rank)
    model = torch.nn.Sequential(torch.nn.Linear(7, 9), torch.nn.Tanh(), torch.nn.Linear(9, 3))
    model[0].requires_grad_(False)
    smddp_lite.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    weights = {name: p.detach().flatten().tolist() for name, p in model.named_parameters()}
    dist.destroy_process_group()
    return weights


def large_all_reduce(numel: int) -> dict:
    """A float32 all_reduce of ``numel`` elements, checked element by element against the exact
    sum (small integers: every partial sum is exact): the count of wrong elements."""
    smddp_lite.init()
    rank, world = dist.get_rank(), dist.get_world_size()
    pattern = torch.arange(numel, dtype=torch.float32).remainder_(1000)
    t = pattern + rank
    dist.all_reduce(t)
    want = pattern * world + sum(range(world))
    wrong = int((t != want).sum())
    dist.destroy_process_group()
    return wrong


def wire_rounding(numel: int = 4096) -> list[float]:
    """One all_reduce whose bfloat16 partial sums round differently from its float32 sum: rank 0
    gives 1, every other rank 2**-8 (with 3 ranks: 1 + 2**-8 is a tie that rounds back to 1 in
    bfloat16, while the float32 sum 1 + 2**-7 is exact in it). Returns the distinct results."""
    smddp_lite.init()
    t = torch.full((numel,), 1.0 if dist.get_rank() == 0 else 2.0**-8)
    dist.all_reduce(t)
    dist.destroy_process_group()
    return sorted(set(t.tolist()))


def _bytes_sent(interface: str = "eth0") -> int:
    """Bytes this process's network namespace has sent on ``interface`` (/proc/net/dev is the
    reader's namespace: on a simulated host, its link to the others)."""
    for line in open("/proc/net/dev"):
        name, _, counters = line.partition(":")
        if name.strip() == interface:
            return int(counters.split()[8])  # receive has 8 columns, then transmit bytes
    raise RuntimeError(f"no interface {interface} in /proc/net/dev: run this on a simulated host")


def link_bytes(op: str, dtype: str, numel: int = 1 << 20, calls: int = 4, redop: str = "sum") -> dict:
    """``calls`` reduce_scatter_tensor (``op`` "reduce_scatter"), all_gather_into_tensor
    ("all_gather") or all_reduce ("all_reduce") calls on a message of ``numel`` ``dtype`` elements
    (the reduce_scatter's input, the all_gather's output), of small integers, exact in every
    dtype. Returns the bytes this rank's host sent on its link per call, over the message's
    bytes, and whether every result was exact. ``redop`` "avg": the reductions average (their
    means are exact too)."""
    smddp_lite.init()
    rank, world = dist.get_rank(), dist.get_world_size()
    wanted, block = getattr(torch, dtype), numel // world
    pattern = torch.arange(numel, dtype=torch.int64).remainder_(7)
    if op == "all_reduce":
        inp, out = (pattern + rank).to(wanted), torch.empty(numel, dtype=wanted)
        want = pattern * world + sum(range(world))
        if redop == "avg":
            want = want / world
        op = dist.ReduceOp.AVG if redop == "avg" else dist.ReduceOp.SUM

        def run() -> None:
            out.copy_(inp)
            dist.all_reduce(out, op=op)
    elif op == "reduce_scatter":
        inp, out = (pattern + rank).to(wanted), torch.empty(block, dtype=wanted)
        want = pattern[rank * block : (rank + 1) * block] * world + sum(range(world))
        if redop == "avg":
            want = want / world
        op = dist.ReduceOp.AVG if redop == "avg" else dist.ReduceOp.SUM
        run = lambda: dist.reduce_scatter_tensor(out, inp, op=op)  # noqa: E731
    else:
        inp, out = (pattern[rank * block : (rank + 1) * block]).to(wanted), torch.empty(numel, dtype=wanted)
        want = pattern
        run = lambda: dist.all_gather_into_tensor(out, inp)  # noqa: E731
    run()  # warm-up: connections made before counting
    exact = bool((out.double() == want.double()).all())
    # The counter is the host's, shared by its ranks: each reading sits between two barriers, so
    # that no rank of the host sends a call's bytes before, or after, another rank reads it.
    dist.barrier()
    before = _bytes_sent()
    dist.barrier()
    for _ in range(calls):
        out.zero_()
        run()
        exact = exact and bool((out.double() == want.double()).all())
    dist.barrier()  # every call's bytes have left every host (each peer has received them)
    sent = _bytes_sent() - before  # three barriers add a few hundred bytes, acknowledgements under 1%
    dist.barrier()
    dist.destroy_process_group()
    return {"sent_per_message_byte": sent / calls / (numel * torch.tensor([], dtype=wanted).element_size()),
            "exact": exact}


def broadcasts_from_every_root(numels: list[int], dtype: str = "float32", late_s: float = 0.0) -> dict:
    """A broadcast of each size in ``numels`` from every rank (the root's values depend on the
    root; the others pass garbage): the calls whose result was not the root's tensor. The root
    enters its largest broadcast ``late_s`` late: the others wait that long for its data."""
    smddp_lite.init(timeout=timedelta(seconds=60))
    rank, world, kind = dist.get_rank(), dist.get_world_size(), getattr(torch, dtype)
    wrong = []
    for root in range(world):
        for numel in numels:
            want = (torch.arange(numel, dtype=torch.float64) * (root + 1) % 251).to(kind)
            t = want.clone() if rank == root else torch.full((numel,), -7.0, dtype=kind)
            if rank == root and numel == max(numels):
                time.sleep(late_s)
            dist.broadcast(t, src=root)
            if not torch.equal(t, want):
                wrong.append(f"root {root}, {numel} elements")
    dist.destroy_process_group()
    return {"wrong": wrong}


def reduce_scatter_rounding(dtype: str, numel_per_rank: int = 1024) -> list[float]:
    """One reduce_scatter_tensor whose inputs round differently in bfloat16 than in float32:
    rank 0 gives 1 + 2**-9 (which rounds to 1 in bfloat16), every other rank 2**-8. Returns the
    distinct values of this rank's result."""
    smddp_lite.init()
    world = dist.get_world_size()
    first = 1.0 + 2.0**-9 if dtype == "float32" else 1.0
    inp = torch.full((numel_per_rank * world,), first if dist.get_rank() == 0 else 2.0**-8, dtype=getattr(torch, dtype))
    out = torch.empty(numel_per_rank, dtype=inp.dtype)
    dist.reduce_scatter_tensor(out, inp)
    dist.destroy_process_group()
    return sorted(set(out.float().tolist()))


def _host_shares_rounded(blocks: list[torch.Tensor], ranks_per_host: int, kind: torch.dtype) -> dict:
    """Two references for a 16-bit AVG that crosses hosts in ``kind``, from every rank's
    ``blocks`` (in rank order, hosts of ``ranks_per_host`` consecutive ranks): each host's float32
    sum ("host sums rounded") or mean ("host means rounded") rounded to ``kind`` once, those
    summed in float32 in host order, divided by the ranks (or the hosts) and rounded once."""
    world = len(blocks)
    hosts = range(0, world, ranks_per_host)
    sums = [torch.stack(blocks[k : k + ranks_per_host]).float().sum(0) for k in hosts]
    references = {}
    for name, shares, divisor in (("host_sums_rounded", sums, world),
                                  ("host_means_rounded", [s / ranks_per_host for s in sums], len(sums))):
        total = shares[0].to(kind).float()
        for share in shares[1:]:
            total += share.to(kind)
        references[name] = (total / divisor).to(kind)
    return references


def all_reduce_16_bit_avg(ranks_per_host: int, dtype: str = "bfloat16", numel: int = 1 << 16) -> dict:
    """A 16-bit AVG all_reduce of random values (seeded by rank) on hosts of ``ranks_per_host``
    ranks each, against references this rank computes from every rank's input: the mean in
    float32 rounded once ("widened", what the algorithms layer's float32 copy gives), and the two
    of _host_shares_rounded (a SUM's rounding plus a division before the last rounding; or each
    host's mean rounded, as float16 crosses hosts). Returns whether the result equals each, in how
    many elements each differs from "widened", and in how many the two host references differ."""
    smddp_lite.init()
    rank, world = dist.get_rank(), dist.get_world_size()
    kind = getattr(torch, dtype)
    inputs = [torch.randn(numel, generator=torch.Generator().manual_seed(r)).to(kind) for r in range(world)]
    out = inputs[rank].clone()
    dist.all_reduce(out, op=dist.ReduceOp.AVG)
    references = {"widened": (torch.stack(inputs).float().sum(0) / world).to(kind),
                  **_host_shares_rounded(inputs, ranks_per_host, kind)}
    dist.destroy_process_group()
    return {**{name: bool(torch.equal(out, ref)) for name, ref in references.items()},
            "differ_from_widened_in": {name: int((ref != references["widened"]).sum())
                                       for name, ref in references.items()},
            "means_differ_from_sums_in": int((references["host_means_rounded"] != references["host_sums_rounded"]).sum())}


def without_shared_memory(program: str, **kwargs):
    """``program`` (a function of this module) where /dev/shm cannot serve ranks, as on non-x86
    machines: hosts of several ranks then reduce among them with gloo (select._shm_possible)."""
    from smddp_lite.backend.transports import select

    possible = select._shm_possible
    select._shm_possible = lambda: False
    try:
        return globals()[program](**kwargs)
    finally:
        select._shm_possible = possible


def float16_avg_of_large_values(numel: int = 1 << 18) -> dict:
    """float16 AVG all_reduce and reduce_scatter_tensor of 40000 + 64 x rank on every element:
    any two ranks' sum exceeds float16's largest value (65504), their means do not, and every
    mean of 2 or 4 of them is exact in float16. Returns the set of values each call gave."""
    smddp_lite.init()
    rank, world = dist.get_rank(), dist.get_world_size()
    values = torch.full((numel,), 40000.0 + 64 * rank, dtype=torch.float16)
    reduced = values.clone()
    dist.all_reduce(reduced, op=dist.ReduceOp.AVG)
    scattered = torch.empty(numel // world, dtype=torch.float16)
    dist.reduce_scatter_tensor(scattered, values, op=dist.ReduceOp.AVG)
    dist.destroy_process_group()
    return {"all_reduce": sorted(set(reduced.tolist())), "reduce_scatter": sorted(set(scattered.tolist()))}


def reduce_scatter_16_bit_sums(dtype: str, op: str, numel_per_rank: int = 4096, ranks_per_host: int | None = None) -> dict:
    """A 16-bit reduce_scatter_tensor of random values (seeded by rank), against two references
    this rank computes from every rank's input: summed in float32 and rounded once (after the
    division, for AVG), and summed in the 16-bit dtype itself. Returns whether the result equals
    each, and how many elements the two references differ in (so the check can fail). With
    ``ranks_per_host``, for AVG: also _host_shares_rounded's references (as "float32_once" in
    "differ_from_once_in")."""
    smddp_lite.init()
    rank, world = dist.get_rank(), dist.get_world_size()
    kind = getattr(torch, dtype)
    inputs = [torch.randn(numel_per_rank * world, generator=torch.Generator().manual_seed(r)).to(kind)
              for r in range(world)]
    out = torch.empty(numel_per_rank, dtype=kind)
    dist.reduce_scatter_tensor(out, inputs[rank], op=getattr(dist.ReduceOp, op))
    mine = torch.stack([x.view(world, -1)[rank] for x in inputs])  # (world, n): my block from every rank
    wide = mine.float().sum(0)
    narrow = mine[0].clone()
    for block in mine[1:]:
        narrow += block
    if op == "AVG":
        wide, narrow = wide / world, narrow / world
    once = wide.to(kind)
    shared = _host_shares_rounded(list(mine), ranks_per_host, kind) if ranks_per_host and op == "AVG" else {}
    dist.destroy_process_group()
    return {"float32_once": bool(torch.equal(out, once)), "in_16_bit": bool(torch.equal(out, narrow)),
            "references_differ_in": int((once != narrow).sum()),
            **{name: bool(torch.equal(out, ref)) for name, ref in shared.items()},
            "differ_from_once_in": {name: int((ref != once).sum()) for name, ref in shared.items()}}


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


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def soak(rounds: int = 1200, checkpoints: int = 10, compare_from: int = 4, lines_from: int = 2) -> dict:
    """Every kind of collective, round after round, with this rank's memory read at checkpoints:
    the Python heap (tracemalloc, after a full garbage collection) and the resident set. Whatever a
    call leaves behind (a handle, a future, a store key, a buffer) grows them in step with the calls.
    ``growth`` lists the source lines whose live blocks grew most between checkpoint
    ``lines_from`` and the last (a snapshot grows the heap itself for a while, so it is taken
    before ``compare_from``, where the heap's growth is measured from), so a leak in one kind of call shows even where the total hides it. Values are checked
    as it goes, so a leak fixed by corrupting results does not pass."""
    import gc
    import tracemalloc

    smddp_lite.init()
    rank, world = dist.get_rank(), dist.get_world_size()
    n = 256 * world
    values = torch.empty(n)
    wide = torch.empty(1 << 16, dtype=torch.bfloat16)  # 16-bit: the widening paths and their buffers
    gathered, scattered = torch.empty(n * world), torch.empty(n)
    mine, blocks = torch.empty(n), torch.empty(n * world)
    wrong = []
    # torch 2.13 deprecates the *_into_tensor / *_tensor names, and every deprecation warning adds to
    # the warnings registry, which would read as growth here
    all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
    reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)

    def one_round(i: int) -> None:
        values.fill_(rank + 1)
        dist.all_reduce(values)
        wide.fill_(rank + 1)
        dist.all_reduce(wide, op=dist.ReduceOp.AVG)
        all_gather(gathered, values)
        reduce_scatter(scattered, gathered)
        dist.broadcast(values, src=i % world)
        chained = dist.all_reduce(values, async_op=True).get_future().then(lambda f: f.value()[0][0].item())
        total = world * (world + 1) // 2
        got = (chained.wait(), float(wide[-1]), float(scattered[0]))
        if got != (total * world, (world + 1) / 2, total * world):
            wrong.append((i, got))
        # the ops added on 2026-11-24: gather, scatter, an uneven all_to_all (sizes change every
        # round, as MoE routing's do) and a ring of isend/irecv through the pair links
        root = i % world
        mine.fill_(rank)
        dist.gather(mine, list(blocks.chunk(world)) if rank == root else None, dst=root)
        dist.scatter(mine, list(blocks.chunk(world)) if rank == root else None, src=root)
        sends = [(rank + q + i) % 3 for q in range(world)]
        receives = [(q + rank + i) % 3 for q in range(world)]
        routed = torch.empty(sum(receives))
        dist.all_to_all_single(routed, torch.full((sum(sends),), float(rank)), receives, sends)
        ring = torch.empty(4)
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.full((4,), float(rank)), (rank + 1) % world),
                                            dist.P2POp(dist.irecv, ring, (rank - 1) % world)]):
            work.wait()
        want_routed = torch.cat([torch.full((c,), float(q)) for q, c in enumerate(receives)])
        if float(mine[0]) != rank or not torch.equal(routed, want_routed) or float(ring[0]) != (rank - 1) % world:
            wrong.append((i, "gather/scatter/all_to_all/send", float(mine[0]), float(ring[0])))
        if i % 50 == 0:
            dist.barrier()

    for i in range(100):  # warm-up: buffers, first-call caches
        one_round(i)
    gc.collect()
    tracemalloc.start()
    heap, resident, reference = [], [], None
    for c in range(checkpoints):
        for i in range(rounds // checkpoints):
            one_round(i)
        gc.collect()
        heap.append(tracemalloc.get_traced_memory()[0])
        resident.append(_resident_bytes())
        if c == lines_from:
            reference = tracemalloc.take_snapshot()
    diffs = tracemalloc.take_snapshot().compare_to(reference, "lineno")
    tracemalloc.stop()
    growth = [{"blocks": d.count_diff, "bytes": d.size_diff,
               "where": f"{d.traceback[0].filename.rsplit('/', 2)[-1]}:{d.traceback[0].lineno}"}
              for d in sorted(diffs, key=lambda d: -d.count_diff)[:3]]
    dist.destroy_process_group()
    return {"heap": heap, "resident": resident, "wrong": wrong[:5], "growth": growth}


def point_to_point() -> dict:
    """send/recv as pipelines and ring exchanges use them; returns what went wrong, by case."""
    smddp_lite.init(timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    after, before = (rank + 1) % world, (rank - 1) % world
    problems = {}

    def check(case: str, got: torch.Tensor, want: torch.Tensor) -> None:
        if got.dtype != want.dtype or not torch.equal(got, want):
            problems[case] = f"got {got.flatten()[:6].tolist()}, want {want.flatten()[:6].tolist()}"

    # a ring through batch_isend_irecv: every rank posts a send before its peer posts the recv,
    # and each pair's link is made while the others are being made; float8 and int16 travel as bytes
    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.int8, torch.float8_e4m3fn, torch.int16):
        sent = (torch.arange(1000) * (rank + 1) % 7).to(dtype)
        got = torch.empty(1000, dtype=dtype)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, sent, after), dist.P2POp(dist.irecv, got, before)])
        for w in works:
            w.wait()
        check(f"ring-{dtype}", got, (torch.arange(1000) * (before + 1) % 7).to(dtype))
    # a pipeline: stage r receives from r-1, adds, sends to r+1; several messages in order
    for step in range(5):
        x = torch.full((300, 7), float(step))
        if rank > 0:
            dist.recv(x, src=rank - 1)
        x += 1
        if rank < world - 1:
            dist.send(x, dst=rank + 1)
        elif rank == world - 1:
            check(f"pipeline-{step}", x, torch.full((300, 7), float(step + world)))
    # tags keep messages apart: posted in one order, received in the other
    if world >= 2 and rank in (0, 1):
        peer = 1 - rank
        if rank == 0:
            a, b = dist.isend(torch.full((5,), 1.0), peer, tag=1), dist.isend(torch.full((5,), 2.0), peer, tag=2)
            a.wait(), b.wait()
        else:
            two, one = torch.empty(5), torch.empty(5)
            w2 = dist.irecv(two, peer, tag=2)
            w1 = dist.irecv(one, peer, tag=1)
            w2.wait(), w1.wait()
            check("tags", torch.cat([one, two]), torch.cat([torch.full((5,), 1.0), torch.full((5,), 2.0)]))
        # into a non-contiguous tensor, and through a future
        if rank == 0:
            dist.send(torch.arange(12.0).view(3, 4), dst=1, tag=3)
        else:
            target = torch.zeros(4, 3).t()
            fut = dist.irecv(target, 0, tag=3).get_future()
            value = fut.wait()[0]
            check("non_contiguous", target, torch.arange(12.0).view(3, 4))
            check("future", value, torch.arange(12.0).view(3, 4))
        # a 1-element column (stride 3, contiguous to torch) of a dtype sent as bytes
        if rank == 0:
            dist.send(torch.tensor([[1, 7, 2]], dtype=torch.int16)[:, 1], dst=1, tag=5)
        else:
            column = torch.zeros(1, 3, dtype=torch.int16)[:, 1]
            dist.recv(column, 0, tag=5)
            check("one_element_column", column, torch.tensor([7], dtype=torch.int16))
    # collectives go on between them, on every transport
    t = torch.ones(3)
    dist.all_reduce(t)
    check("collective_after", t, torch.full((3,), float(world)))
    dist.destroy_process_group()
    return problems


def point_to_point_errors() -> dict:
    """Bad peers and tags raise on the calling rank; a recv whose sender never comes raises at
    the group's timeout (3 s here), naming the peer and tag; collectives go on afterwards."""
    smddp_lite.init(timeout=timedelta(seconds=3))
    rank = dist.get_rank()
    report = {
        "outside": _error_of(lambda: dist.send(torch.ones(3), dst=5)),
        "tag": _error_of(lambda: dist.recv(torch.ones(3), src=1 - rank, tag=-2)),
        "any_source": _error_of(lambda: dist.recv(torch.ones(3))),
        # gloo's tags are 32-bit: this one failed the post and closed the pair's link
        "big_tag": _error_of(lambda: dist.send(torch.ones(3), dst=1 - rank, tag=2**40)),
        "recv_expanded": _error_of(lambda: dist.recv(torch.zeros(1).expand(4), src=1 - rank, tag=4)),
    }
    # a contiguous lazy negative view (the imaginary part of a conjugate): its memory holds +2
    negative = torch.tensor([1 + 2j]).conj().imag
    received = torch.zeros(1)
    dist.send(negative, dst=1) if rank == 0 else dist.recv(received, src=0)
    report["negative_view_received"] = received.tolist() if rank == 1 else [-2.0]
    started = time.monotonic()
    report["never_sent"] = _error_of(lambda: dist.recv(torch.ones(3), src=1 - rank, tag=9))
    report["never_sent"]["seconds"] = time.monotonic() - started
    # gloo closes a pair whose wait timed out: the next call on it says so at once
    report["after_timeout"] = _error_of(lambda: dist.recv(torch.ones(3), src=1 - rank, tag=10))
    t = torch.ones(3)
    dist.all_reduce(t)
    report["usable_after"] = t.tolist() == [2.0, 2.0, 2.0]
    dist.destroy_process_group()
    return report


def recv_timed_out_before_the_link() -> dict:
    """Rank 1's first irecv from rank 0 waits 1 s and gives up before rank 0 ever names it; rank
    0 then sends A, and rank 1 receives again. The message must not land in the tensor of the
    recv that already failed (it did, and the retry silently got the next message): as on gloo,
    the pair's link failed with the timeout, and both ranks' next calls on it say so. A
    get_future() asked for before a wait(1 s) must not stretch that wait (to the group's 8 s)."""
    smddp_lite.init(timeout=timedelta(seconds=8))
    rank = dist.get_rank()
    store = dist.distributed_c10d._get_default_store()
    report = {}
    if rank == 1:
        first = torch.zeros(3)
        work = dist.irecv(first, 0)
        work.get_future()
        time.sleep(0.2)  # its watcher thread is waiting in the work by now (for the group's 8 s)
        started = time.monotonic()
        report["wait"] = _error_of(lambda: work.wait(timedelta(seconds=1)))
        report["wait_seconds"] = time.monotonic() - started
        store.set("test-recv-gave-up", "1")
        store.wait(["test-send-over"])  # the link exists by now: rank 0 has made it and sent on it
        report["first_after"] = first.tolist()
        report["retry"] = _error_of(lambda: dist.recv(torch.zeros(3), 0))
    else:
        store.wait(["test-recv-gave-up"])
        report["send"] = _error_of(lambda: dist.send(torch.full((3,), 1.0), 1))
        store.set("test-send-over", "1")
    dist.destroy_process_group()
    return report


def ddp_uneven_inputs(base_steps: int = 5, divide_by_initial_world_size: bool = True) -> dict:
    """Ranks with different numbers of batches (the last, short epoch of a sharded dataset),
    trained under DDP's ``join()``: ranks that run out shadow the others' all_reduces instead of
    leaving them waiting. The same on "smddp" and on "gloo", one after the other in one job;
    returns each one's seconds and final parameters' largest difference."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    smddp_lite.init(timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    gloo = dist.new_group(backend="gloo")
    steps = base_steps + 3 * rank  # rank r has 3r more batches than rank 0
    batches = list(_parity_batches(rank, steps))
    result = {}
    models = {}
    for name, group in (("smddp", dist.group.WORLD), ("gloo", gloo)):
        ddp = DDP(_parity_model(), process_group=group, bucket_cap_mb=0.01)
        optim = torch.optim.SGD(ddp.parameters(), lr=0.05)
        started = time.monotonic()
        with ddp.join(divide_by_initial_world_size=divide_by_initial_world_size):
            for x, y in batches:
                optim.zero_grad()
                torch.nn.functional.cross_entropy(ddp(x), y).backward()
                optim.step()
        result[f"{name}_seconds"] = time.monotonic() - started
        models[name] = ddp.module
    _let_gloo_workers_finish()
    del ddp, optim
    result["max_diff"] = max(float((p - q).abs().max())
                             for p, q in zip(models["smddp"].parameters(), models["gloo"].parameters()))
    # every rank must end with the same parameters (DDP's shadow all_reduces kept them in step)
    flat = torch.cat([p.detach().reshape(-1) for p in models["smddp"].parameters()])
    everyone = torch.empty(dist.get_world_size() * flat.numel())
    dist.all_gather_into_tensor(everyone, flat)
    result["ranks_agree"] = bool((everyone.view(dist.get_world_size(), -1) == flat).all())
    dist.destroy_process_group()
    return result


def pipeline_parity(microbatches: int = 4) -> dict:
    """torch.distributed.pipelining (one stage per rank, send/recv between them) under the GPipe
    and 1F1B schedules, on "smddp" and on "gloo" side by side in one job: the losses and every
    stage's gradients must be the same."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    smddp_lite.init(timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    target = torch.randn(8, 16, generator=torch.Generator().manual_seed(2))
    results = {}
    for schedule in (ScheduleGPipe, Schedule1F1B):
        for name, group in (("smddp", dist.group.WORLD), ("gloo", gloo)):
            torch.manual_seed(0)
            layers = [torch.nn.Linear(16, 16) for _ in range(2 * world)]
            stage_layers = torch.nn.Sequential(*layers[2 * rank : 2 * rank + 2])
            stage = PipelineStage(stage_layers, rank, world, torch.device("cpu"), group=group)
            run = schedule(stage, n_microbatches=microbatches, loss_fn=lambda out, y: ((out - y) ** 2).mean())
            losses = []
            if rank == 0:
                run.step(x)
            elif rank == world - 1:
                run.step(target=target, losses=losses)
            else:
                run.step()
            results[(schedule.__name__, name)] = (
                [float(loss) for loss in losses], torch.cat([p.grad.reshape(-1) for p in stage_layers.parameters()]))
    report = {}
    for schedule in ("ScheduleGPipe", "Schedule1F1B"):
        (smddp_losses, smddp_grads), (gloo_losses, gloo_grads) = results[(schedule, "smddp")], results[(schedule, "gloo")]
        report[schedule] = {"losses": smddp_losses, "same_losses": smddp_losses == gloo_losses,
                            "same_grads": bool(torch.equal(smddp_grads, gloo_grads)),
                            "grad_norm": float(smddp_grads.norm())}
    _let_gloo_workers_finish()
    dist.destroy_process_group()
    return report


def scratch_kept(numel: int = 1 << 21) -> dict:
    """A bfloat16 all_reduce and reduce_scatter of ``numel`` elements (widened to float32 on the
    gloo transport): what the group keeps afterwards, and whether the results are right."""
    smddp_lite.init()
    world = dist.get_world_size()
    t = torch.ones(numel, dtype=torch.bfloat16)
    dist.all_reduce(t)
    out = torch.empty(numel // world, dtype=torch.bfloat16)
    dist.reduce_scatter_tensor(out, torch.ones(numel, dtype=torch.bfloat16))
    group = dist.group.WORLD
    kept = group.collectives.scratch.kept_bytes() + group.transport._scratch.kept_bytes()
    right = bool((t == world).all()) and bool((out == world).all())
    dist.destroy_process_group()
    return {"kept": kept, "right": right}


def made_again(times: int = 3) -> dict:
    """init, an all_reduce and a send/recv, destroy; again, on the same store (torchrun's agent
    store, or mpiexec's): each incarnation of the group must not meet the keys the last one left
    (the shared-memory segment's name, rendezvous addresses, the pair links')."""
    rank = world = None
    got = []
    for k in range(times):
        smddp_lite.init(timeout=timedelta(seconds=30))
        rank, world = dist.get_rank(), dist.get_world_size()
        total = torch.full((5,), float(rank + 10 * k))
        dist.all_reduce(total)
        after, before = (rank + 1) % world, (rank - 1) % world
        out = torch.empty(5)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.full((5,), float(rank + 10 * k)), after),
                                        dist.P2POp(dist.irecv, out, before)])
        for w in works:
            w.wait()
        got.append([float(total[0]), float(out[0])])
        dist.destroy_process_group()
    want = [[float(sum(range(world)) + 10 * k * world), float(before + 10 * k)] for k in range(times)]
    return {"got": got, "want": want}


def subgroup_made_again() -> dict:
    """torch names subgroups by a counter that destroy_process_group resets: after a new init, the
    second subgroup's name (and store prefix) is the first one's, here for a group of another
    size (2 ranks, then all 4). Each must count its incarnations apart."""
    sums = []
    for members in ([0, 1], [0, 1, 2, 3]):
        smddp_lite.init(timeout=timedelta(seconds=30))
        rank = dist.get_rank()
        group = dist.new_group(members)
        t = torch.ones(3)
        if rank in members:
            dist.all_reduce(t, group=group)
        sums.append(float(t[0]))
        dist.destroy_process_group()
    return {"sums": sums}


def interrupted_call(waits: bool = False) -> dict:
    """Rank 0 is sent SIGINT (Ctrl-C) 0.5 s into an all_reduce that rank 1 never joins, a call
    rank 0 runs on its own thread (a plain wait), or with ``waits`` one the communication thread
    runs while rank 0 waits for its Work: it must raise KeyboardInterrupt at once, as before, not
    hang or turn it into a backend error, and refuse later calls."""
    import signal
    import threading

    # Python's own handler, as an interactive run has it: a job that a script started in the
    # background (`cmd &`, no job control) inherits SIGINT ignored, and Python then installs none
    signal.signal(signal.SIGINT, signal.default_int_handler)
    smddp_lite.init(timeout=timedelta(seconds=30))
    dist.barrier()
    store = dist.distributed_c10d._get_default_store()
    if dist.get_rank() == 1:  # alive, and never joining, until rank 0 has its answers
        _stay_until_peers_report(store, [0])
        os._exit(0)
    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
    start = time.monotonic()
    try:
        if waits:
            work = dist.all_reduce(torch.ones(1000), async_op=True)
            time.sleep(0.1)  # the communication thread has taken the call by now
            work.wait()
        else:
            dist.all_reduce(torch.ones(1000))
        raised = None
    except BaseException as exc:  # noqa: BLE001 (KeyboardInterrupt is what is looked for)
        raised = type(exc).__name__
    report = {"raised": raised, "seconds": time.monotonic() - start,
              "next_call": _error_of(lambda: dist.all_reduce(torch.ones(10)))}
    store.set("test-reported/0", "1")
    return report


def routes_under_auto() -> dict:
    """Calls on simulated hosts under SMDDP_ALGORITHM=auto: which path each took (rank 0's
    SMDDP_DEBUG log), a count summed in float32 (exact in float32, not in bfloat16), and a small
    and a large broadcast from the last rank (on the second host, not its first rank)."""
    import logging

    smddp_lite.init()
    rank, world = dist.get_rank(), dist.get_world_size()
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("smddp_lite").addHandler(handler)
    count = torch.tensor([1000.0 + rank + 0.5])  # 4 ranks: 4008.0, which bfloat16 rounds
    dist.all_reduce(count)
    gathered = torch.empty(world * 3)
    dist.all_gather_into_tensor(gathered, torch.full((3,), float(rank)))
    halves = torch.ones(64, dtype=torch.bfloat16)
    dist.all_reduce(halves)
    sent = {n: torch.arange(n, dtype=torch.float32) * (world - 1) for n in (64, 65537)}  # 65537: parts of 2 uneven
    broadcasts = {n: sent[n].clone() if rank == world - 1 else torch.zeros(n) for n in sent}
    for received in broadcasts.values():
        dist.broadcast(received, src=world - 1)
    logging.getLogger("smddp_lite").removeHandler(handler)
    dist.destroy_process_group()
    return {"routes": [s for s in said if " runs " in s], "count": count.item(),
            "gathered": gathered.tolist(), "halves": halves.float().unique().tolist(),
            "broadcasts_arrived": [torch.equal(broadcasts[n], sent[n]) for n in sent]}


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
        report = _error_of(lambda: agree_on_path(store, rank, world, timedelta(seconds=20), setting, why))
        # the group's next CUDA call makes its CudaPaths again: it must be refused again, not pass
        # on the counts the first comparison left in the store (at 2 ranks 1 + 1 NCCL = 2)
        report["again"] = _error_of(lambda: agree_on_path(store, rank, world, timedelta(seconds=20), setting, why))
    else:
        made = {}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            report = _error_of(lambda: made.update(paths=CudaPaths(store, rank, world, timedelta(seconds=20),
                                                                   backend_config({"SMDDP_CUDA_TRANSPORT": setting}),
                                                                   lambda reason: None)))
        report["staged"] = "paths" in made and made["paths"].nccl is None
        report["warnings"] = [str(w.message) for w in caught]
    report["usable_after"] = _still_works()
    dist.destroy_process_group()
    return report
