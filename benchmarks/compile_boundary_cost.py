"""What keeping torch.compile out of the backend costs a small call: nothing, shown side by side.

backend/compile_boundary.py marks every code object of the backend "skip" for dynamo when a group
is made. A call should pay nothing for it (the mark is read only where dynamo's frame hook runs,
and no hook runs outside torch.compile), and this measures that: one job, one group, rounds that
alternate between the backend's code unmarked (as it was before the marks) and marked, timing
single 8 B all_reduces on the shared-memory fast path. Both arms run the same code objects in the
same processes, so machine noise hits them alike; the per-run swings between separate jobs
(10-15% on 2 busy cores) are larger than anything this could show otherwise.

    torchrun --standalone --nproc-per-node 2 benchmarks/compile_boundary_cost.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.distributed as dist

import smddp_lite
from smddp_lite.backend import compile_boundary


def _codes() -> list:
    return [code for name, module in list(sys.modules.items())
            if module is not None and name.startswith(compile_boundary._PACKAGE)
            for code in compile_boundary._codes_of(module)]


def _set_all(codes: list, marked: bool) -> None:
    found = compile_boundary._skip_strategy()
    if found is None:
        raise SystemExit("this torch has no per-code eval-frame strategy: nothing is marked, nothing to measure")
    set_strategy, skip = found
    frame = torch._C._dynamo.eval_frame
    plain = frame._FrameExecStrategy(frame._FrameAction.DEFAULT, frame._FrameAction.DEFAULT)
    for code in codes:
        set_strategy(code, skip if marked else plain)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000, help="timed calls per arm and round")
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    smddp_lite.init(backend="smddp")
    codes = _codes()
    t = torch.zeros(2)  # 8 B of float32
    times: dict[str, list[float]] = {"unmarked": [], "marked": []}
    rounds: list[float] = []  # each round's marked/unmarked p50
    for r in range(args.rounds):
        for arm in (("unmarked", "marked") if r % 2 == 0 else ("marked", "unmarked")):  # neither always first
            _set_all(codes, arm == "marked")
            dist.barrier()
            for _ in range(100):  # warm-up
                dist.all_reduce(t)
            for _ in range(args.calls):
                start = time.perf_counter()
                dist.all_reduce(t)
                times[arm].append(time.perf_counter() - start)
        rounds.append(statistics.median(times["marked"][-args.calls:]) / statistics.median(times["unmarked"][-args.calls:]))
    if dist.get_rank() == 0:
        print(f"# 2 ranks, 8 B float32 all_reduce on {dist.group.WORLD.transport.name}, {args.calls} calls x "
              f"{args.rounds} alternating rounds per arm, {len(codes)} code objects of the backend (rank 0's view)")
        print(f"# {'arm':<10} {'p50 us':>8} {'p90 us':>8} {'mean us':>8}")
        for arm, values in times.items():
            q = statistics.quantiles(values, n=10)
            print(f"  {arm:<10} {statistics.median(values) * 1e6:8.1f} {q[8] * 1e6:8.1f} "
                  f"{statistics.fmean(values) * 1e6:8.1f}")
        ratio = statistics.median(times["marked"]) / statistics.median(times["unmarked"])
        print(f"  marked/unmarked p50: {ratio:.3f} (rounds: {min(rounds):.3f}-{max(rounds):.3f}, "
              f"median {statistics.median(rounds):.3f})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
