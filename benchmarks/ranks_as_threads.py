"""The conformance suite (tests/conformance.py) with its ranks as threads of one process against
its ranks as the test harness's pooled processes, side by side: does running ranks as threads,
as torch's MultiThreadedTestCase does, make the tests faster on this machine?

    python benchmarks/ranks_as_threads.py --transports shm,gloo --worlds 2,3 --rounds 2

Threads: torch's thread-local world (torch.testing._internal.distributed.multi_threaded_pg) with
c10d's thread isolation, so each thread's ``init_process_group("smddp")`` makes its own
ProcessGroupSMDDP over one in-process HashStore and a real transport. Processes: tests/harness.py's
``launch``, whose ranks come from its pool of forked, already-imported processes (warmed by one
job first, as in a test session). Every case's outcome is compared with "ok"; the exit code is
non-zero if any case failed either way.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def in_threads(world: int) -> dict[int, dict[str, str]]:
    """Every conformance case on ``world`` ranks that are threads of this process."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed import multi_threaded_pg

    from tests import conformance

    store = dist.HashStore()
    multi_threaded_pg._install_threaded_pg()
    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    reports: dict[int, dict[str, str]] = {}

    def rank(r: int) -> None:
        dist.init_process_group("smddp", store=store, rank=r, world_size=world, timeout=timedelta(seconds=120))
        reports[r] = conformance.run_cases(r, world)
        dist.destroy_process_group()

    try:
        threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
        multi_threaded_pg._uninstall_threaded_pg()
    return reports


def in_processes(world: int, transport: str) -> dict[int, dict[str, str]]:
    from tests import harness

    results = harness.launch("tests.conformance:run", world, env={"SMDDP_TRANSPORT": transport}, timeout=600)
    return dict(enumerate(harness.values(results)))


def failures(reports: dict[int, dict[str, str]]) -> list[str]:
    return [f"rank {r} {case}: {status}" for r, report in reports.items() for case, status in report.items()
            if status != "ok"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--transports", default="shm,gloo")
    parser.add_argument("--worlds", default="2,3")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import smddp_lite  # noqa: F401  (registers the backend for the threads)

    in_processes(2, "shm")  # the pool's zygote and first ranks, as early in a test session
    bad = 0
    print(f"{'transport':>9} {'world':>5} {'round':>5} {'cases':>6} {'threads s':>9} {'processes s':>11} "
          f"{'threads / processes':>19}")
    for transport in args.transports.split(","):
        os.environ["SMDDP_TRANSPORT"] = transport  # the threads read it at init; launch passes it on
        for world in (int(w) for w in args.worlds.split(",")):
            for round_ in range(1, args.rounds + 1):
                start = time.perf_counter()
                threaded = in_threads(world)
                threads_s = time.perf_counter() - start
                start = time.perf_counter()
                processes = in_processes(world, transport)
                processes_s = time.perf_counter() - start
                wrong = failures(threaded) + failures(processes)
                bad += len(wrong)
                for line in wrong[:5]:
                    print("  ", line)
                print(f"{transport:>9} {world:>5} {round_:>5} {len(threaded[0]):>6} {threads_s:>9.1f} "
                      f"{processes_s:>11.1f} {threads_s / processes_s:>19.2f}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
