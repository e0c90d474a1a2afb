"""Side-by-side collective benchmark for torch.distributed backends, nccl-tests style.

Each size runs on every backend in turn (A, B, A, B, ...) so that machine noise hits
all backends alike, and every timed result is then checked exactly. The exit status
is 1 when any element was wrong, as with nccl-tests.

    torchrun --standalone --nproc-per-node 2 benchmarks/collectives.py --backends smddp,gloo
    torchrun --standalone --nproc-per-node 2 benchmarks/collectives.py \\
        --ops all_reduce,all_gather,reduce_scatter --dtype bfloat16 -e 256M --json bench.json
    torchrun --nproc-per-node 8 benchmarks/collectives.py --device cuda --backends smddp,nccl
    mpiexec -n 2 python benchmarks/collectives.py --backends smddp,gloo -e 64K
"""

import argparse
import datetime
import functools
import json
import os
import platform
import resource
import shlex
import socket
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

try:
    import smddp_lite  # registers the "smddp" backend on import

    SMDDP_IMPORT_ERROR = None
except Exception as exc:  # any failure matters only when "smddp" is requested
    smddp_lite, SMDDP_IMPORT_ERROR = None, exc

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "gather", "scatter", "all_to_all",
       "all_to_all_skewed", "all_gather_uneven", "sendrecv")
REDUCING_OPS = {"all_reduce", "reduce_scatter", "reduce"}
ROOTED_OPS = {"broadcast", "reduce", "gather", "scatter"}
DTYPES = {  # --dtype: (torch dtype, nccl-tests type name)
    "float32": (torch.float32, "float"), "float16": (torch.float16, "half"),
    "bfloat16": (torch.bfloat16, "bfloat16"), "float64": (torch.float64, "double"),
    "int32": (torch.int32, "int32"), "int64": (torch.int64, "int64")}
REDOPS = {"sum": dist.ReduceOp.SUM, "prod": dist.ReduceOp.PRODUCT, "min": dist.ReduceOp.MIN,
          "max": dist.ReduceOp.MAX, "avg": dist.ReduceOp.AVG}
# float64 reference reductions; AVG is the SUM divided by n afterwards.
COMBINE = {"sum": torch.add, "avg": torch.add, "prod": torch.mul,
           "min": torch.minimum, "max": torch.maximum}
# torch 2.13 deprecates all_gather_into_tensor/reduce_scatter_tensor in favour of *_single;
# the deprecated wrappers add microseconds of warning machinery to every timed call.
ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
HEAD = "{:>12}  {:>12}  {:>8}  {:>6}  {:>6}  {:<{w}}"  # size count type redop root backend
COLUMN = "  {:>7}  {:>6}  {:>6}  {:>6}"  # time algbw busbw #wrong
PLACES = ("out_of_place", "in_place")


