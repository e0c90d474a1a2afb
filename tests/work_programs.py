"""Programs of test_work.py: what a call's Work holds, frees and raises.

Each program runs on every rank of a test job (see harness.py) and returns what it observed."""

from __future__ import annotations

import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import smddp_lite

from .rank_helpers import (
    error_of,
    let_gloo_workers_finish,
    parity_model,
    stay_until_peers_report,
    train_side_by_side,
)


def ddp_powersgd_parity(steps: int = 12) -> dict:
    """DDP with torch's PowerSGD hook on "smddp" and on "gloo", side by side in one job. The
    hook's future callbacks all-reduce P and then Q and wait for each inside the callback, which
    runs on the thread that completed the first all_reduce: smddp's communication thread."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    smddp_lite.init(timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    gloo = dist.new_group(backend="gloo")
    variants = {"smddp": DDP(parity_model(), process_group=dist.group.WORLD),
                "gloo": DDP(parity_model(), process_group=gloo)}
    for name, group in (("smddp", dist.group.WORLD), ("gloo", gloo)):
        # compression from the third step on; every matrix compressed (min_compression_rate 0)
        state = powerSGD_hook.PowerSGDState(process_group=group, matrix_approximation_rank=2, start_powerSGD_iter=2,
                                            min_compression_rate=0.0, use_error_feedback=True)
        variants[name].register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    losses = train_side_by_side(variants, rank, steps, momentum=0.0)
    diff = max(float((p - q).abs().max()) for p, q in zip(variants["smddp"].parameters(),
                                                          variants["gloo"].parameters()))
    let_gloo_workers_finish()
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
        stay_until_peers_report(store, [0])
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
              "next_call": error_of(lambda: dist.all_reduce(torch.ones(10)))}
    store.set("test-reported/0", "1")
    return report
