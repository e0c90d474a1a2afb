"""Peak host memory one backend's collective adds on each rank, beyond its inputs and outputs.

A collective that allocates a fresh buffer per call (padding, staging) shows as the peak resident
set (VmHWM) over a few calls above the resident set before them. The buffers of the call are made
and filled first, one small call of the same op sets up the backend's own buffers, and the peak
is then reset (/proc/self/clear_refs), so filling the inputs (in float64) does not count. One
backend per run:

    torchrun --standalone --nproc-per-node 2 benchmarks/peak_memory.py --op all_to_all_skewed --bytes 64M
    torchrun --standalone --nproc-per-node 2 benchmarks/peak_memory.py --op all_to_all_skewed --backend gloo

The ops and their buffers are those of benchmarks/collectives.py (Linux only: /proc).
"""

import argparse

import torch
import torch.distributed as dist

try:
    from benchmarks import collectives  # python -m benchmarks.peak_memory
except ImportError:  # torchrun benchmarks/peak_memory.py: the script's folder is on sys.path
    import collectives


def resident_mib(field: str) -> float:
    """VmRSS (now) or VmHWM (the peak since the last reset), in MiB."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # sets VmHWM to VmRSS (Linux >= 4.0)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="smddp")
    p.add_argument("--op", default="all_to_all_skewed", choices=collectives.OPS)
    p.add_argument("--bytes", default=64 << 20, type=collectives.byte_size, help="message size (suffixes K, M, G)")
    p.add_argument("--dtype", default="float32", choices=collectives.DTYPES)
    p.add_argument("--calls", default=3, type=int)
    args = p.parse_args()
    collectives.init_distributed(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype, type_name = collectives.DTYPES[args.dtype]
    job = collectives.Job(dtype, type_name, torch.device("cpu"), rank, world, 0, "sum", 0, 1, True)
    unit = dtype.itemsize * world
    small = collectives.build_case(args.op, world * world, False, job, dist.group.WORLD)
    small.fill()
    small.run()  # the backend's own buffers (shm segments, scratch) are made here
    count = args.bytes // unit * unit // dtype.itemsize
    case = collectives.build_case(args.op, count, False, job, dist.group.WORLD)
    case.fill()  # touches the inputs; outputs are touched below
    case.result.zero_()
    dist.barrier()
    reset_peak()
    before = resident_mib("VmRSS")
    for _ in range(args.calls):
        case.run()
    after = resident_mib("VmHWM")
    wrong = collectives.count_wrong(case.result, collectives.expected_result(args.op, count, job), job)
    facts = torch.tensor([before, after, after - before, wrong], dtype=torch.float64)
    everyone = [torch.empty_like(facts) for _ in range(world)]
    dist.all_gather(everyone, facts)
    if rank == 0:
        print(f"# {args.backend} {args.op} {count * dtype.itemsize} B of {args.dtype}, {args.calls} calls, "
              f"{world} ranks: resident set before the calls, its peak during them, added (MiB); #wrong")
        for r, (b, a, added, bad) in enumerate(t.tolist() for t in everyone):
            print(f"rank {r:3d}  {b:10.1f}  {a:10.1f}  {added:8.1f}  {int(bad)}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