@dataclass(frozen=True)
class Job:
    dtype: torch.dtype
    type_name: str
    device: torch.device
    rank: int
    world: int
    root: int
    redop: str
    warmup: int
    iters: int
    check: bool
    timed_bytes: int = 0  # time at least this many message bytes per size ...
    max_iters: int = 100  # ... in at most this many calls

    def calls(self, size: int) -> int:
        """Timed calls for one size: -n, or more where -n calls move fewer than --timed-bytes."""
        return max(self.iters, min(self.max_iters, -(-self.timed_bytes // size)))


@dataclass
class Case:
    """One collective call on fixed buffers."""
    run: Callable[[], object]   # the timed call
    fill: Callable[[], object]  # (re)writes the inputs with the verification pattern
    result: torch.Tensor        # what this rank holds after the call


def byte_size(text):
    units = {"K": 1024, "M": 1024**2, "G": 1024**3}
    suffix = text[-1:].upper()
    return int(text[:-1]) * units[suffix] if suffix in units else int(text)


def comma_list(text):
    return [item.strip() for item in text.split(",") if item.strip()]


def parse_args():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", default="smddp,gloo", type=comma_list)
    p.add_argument("--ops", default="all_reduce", type=comma_list, help=", ".join(OPS))
    p.add_argument("--dtype", default="float32", choices=DTYPES)
    p.add_argument("--redop", default="sum", choices=REDOPS)
    p.add_argument("-b", "--min-bytes", default=8, type=byte_size, help="suffixes K, M, G")
    p.add_argument("-e", "--max-bytes", default=64 * 1024**2, type=byte_size)
    p.add_argument("-f", "--step-factor", default=2, type=int)
    p.add_argument("-n", "--iters", default=20, type=int)
    p.add_argument("-w", "--warmup", default=5, type=int)
    # A rate-limited link with a token bucket (the simulated hosts' tc tbf) banks credit while it
    # idles; a short timed loop of small calls spends it and runs faster than the link.
    p.add_argument("--timed-bytes", default=0, type=byte_size,
                   help="time more calls at small sizes: ceil(B / size) where that is above -n, "
                        "at most --max-iters (suffixes K, M, G)")
    p.add_argument("--max-iters", default=100, type=int, help="cap on the calls --timed-bytes adds")
    p.add_argument("--root", default=0, type=int)
    p.add_argument("--check", default=True, action=argparse.BooleanOptionalAction)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--json", metavar="PATH", help="write the preamble and every row here")
    args = p.parse_args()
    if unknown := set(args.ops) - set(OPS):
        p.error(f"unknown --ops {sorted(unknown)}; choose from {', '.join(OPS)}")
    if args.redop == "avg" and not DTYPES[args.dtype][0].is_floating_point:
        p.error("--redop avg needs a floating-point --dtype")
    if args.min_bytes < 1 or args.step_factor < 2 or args.iters < 1 or args.warmup < 0 or args.timed_bytes < 0:
        p.error("need -b >= 1, -f >= 2, -n >= 1, -w >= 0, --timed-bytes >= 0")
    if args.max_iters < args.iters:
        p.error(f"--max-iters {args.max_iters} is below -n {args.iters}; raise it or lower -n")
    if "smddp" in args.backends and smddp_lite is None:
        p.error(f"backend 'smddp' requested but `import smddp_lite` failed: "
                f"{SMDDP_IMPORT_ERROR!r} (pip install -e the project, or set PYTHONPATH)")
    return args


def select_device(kind):
    if kind == "cpu":
        return torch.device("cpu")
    local_keys = ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID")
    local = next((int(os.environ[k]) for k in local_keys if k in os.environ), 0)
    torch.cuda.set_device(local)  # before init, so NCCL-like backends bind this GPU
    return torch.device("cuda", local)


def init_distributed(backend):
    """Initialise the default process group under torchrun (env://) or mpiexec."""
    if "RANK" in os.environ:  # torchrun
        dist.init_process_group(backend=backend)
    elif smddp_lite is not None and hasattr(smddp_lite, "init"):
        smddp_lite.init(backend=backend)  # smddp-lite brings its own MPI bootstrap
    else:
        init_from_mpi(backend)


def init_from_mpi(backend):
    """Rank 0 serves a TCPStore on a free port; mpi4py tells the other ranks where."""
    env = os.environ
    if "PMI_RANK" in env:
        rank, size = int(env["PMI_RANK"]), int(env["PMI_SIZE"])
    elif "OMPI_COMM_WORLD_RANK" in env:
        rank, size = int(env["OMPI_COMM_WORLD_RANK"]), int(env["OMPI_COMM_WORLD_SIZE"])
    else:
        sys.exit("error: launch with torchrun or mpiexec (no RANK, PMI_RANK or "
                 "OMPI_COMM_WORLD_RANK in the environment)")
    from mpi4py import MPI  # only this launch path needs MPI

    comm = MPI.COMM_WORLD
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False)
        comm.bcast((socket.gethostname(), store.port), root=0)
    else:
        master, port = comm.bcast(None, root=0)
        # Loopback on rank 0's own host: container hostnames often do not resolve.
        addr = "127.0.0.1" if master == socket.gethostname() else master
        store = dist.TCPStore(addr, port, size, is_master=False)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size)


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            return next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


def describe_ranks(device):
    """Facts about every rank, gathered over gloo: object collectives need CPU support
    that a young backend may lack."""
    name = str(device)
    if device.type == "cuda":
        name += f" [{torch.cuda.get_device_name(device)}]"
    me = {"rank": dist.get_rank(), "pid": os.getpid(), "host": socket.gethostname(),
          "device": name, "cpu_model": cpu_model()}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, me, group=dist.new_group(backend="gloo"))
    return everyone


