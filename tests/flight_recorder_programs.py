"""Programs for tests/test_flight_recorder.py: jobs that go apart in one way each, and write the
flight recorder's dumps that torch's analyzer then reads."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import smddp_lite

from .rank_helpers import error_of

PREFIX = "smddp_fr_rank_"


def _wait_for(path: Path, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not path.exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def drill(case: str, culprit: int, dump_dir: str, timeout_s: float = 3.0) -> dict:
    """Two all_reduces that every rank makes (collectives 1 and 2), then collective 3 (an
    all_reduce of 8 floats), where ``culprit`` skips it (and waits in its own code), calls a
    broadcast instead, passes 9 floats, stops (SIGSTOP) or dies. Every rank that can then
    waits for its own dump, written without being asked: by the failed call, or by the group's
    watcher when a peer's call failed."""
    os.environ["TORCH_FR_DUMP_TEMP_FILE"] = str(Path(dump_dir) / PREFIX)  # read at init and at each dump
    try:
        smddp_lite.init(timeout=timedelta(seconds=timeout_s))
        rank = dist.get_rank()
        t = torch.ones(8)
        dist.all_reduce(t)
        dist.all_reduce(t)
        mine = Path(dump_dir) / f"{PREFIX}{rank}"
        report = {"rank": rank}
        if rank != culprit:
            report["error"] = error_of(lambda: dist.all_reduce(t))
        elif case == "skip":
            pass  # in its own code: the watcher dumps once a peer's call failed
        elif case == "op":
            report["error"] = error_of(lambda: dist.broadcast(t, 0))
        elif case == "size":
            report["error"] = error_of(lambda: dist.all_reduce(torch.ones(9)))
        elif case == "stop":
            # stopped until every peer has dumped, then resumed (a rank that was slow): a shell
            # resumes it, since nothing in a stopped process runs
            test = " -a ".join(f"-e {Path(dump_dir) / f'{PREFIX}{r}'}" for r in range(dist.get_world_size())
                               if r != rank)
            subprocess.Popen(["sh", "-c", f"until [ {test} ]; do sleep 0.1; done; kill -CONT {os.getpid()}"])
            os.kill(os.getpid(), signal.SIGSTOP)
        elif case == "die":
            os._exit(9)
        deadline = 4 * timeout_s + 10
        report["dumped"] = _wait_for(mine, deadline)
        # and stays until every rank that can has dumped: rank 0 hosts the store that a resumed
        # rank's watcher hears the failure through (CI saw rank 0 gone before rank 1 looked)
        alive = [r for r in range(dist.get_world_size()) if case != "die" or r != culprit]
        for r in alive:
            _wait_for(Path(dump_dir) / f"{PREFIX}{r}", deadline)
        if case == "die" and "mpi4py.MPI" in sys.modules:
            # MPI_Finalize would wait for the dead rank: worker.py leaves without it
            os.environ["TEST_SKIP_MPI_FINALIZE"] = "1"
        return report
    finally:
        os.environ.pop("TORCH_FR_DUMP_TEMP_FILE", None)


def on_demand(dump_dir: str) -> dict:
    """Three all_reduces and an all_gather_into_tensor, then a dump through smddp_lite's function
    (torch's ``_dump_fr_trace`` returns the same pickle for its own backends)."""
    import pickle

    smddp_lite.init()
    t = torch.ones(5)
    for _ in range(3):
        dist.all_reduce(t)
    out = torch.empty(5 * dist.get_world_size())
    dist.all_gather_into_tensor(out, t)
    data = smddp_lite.dump_fr_trace()
    (Path(dump_dir) / f"{PREFIX}{dist.get_rank()}").write_bytes(data)
    dump = pickle.loads(data)
    dist.destroy_process_group()
    return {"names": [e["profiling_name"] for e in dump["entries"]],
            "seq": [e["collective_seq_id"] for e in dump["entries"]],
            "states": [e["state"] for e in dump["entries"]], "pg_config": dump["pg_config"],
            "keys": sorted(dump["entries"][0])}


def profiled_ranges() -> dict:
    """The names of the ranges torch.profiler shows for an all_reduce and a broadcast."""
    from torch.profiler import profile

    smddp_lite.init()
    with profile() as prof:
        dist.all_reduce(torch.ones(256))
        dist.broadcast(torch.ones(16), 0)
    names = sorted({e.name for e in prof.events() if e.name.startswith("smddp:")})
    dist.destroy_process_group()
    return {"names": names}
