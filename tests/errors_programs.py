"""Programs of test_errors.py: bad input, mismatched calls, refusals, dead and stuck peers.
test_cuda.py runs ``ddp_peer_dies`` on staged CUDA tensors and test_multinode.py runs
``peer_dies`` across simulated hosts.

Each program runs on every rank of a test job (see harness.py) and returns what it observed."""

from __future__ import annotations

import contextlib
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import smddp_lite
from smddp_lite.backend.ops import RedOp
from smddp_lite.backend.signatures import signature

from .rank_helpers import error_of, stay_until_peers_report, still_works


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
        report[name] = error_of(fn)
        report[name]["usable_after"] = still_works()
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
    report = error_of(calls[kind])
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
    report = error_of(lambda: WAITING_MISMATCHES[kind](rank in odd_ranks))
    report["usable_after"] = _usable_after_error()
    return report


def sizes_differ_on_gloo() -> dict:
    """Rank 0 all-reduces 10 elements and rank 1 eleven, without SMDDP_CHECK_COLLECTIVES: gloo
    aborts rank 0 (it received more than it posted); rank 1 reports its call and the next one."""
    smddp_lite.init(timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    report = {"call": error_of(lambda: dist.all_reduce(torch.ones(10 + rank)))}
    report["next"] = _usable_after_error()
    return report


def slow_rank_matching_calls(slow_s: float = 1.4) -> dict:
    """The last rank makes each call ``slow_s`` after its peers, so they wait in it long enough to
    compare signatures through the store; the calls match, so every one must complete, with the
    right values. A call of two dtypes runs two steps; an uneven all_to_all gathers its sizes
    first. ``waits`` is how long this rank spent in each call: the others' must pass the point
    (``MISMATCH_LOOK_AFTER_S``) where a waiting rank starts to compare."""
    smddp_lite.init(timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    slow = rank == world - 1
    waits = []

    def timed(call) -> None:
        if slow:
            time.sleep(slow_s)
        start = time.monotonic()
        call()
        waits.append(time.monotonic() - start)

    dist.barrier()  # the ranks leave init at their own times; the slow rank's lead counts from here
    two_dtypes = [torch.full((3,), float(rank)), torch.full((2,), float(rank), dtype=torch.float64)]
    # the process group's own method takes a list of tensors (torch's dist.all_reduce takes one)
    timed(lambda: dist.distributed_c10d._get_default_group().allreduce(two_dtypes).wait())
    rooted = torch.full((4,), float(rank))
    timed(lambda: dist.broadcast(rooted, src=world - 1))
    # rank p sends p + 1 elements to every rank
    received = torch.empty(sum(p + 1 for p in range(world)))
    timed(lambda: dist.all_to_all_single(received, torch.full(((rank + 1) * world,), float(rank)),
                                         output_split_sizes=[p + 1 for p in range(world)],
                                         input_split_sizes=[rank + 1] * world))
    timed(dist.barrier)
    report = {"sums": [t.tolist() for t in two_dtypes], "broadcast": rooted.tolist(), "received": received.tolist(),
              "waits": waits}
    dist.destroy_process_group()
    return report


def _usable_after_error() -> bool | str:
    """Whether the group still works after the error just raised (an all_reduce gives the sum),
    or the error that its next call raised."""
    try:
        return still_works()
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
    report = error_of(lambda: dist.all_to_all_single(
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
    error = error_of(refuses if rank == refuser else waits)
    if rank == refuser:
        if retry:
            error["retry"] = error_of(lambda: dist.all_reduce(torch.ones(3)))
        stay_until_peers_report(store, range(refuser))
    else:
        store.set(f"test-reported/{rank}", "1")
    return error


def _refused_before_peers_arrive(rank: int, refuser: int, calls, flag: Path) -> dict:
    # a file says the refusal happened, not the store: the refuser's store client is busy
    # posting the refusal and waiting for its peers' outcome (a client serves one request at a time)
    store = dist.distributed_c10d._get_default_store()
    waits, refuses = calls
    if rank == refuser:
        error = error_of(refuses)
        flag.touch()
        error["retry"] = error_of(lambda: dist.all_reduce(torch.ones(3)))
        stay_until_peers_report(store, range(refuser))
        return error
    deadline = time.monotonic() + 60
    while not flag.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)  # the refuser's retry is published by now
    error = error_of(waits)
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
    report = error_of(calls[op])
    if report["type"] is None:
        report = error_of(lambda: dist.all_reduce(torch.ones(3)))
    report["seconds"] = time.monotonic() - started
    store = dist.distributed_c10d._get_default_store()
    if rank == world - 1:
        report["next"] = error_of(lambda: dist.all_reduce(torch.ones(3)))["message"]
        stay_until_peers_report(store, range(world - 1))
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
    report = error_of(lambda: dist.all_reduce(torch.ones(1000)))
    # refused at the call now that the group failed: still the DistBackendError type a retry
    # loop catches, as for a call made before the failure was found (and for a send, alike)
    report["next_call"] = error_of(lambda: dist.all_reduce(torch.ones(10)))
    report["send_after"] = error_of(lambda: dist.send(torch.ones(10), 1))
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
    report = error_of(lambda: dist.all_reduce(torch.ones(1000)))
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
    return error_of(lambda: ShmSegment(store, rank, 2, 4096, timedelta(seconds=20)))


def peer_stuck() -> dict:
    """Rank 1 never calls the collective; rank 0 raises once the group's 3 s timeout passes."""
    smddp_lite.init(timeout=timedelta(seconds=3))
    dist.barrier()
    store = dist.distributed_c10d._get_default_store()
    if dist.get_rank() == 1:  # alive, and out of the call, until rank 0 has raised (12 s at most)
        with contextlib.suppress(dist.DistStoreError):
            store.wait(["peer_stuck/raised"], timedelta(seconds=12))
        os._exit(0)
    error = error_of(lambda: dist.all_reduce(torch.ones(1000)))
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
            return error_of(loss.backward)
        loss.backward()
    raise AssertionError("unreachable")


def init_only() -> dict:
    """Start the default group (its transport's setup included) and report the error, if any."""
    return error_of(lambda: smddp_lite.init(timeout=timedelta(seconds=60)))


def after_destroy() -> dict:
    smddp_lite.init()
    group = dist.group.WORLD
    dist.destroy_process_group()
    return {
        "module_api": error_of(lambda: dist.all_reduce(torch.ones(3))),
        "stale_handle": error_of(lambda: group.allreduce([torch.ones(3)]).wait()),
    }


def init_refused() -> dict:
    """smddp_lite.init() expected to raise (a configuration that cannot work): its error, on
    each rank, and how long it took (the group's timeout is 60 s)."""
    return error_of(lambda: smddp_lite.init(timeout=timedelta(seconds=60)))


def settings_differ(settings_of_rank: dict[str, dict[str, str]], numel: int = 1 << 20) -> dict:
    """Ranks whose SMDDP_* settings differ (``settings_of_rank``: rank -> variables, set before
    init): init's error on each rank, or, where init passed, what an all_reduce of ``numel``
    ones then returned (or raised)."""
    rank = int(os.environ["TEST_RANK"])
    os.environ.update(settings_of_rank.get(str(rank), {}))
    init = error_of(lambda: smddp_lite.init(timeout=timedelta(seconds=30)))
    if init["type"] is not None:
        return {"init": init}
    t = torch.ones(numel)
    call = error_of(lambda: dist.all_reduce(t))
    return {"init": init, "call": call, "sum_right": bool((t == dist.get_world_size()).all())}


def steps_differ_under_one_call(late_rank: int = -1) -> dict:
    """On one host of 2 ranks, under the hierarchical transport, the two ranks' shared-memory
    parts run different steps while naming the same user call (which settings that agree cannot
    cause: shared_settings.py): the error each raises. ``late_rank`` comes to the call 1 s after
    the others."""
    smddp_lite.init(timeout=timedelta(seconds=30))
    if dist.get_rank() == late_rank:
        time.sleep(1.0)
    from smddp_lite.backend.call import Call

    transport = dist.group.WORLD.transport
    call = Call(1, "all_reduce").step(signature("all_reduce", torch.float32, 8))  # the same on both ranks
    intra, t = transport.intra, torch.ones(8)
    step = (lambda: intra.all_reduce(call, t, RedOp.SUM)) if transport.local_rank == 0 else (
        lambda: intra.broadcast(call, t, 0))
    return error_of(step)