def pattern(rank, start, length, prod):
    """float64 input of `rank` for elements start..start+length-1.

    Small integers are exact in every dtype and so are their reductions: sums of 1..7
    stay <= 7n (bf16 is exact up to 256), products of {1, 2} are powers of two.
    """
    i = torch.arange(start, start + length, dtype=torch.float64)
    return (rank + i) % 2 + 1 if prod else ((rank + 1) * 3 + i) % 7 + 1


def skewed_splits(count, n):
    """all_to_all_skewed's block sizes, the same on every rank: MoE routing with a hot expert.
    Rank q receives a share 2^(n-1-q) / (2^n - 1) of every rank's ``count`` elements (rank 0 the
    most: 2/3 at 2 ranks, 8/15 at 4), and rank 0 also the rounding remainder."""
    shares = [count * 2 ** (n - 1 - q) // (2**n - 1) for q in range(n)]
    shares[0] += count - sum(shares)
    return shares


def build_case(op, count, in_place, job, group):
    n, rank, prod, redop = job.world, job.rank, job.redop == "prod", REDOPS[job.redop]
    new = lambda numel: torch.empty(numel, dtype=job.dtype, device=job.device)
    load = lambda buf, r: buf.copy_(pattern(r, 0, buf.numel(), prod))
    if op == "all_gather":  # in-place: the input is this rank's own slice of the output
        out = new(count)
        inp = out.chunk(n)[rank] if in_place else new(count // n)
        return Case(lambda: ALL_GATHER(out, inp, group=group), lambda: load(inp, rank), out)
    if op == "reduce_scatter":  # in-place: the output is this rank's own slice of the input
        inp = new(count)
        out = inp.chunk(n)[rank] if in_place else new(count // n)
        run = lambda: REDUCE_SCATTER(out, inp, op=redop, group=group)
        return Case(run, lambda: load(inp, rank), out)
    if op == "all_gather_uneven":  # in-place: the input is this rank's own block of the outputs
        return uneven_all_gather_case(count, in_place, job, group, new, load)
    # the others have no in-place form in torch's API, so both columns time the same call on
    # dedicated buffers: two independent measurements. Sizes are the whole message (nccl-tests):
    # gather's output, scatter's input, every block of all_to_all (each rank's input, for the skewed one
    # too), all_gather_uneven's output; sendrecv sends all of it.
    k, root = count // n, job.root
    if op == "gather":
        inp, out = new(k), new(count)
        blocks = list(out.chunk(n)) if rank == root else None
        return Case(lambda: dist.gather(inp, blocks, dst=root, group=group), lambda: load(inp, rank), out)
    if op == "scatter":
        inp, out = new(count), new(k)
        blocks = list(inp.chunk(n)) if rank == root else None
        return Case(lambda: dist.scatter(out, blocks, src=root, group=group), lambda: load(inp, root), out)
    if op == "all_to_all":
        inp, out = new(count), new(count)
        return Case(lambda: dist.all_to_all_single(out, inp, group=group), lambda: load(inp, rank), out)
    if op == "all_to_all_skewed":  # rank q receives splits[q] elements from every rank
        splits = skewed_splits(count, n)
        inp, out = new(count), new(n * splits[rank])
        run = lambda: dist.all_to_all_single(out, inp, output_split_sizes=[splits[rank]] * n,
                                             input_split_sizes=splits, group=group)
        return Case(run, lambda: load(inp, rank), out)
    if op == "sendrecv":  # a ring: each rank sends to the next and receives from the one before
        inp, out = new(count), new(count)
        after, before = (rank + 1) % n, (rank - 1) % n

        def ring():
            for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, inp, after, group),
                                                dist.P2POp(dist.irecv, out, before, group)]):
                work.wait()
        return Case(ring, lambda: load(inp, rank), out)
    # all_reduce, broadcast and reduce only have an in-place torch API, so both columns
    # time the same call on a dedicated buffer: two independent measurements.
    buf = new(count)
    if op == "broadcast":  # non-roots start at zero, so a broadcast that moves nothing fails
        fill = lambda: load(buf, job.root) if rank == job.root else buf.zero_()
        return Case(lambda: dist.broadcast(buf, src=job.root, group=group), fill, buf)
    if op == "reduce":
        run = lambda: dist.reduce(buf, dst=job.root, op=redop, group=group)
    else:
        run = lambda: dist.all_reduce(buf, op=redop, group=group)
    return Case(run, lambda: load(buf, rank), buf)


def uneven_all_gather_case(count, in_place, job, group, new, load):
    """A list all_gather whose inputs differ in size (rank q's is skewed_splits[q] elements),
    into the blocks of one tensor; in place, each rank's input is its own block."""
    n, rank = job.world, job.rank
    sizes = skewed_splits(count, n)
    out = new(count)
    blocks = list(out.split(sizes))
    inp = blocks[rank] if in_place else new(sizes[rank])
    if dist.get_backend(group) != "gloo":
        return Case(lambda: dist.all_gather(blocks, inp, group=group), lambda: load(inp, rank), out)
    # gloo refuses inputs of different sizes; what its users write instead: pad every
    # input to the largest, all_gather those, and copy each rank's part out
    padded, everyone = new(max(sizes)), new(n * max(sizes))

    def pad_and_gather():
        padded[: sizes[rank]].copy_(inp)
        ALL_GATHER(everyone, padded, group=group)
        for q, block in enumerate(blocks):
            block.copy_(everyone[q * max(sizes) : q * max(sizes) + sizes[q]])
    return Case(pad_and_gather, lambda: load(inp, rank), out)


def expected_result(op, count, job):
    """float64 values this rank must hold after one call; None where the result is
    undefined (reduce on non-root ranks)."""
    n, prod = job.world, job.redop == "prod"
    if op == "broadcast":
        return pattern(job.root, 0, count, prod)
    if op == "all_gather":
        return torch.cat([pattern(r, 0, count // n, prod) for r in range(n)])
    if op == "all_gather_uneven":
        return torch.cat([pattern(r, 0, size, prod) for r, size in enumerate(skewed_splits(count, n))])
    if op in ("reduce", "gather") and job.rank != job.root:
        return None
    k = count // n
    if op == "gather":
        return torch.cat([pattern(r, 0, k, prod) for r in range(n)])
    if op == "scatter":
        return pattern(job.root, job.rank * k, k, prod)
    if op == "all_to_all":  # block q comes from rank q's block of this rank
        return torch.cat([pattern(q, job.rank * k, k, prod) for q in range(n)])
    if op == "all_to_all_skewed":  # block q: this rank's block of rank q's input
        splits = skewed_splits(count, n)
        return torch.cat([pattern(q, sum(splits[: job.rank]), splits[job.rank], prod) for q in range(n)])
    if op == "sendrecv":
        return pattern((job.rank - 1) % n, 0, count, prod)
    start, length = (job.rank * (count // n), count // n) if op == "reduce_scatter" else (0, count)
    inputs = (pattern(r, start, length, prod) for r in range(n))
    total = functools.reduce(COMBINE[job.redop], inputs)
    return total / n if job.redop == "avg" else total


def quantized_wire_bound(ranks, job):
    """What smddp's 8-bit inter-host wire may cost an all_reduce SUM's element, or None where
    the run has no such wire (and every result must be exact). Each host's sum is quantized
    once and the float32 sum of those once more; a block's scale is at most its largest
    magnitude over the format's largest value, so an element is off by at most half a step of
    each (int8), or half a float8 step relative to it (kernels/quantize.py)."""
    from smddp_lite.config import QUANTIZED_WIRE_DTYPES, backend_config

    wire = backend_config().inter_node_wire_dtype
    if wire not in QUANTIZED_WIRE_DTYPES or job.redop != "sum" or job.dtype != torch.float32:
        return None
    from smddp_lite.kernels.quantize import FORMATS

    hosts = {}
    for r in ranks:
        hosts.setdefault(r["host"], []).append(r["rank"])
    largest_input = 7.0  # pattern()'s values are 1..7
    host_sum = largest_input * max(len(members) for members in hosts.values())
    through = len(hosts) * host_sum + largest_input * job.world  # the hosts' sums, then their sum
    qmax, mantissa, min_exp = FORMATS[getattr(torch, wire)]
    if mantissa == 0:
        return through / qmax / 2
    return through * (2.0 ** -(mantissa + 1) + 2.0 ** (min_exp - mantissa - 1) / qmax)


def count_wrong(result, expected, job, bound=None):
    """Elements of ``result`` off ``expected``: by more than ``bound`` where a lossy wire
    carried them (quantized_wire_bound), else by anything (one ulp for AVG)."""
    if expected is None:
        return 0
    # AVG divides in the collective's dtype (or multiplies by 1/n), so allow one ulp,
    # which eps * |x| bounds from above; everything else must match exactly.
    tol = torch.finfo(job.dtype).eps * expected.abs() if job.redop == "avg" else 0.0
    if bound is not None:
        tol = bound
    close = (result.cpu().double() - expected).abs() <= tol
    return int((~close).sum())  # NaN compares false, so it counts as wrong


def group_reduce(value, op, dtype, job, group):
    t = torch.tensor([value], dtype=dtype, device=job.device)
    dist.all_reduce(t, op=op, group=group)
    return t.item()


def synchronize(device):
    if device.type == "cuda":  # GPU collectives return before the work is done
        torch.cuda.synchronize(device)


def process_cpu_s() -> float:
    """CPU time of this process, every thread's (a transport's own threads do its work)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def measure(case, expected, job, group, iters, bound=None):
    """Time `iters` back-to-back calls, then verify one fresh call: (time_us, #wrong, cpu_us),
    cpu_us being the CPU time per call of the rank that used the most."""
    case.fill()  # uninitialised memory may hold NaNs/denormals that slow CPU reductions
    for _ in range(job.warmup):
        case.run()
    synchronize(job.device)
    dist.barrier(group=group)
    start, cpu_start = time.perf_counter(), process_cpu_s()
    for _ in range(iters):
        case.run()
    synchronize(job.device)
    local_us = (time.perf_counter() - start) / iters * 1e6
    local_cpu_us = (process_cpu_s() - cpu_start) / iters * 1e6
    time_us = group_reduce(local_us, dist.ReduceOp.MAX, torch.float64, job, group)  # slowest rank
    cpu_us = group_reduce(local_cpu_us, dist.ReduceOp.MAX, torch.float64, job, group)
    if not job.check:
        return time_us, None, cpu_us
    case.fill()  # the timed loop overwrote in-place buffers
    case.run()
    synchronize(job.device)
    wrong = count_wrong(case.result, expected, job, bound)
    return time_us, int(group_reduce(wrong, dist.ReduceOp.SUM, torch.int64, job, group)), cpu_us


def bus_factor(op, n):
    """nccl-tests: busbw = algbw * factor is comparable to the link speed."""
    return {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n,
            "gather": (n - 1) / n, "scatter": (n - 1) / n, "all_to_all": (n - 1) / n,
            "all_to_all_skewed": (n - 1) / n, "all_gather_uneven": (n - 1) / n}.get(op, 1.0)


def make_row(op, size, backend, results, job):
    row = {"op": op, "size": size, "count": size // job.dtype.itemsize, "type": job.type_name,
           "redop": job.redop if op in REDUCING_OPS else "none",
           "root": job.root if op in ROOTED_OPS else -1, "backend": backend, "iters": job.calls(size)}
    for place, (time_us, wrong, cpu_us) in zip(PLACES, results):
        algbw = size / time_us / 1e3  # bytes/us -> GB/s
        row[place] = {"time_us": time_us, "algbw": algbw,
                      "busbw": algbw * bus_factor(op, job.world), "wrong": wrong, "cpu_us": cpu_us}
    return row


def format_time(us):  # nccl-tests keeps the column 7 wide
    return f"{us:.0f}" if us >= 10000 else f"{us:.1f}" if us >= 100 else f"{us:.2f}"


def format_row(row, width):
    head = HEAD.format(*(row[k] for k in ("size", "count", "type", "redop", "root", "backend")),
                       w=width)
    return head + "".join(
        COLUMN.format(format_time(c["time_us"]), f"{c['algbw']:.2f}", f"{c['busbw']:.2f}",
                      "N/A" if c["wrong"] is None else c["wrong"])
        for c in (row[place] for place in PLACES))


def preamble_lines(op, ranks, labels, device):
    hosts = ", ".join(dict.fromkeys(r["host"] for r in ranks))
    return [f"# smddp-lite collective benchmark: {op}",
            f"# nranks {len(ranks)}, hosts: {hosts}, device {device.type}, "
            f"torch {torch.__version__}, backends: {', '.join(labels)}",
            *(f"#  Rank {r['rank']:2d} Pid {r['pid']:6d} on {r['host']} device {r['device']}"
              for r in ranks), "#"]


def table_header(width):
    head = HEAD.format("size", "count", "type", "redop", "root", "backend", w=width)
    units = HEAD.format("(B)", "(elements)", "", "", "", "", w=width)
    col = COLUMN.format("time", "algbw", "busbw", "#wrong")
    col_units = COLUMN.format("(us)", "(GB/s)", "(GB/s)", "")
    groups = " " * len(head) + "out-of-place".center(len(col)) + "in-place".center(len(col))
    return ["#" + line[1:].rstrip() for line in (groups, head + col * 2, units + col_units * 2)]


def footer_lines(per_size, labels):
    lines = ["#"]
    for b, label in enumerate(labels):
        cols = [rows[b][place] for _, rows in per_size for place in PLACES]
        wrong = [c["wrong"] for c in cols]
        status = ("N/A (not checked)" if None in wrong
                  else f"{sum(wrong)} {'FAILED' if any(wrong) else 'OK'}")
        avg = sum(c["busbw"] for c in cols) / len(cols)  # nccl-tests: both columns
        lines += [f"# Out of bounds values : {status} ({label})",
                  f"# Avg bus bandwidth    : {avg:.6g} ({label})"]
    return lines


def ratio_lines(per_size, labels):
    """First backend against each other one, out-of-place column: ratios (> 1: first is faster)
    and the first one's extra time per call in microseconds (its per-call overhead where the
    other is the reference). busbw is 0 for one rank (nothing crosses a link), so its ratio is
    then n/a and the time columns say it all."""
    lines = []
    for b in range(1, len(labels)):
        first, other = labels[0], labels[b]
        bus, tim = f"busbw({first})/busbw({other})", f"time({other})/time({first})"
        extra = f"time({first})-time({other}) (us)"
        lines += ["#", f"# out-of-place ratios, > 1 means {first} is faster than {other}",
                  f"#{'size':>11}  {bus}  {tim}  {extra}"]
        for size, rows in per_size:
            a, o = rows[0]["out_of_place"], rows[b]["out_of_place"]
            busbw = f"{a['busbw'] / o['busbw']:.3f}" if a["busbw"] and o["busbw"] else "n/a"
            lines.append(f"{size:12d}  {busbw:>{len(bus)}}  {o['time_us'] / a['time_us']:>{len(tim)}.3f}  "
                         f"{a['time_us'] - o['time_us']:>{len(extra)}.2f}")
    return lines


def sizes_to_run(args, job):
    """min..max by step factor, rounded down so that blocks (all_gather, gather, ...) split evenly."""
    unit, size, sizes = job.dtype.itemsize * job.world, args.min_bytes, []
    while size <= args.max_bytes:
        if size >= unit and size // unit * unit not in sizes:
            sizes.append(size // unit * unit)
        size *= args.step_factor
    return sizes


def run_op(op, sizes, job, backends, say, wire_bound=None):
    """Benchmark one op over all sizes, alternating backends within each size; smddp's
    all_reduce is checked within ``wire_bound`` where its inter-host wire is 8-bit."""
    labels = [label for label, _ in backends]
    width = max(7, *map(len, labels))
    say("\n".join(table_header(width)))
    per_size = []
    for size in sizes:
        count, calls = size // job.dtype.itemsize, job.calls(size)
        expected = expected_result(op, count, job) if job.check else None
        rows = []
        for label, group in backends:
            bound = wire_bound if label == "smddp" and op == "all_reduce" else None
            results = [measure(build_case(op, count, in_place, job, group), expected, job, group, calls, bound)
                       for in_place in (False, True)]
            rows.append(make_row(op, size, label, results, job))
            say(format_row(rows[-1], width), flush=True)
        per_size.append((size, rows))
    say("\n".join(footer_lines(per_size, labels) + ratio_lines(per_size, labels)))
    return [row for _, rows in per_size for row in rows]


def write_json(path, ranks, args, rows):
    facts = {"hosts": [r["host"] for r in ranks], "ranks": ranks, "world_size": len(ranks),
             "torch": torch.__version__, "backends": args.backends, "device": args.device,
             "command_line": shlex.join(sys.argv),
             "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}
    with open(path, "w") as f:
        json.dump({"preamble": facts, "rows": rows}, f, indent=1)


def main():
    args = parse_args()
    device = select_device(args.device)
    init_distributed(args.backends[0])
    rank, world = dist.get_rank(), dist.get_world_size()
    if not 0 <= args.root < world:
        sys.exit(f"error: --root {args.root} is not a rank of this {world}-rank job")
    job = Job(*DTYPES[args.dtype], device, rank, world, args.root, args.redop,
              args.warmup, args.iters, args.check, args.timed_bytes, args.max_iters)
    # The default group runs the first backend; every further backend gets a group of
    # all ranks, so global ranks are group ranks for root/src/dst.
    groups = [dist.group.WORLD] + [dist.new_group(backend=b) for b in args.backends[1:]]
    backends = list(zip(args.backends, groups))
    ranks = describe_ranks(device)
    say = print if rank == 0 else (lambda *a, **k: None)
    sizes, rows = sizes_to_run(args, job), []
    wire_bound = quantized_wire_bound(ranks, job) if "smddp" in args.backends else None
    for op in args.ops:
        say("\n".join(preamble_lines(op, ranks, args.backends, device)))
        if wire_bound is not None and op == "all_reduce":
            say(f"# smddp's inter-host wire is 8-bit: its results are checked within {wire_bound:.4g} of the "
                "exact sums (two quantizations), not exactly")
        rows += run_op(op, sizes, job, backends, say, wire_bound)
        say()
    if rank == 0 and args.json:
        write_json(args.json, ranks, args, rows)
    dist.destroy_process_group()
    # #wrong was summed over each group, so every rank takes the same exit status.
    sys.exit(1 if any(row[place]["wrong"] for row in rows for place in PLACES) else 0)


if __name__ == "__main__":
    main()
