"""The conformance suite: every collective, dtype and shape, written once, run on every transport.

Inputs are rank-seeded small integers that every dtype holds exactly, so any reduction order gives
one right answer and results are compared for equality (no tolerances). ``run`` executes on each
rank of a job and returns {case id: "ok" | "FAIL: why" | "unsupported: why"}; the pytest side
(test_conformance.py) turns those into test results. Case order is deterministic, so every rank
issues the same collectives in the same order. ``run(device="cuda")`` runs the same cases on CUDA
tensors (expectations are still computed on the CPU).
"""

from __future__ import annotations

import functools
import time
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from smddp_lite.backend import numerics

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.int64,
          torch.uint8, torch.int8, torch.bool]
# dtypes that ops which only move data carry as bytes (FSDP2's float8 all_gather); reductions refuse them
MOVED_DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2, torch.int16]
# irregular on purpose: odd chunk and share splits. The largest is a little over one 1 MiB
# shared-memory step in every dtype (rows odd and no multiple of 3: no multiple of 2 or 3 ranks'
# shares either), and float32's, the dtype users reduce most, spans two 4 MiB hierarchical
# pieces too. Sizing it by bytes, not elements, spares 8-byte dtypes 8 MiB per case: a third of
# the suite's data, covering the same step boundaries.
_LARGE_ROWS = {1: 1361, 2: 683, 4: 343, 8: 173}


def shapes(dtype: torch.dtype) -> list[tuple[int, ...]]:
    rows = 1361 if dtype is torch.float32 else _LARGE_ROWS[dtype.itemsize]
    return [(1,), (17,), (257,), (rows, 781)]


# Profiles: how much of the matrix a job runs. The arithmetic (dtype x op at every size) is one
# piece of code every CPU transport shares (backend/numerics.py) or a mapping each transport makes
# once per dtype and op (gloo's and MPI's own reductions): "full" runs every cell and proves it,
# on one transport per world size. "bytes" proves that a transport moves bytes: every dtype and op
# at the small sizes (each dtype's and op's path through it), and the large size, which crosses
# the transport's steps, pieces and shares, in one dtype per element size and float kind, with the
# ops that take different paths through those steps (SUM, AVG's one division after the pieces,
# MAX's comparison) and every way of laying blocks out.
FULL, BYTES = "full", "bytes"
_STEP_DTYPES = (torch.float32, torch.bfloat16, torch.int64, torch.uint8)
_STEP_REDOPS = ("sum", "avg", "max")


def _large(shape: tuple[int, ...]) -> bool:
    return len(shape) > 1
REDOPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "product": dist.ReduceOp.PRODUCT,
          "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX, "band": dist.ReduceOp.BAND,
          "bor": dist.ReduceOp.BOR, "bxor": dist.ReduceOp.BXOR}
FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
DEVICE = torch.device("cpu")  # where the cases put their tensors; run() sets it


def on_device(t: torch.Tensor) -> torch.Tensor:
    return t.to(DEVICE)


def empty(shape, dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=DEVICE)


def seeded(shape, rank: int, dtype: torch.dtype, redop: str = "sum") -> torch.Tensor:
    """Rank ``rank``'s input: small integers chosen so that the reduction ``redop`` stays exact.
    A fresh tensor each call (cases write into their inputs)."""
    values = _values(_numel(shape), rank, _kind(dtype, redop)).view(shape)
    return values.clone() if dtype is values.dtype else values.to(dtype)


def _numel(shape) -> int:
    return int(torch.tensor(shape).prod())


def _kind(dtype: torch.dtype, redop: str) -> str:
    return "bool" if dtype is torch.bool else redop if redop in ("product", "avg") else "small"


# Inputs and expectations are kept per process: computing them in int64 and float64 for every
# case took 7 of the 10 s a one-rank run of the suite takes, most of it for the 1823 x 781 shape.
@functools.lru_cache(maxsize=None)
def _values(numel: int, rank: int, kind: str) -> torch.Tensor:
    """The int64 (or bool) values of ``seeded``, flat."""
    i = torch.arange(numel, dtype=torch.int64)
    if kind == "bool":
        return (i + rank) % 3 == 0
    if kind == "product":
        return (i + rank) % 2 + 1  # 1 or 2: products <= 2**world_size, exact everywhere
    if kind == "avg":
        return (i * 7) % 11 + 2 * rank  # the sum is a multiple of the world size: the mean is exact
    return (i * 7 + rank * 3) % 11 + 1  # 1..11: sums <= 11 * world_size, exact in bfloat16


_COMBINE = {"sum": torch.add, "avg": torch.add, "product": torch.mul, "min": torch.minimum, "max": torch.maximum,
            "band": torch.bitwise_and, "bor": torch.bitwise_or, "bxor": torch.bitwise_xor}


@functools.lru_cache(maxsize=None)
def _reduced(numel: int, ranks: tuple[int, ...], redop: str) -> torch.Tensor:
    """``redop`` over the ranks' int64 inputs, flat: exact, as the values are small integers
    that every dtype holds. AVG is the float64 mean."""
    result = _values(numel, ranks[0], _kind(torch.int64, redop)).clone()
    for r in ranks[1:]:
        result = _COMBINE[redop](result, _values(numel, r, _kind(torch.int64, redop)))
    return result.to(torch.float64) / len(ranks) if redop == "avg" else result


def expected_reduction(shape, dtype, redop: str, ranks) -> torch.Tensor:
    ranks = tuple(ranks)
    if dtype is torch.bool:
        stacked = torch.stack([seeded(shape, r, dtype, redop) for r in ranks])
        return stacked.all(0) if redop in ("min", "product", "band") else (
            stacked.sum(0) % 2 == 1 if redop == "bxor" else stacked.any(0))
    return _reduced(_numel(shape), ranks, redop).view(shape).to(dtype, copy=True)


def applicable(redop: str, dtype: torch.dtype) -> bool:
    if redop == "avg":
        return dtype in FLOATS
    if redop in ("band", "bor", "bxor"):
        return dtype not in FLOATS
    return True


def _mismatch(got: torch.Tensor, want: torch.Tensor) -> str | None:
    got, want = got.cpu(), want.cpu()
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"shape/dtype {tuple(got.shape)} {got.dtype} != {tuple(want.shape)} {want.dtype}"
    bad = (got != want).reshape(-1).nonzero()
    if bad.numel():
        k = int(bad[0])
        return f"{bad.numel()} elements differ, first at {k}: got {got.reshape(-1)[k]} want {want.reshape(-1)[k]}"
    return None


# --- the cases ----------------------------------------------------------------------------------
# Each case function runs the collective on this rank and returns None or what went wrong.

def case_all_reduce(shape, dtype, redop, rank, world, async_op=False, non_contiguous=False):
    t = on_device(seeded(shape, rank, dtype, redop))
    if non_contiguous and len(shape) == 2:
        t = t.t().contiguous().t()  # same values, column-major strides
        assert not t.is_contiguous()
    work = dist.all_reduce(t, op=REDOPS[redop], async_op=async_op)
    if async_op:
        (fut_value,) = work.get_future().wait()
        work.wait()
        if fut_value.data_ptr() != t.data_ptr():
            return "future did not complete with the reduced tensor"
    return _mismatch(t, expected_reduction(shape, dtype, redop, range(world)))


def case_broadcast(shape, dtype, rank, world, root):
    t = on_device(seeded(shape, rank, dtype))
    dist.broadcast(t, src=root)
    return _mismatch(t, seeded(shape, root, dtype))


def case_reduce(shape, dtype, redop, rank, world, root):
    t = on_device(seeded(shape, rank, dtype, redop))
    dist.reduce(t, dst=root, op=REDOPS[redop])
    if rank == root:
        return _mismatch(t, expected_reduction(shape, dtype, redop, range(world)))
    # smddp leaves non-root tensors untouched (as NCCL does); torch leaves them unspecified (gloo
    # uses them as scratch), so the reference run checks the root only.
    return _mismatch(t, seeded(shape, rank, dtype, redop)) if dist.get_backend() == "smddp" else None


def case_one_element_column(dtype, rank, world, op):
    """A 1-element column of a 1 x 3 tensor: shape (1,), stride 3, contiguous to torch. Carried
    as bytes (int16, float8), viewing it so failed ("stride(-1) must be 1")."""
    def column(r):
        return seeded((1, 3), r, dtype)[:, 1]

    mine = on_device(seeded((1, 3), rank, dtype))[:, 1]
    if op == "broadcast":
        dist.broadcast(mine, src=0)
        return _mismatch(mine, column(0))
    out = empty((world,), dtype)
    dist.all_gather_into_tensor(out, mine)
    return _mismatch(out, torch.cat([column(r) for r in range(world)]))


def case_all_gather(shape, dtype, rank, world, form):
    mine = on_device(seeded(shape, rank, dtype))
    want = torch.cat([seeded(shape, r, dtype) for r in range(world)])
    if form == "list":
        outs = [empty(shape, dtype) for _ in range(world)]
        dist.all_gather(outs, mine)
        return _mismatch(torch.cat(outs), want)
    out = empty((world * shape[0],) + tuple(shape[1:]), dtype)
    if form == "in_place":
        out.chunk(world)[rank].copy_(mine)
        mine = out.chunk(world)[rank]
    dist.all_gather_into_tensor(out, mine)
    return _mismatch(out, want)


def case_all_gather_uneven(dtype, rank, world, scale, layout="separate"):
    """A list all_gather whose ranks send different sizes (rank 0 nothing), as an evaluation loop
    gathers a last, short batch: NCCL takes these; gloo refuses them. The outputs are tensors of
    their own ("separate"), the blocks of one tensor (``list(out.split(rows))``, "one_tensor"),
    or that and the input is this rank's own block ("in_place")."""
    rows = lambda q: (q * 7) % 5 * scale  # noqa: E731
    mine = on_device(seeded((rows(rank), 33), rank, dtype))
    if layout == "separate":
        outs = [empty((rows(q), 33), dtype) for q in range(world)]
    else:
        outs = list(empty((sum(rows(q) for q in range(world)), 33), dtype).split([rows(q) for q in range(world)]))
        if layout == "in_place":
            outs[rank].copy_(mine)
            mine = outs[rank]
    dist.all_gather(outs, mine)
    return _mismatch(torch.cat(outs), torch.cat([seeded((rows(q), 33), q, dtype) for q in range(world)]))


def case_premul_sum(dtype, rank, world, op, tensor_factor):
    """PREMUL_SUM (FSDP2 sends one where a gradient divide factor is set): every rank multiplies
    its input by its own factor, here (rank + 1) / 2, exact in every float dtype, then all sum."""
    factor = (rank + 1) / 2
    by_number = dist.ReduceOp.PREMUL_SUM if callable(dist.ReduceOp.PREMUL_SUM) else dist._make_nccl_premul_sum
    redop = dist._make_nccl_premul_sum(torch.tensor(factor, device=DEVICE)) if tensor_factor else by_number(factor)
    if not numerics.FACTOR_READABLE:  # a torch that hides the factor from Python: refused, clearly
        return _premul_sum_refused(op, dtype, redop) if dist.get_backend() == "smddp" else None
    shape = (1823, 3)
    scaled = lambda r, q=0: seeded(shape, r * world + q, dtype) * ((r + 1) / 2)  # noqa: E731
    if op == "all_reduce":
        t = on_device(seeded(shape, rank * world, dtype))
        dist.all_reduce(t, op=redop)
        return _mismatch(t, sum(scaled(r) for r in range(world)).to(dtype))
    if op == "reduce":
        t = on_device(seeded(shape, rank * world, dtype))
        dist.reduce(t, dst=world - 1, op=redop)
        want = sum(scaled(r) for r in range(world)).to(dtype) if rank == world - 1 else seeded(shape, rank * world, dtype)
        return _mismatch(t, want) if rank == world - 1 or dist.get_backend() == "smddp" else None
    blocks = [on_device(seeded(shape, rank * world + q, dtype)) for q in range(world)]
    out = empty(shape, dtype)
    if op == "reduce_scatter_list":
        dist.reduce_scatter(out, blocks, op=redop)
    else:
        dist.reduce_scatter_tensor(out, torch.cat(blocks), op=redop)
    unchanged = _mismatch(torch.cat(blocks), torch.cat([seeded(shape, rank * world + q, dtype) for q in range(world)]))
    return unchanged and f"the input changed: {unchanged}" or _mismatch(out, sum(scaled(r, rank) for r in range(world)).to(dtype))


def _premul_sum_refused(op, dtype, redop):
    world = dist.get_world_size()
    t, out = on_device(torch.ones(4 * world, dtype=dtype)), on_device(torch.empty(4, dtype=dtype))
    try:
        if op == "all_reduce":
            dist.all_reduce(t, op=redop)
        elif op == "reduce":
            dist.reduce(t, dst=0, op=redop)
        elif op == "reduce_scatter_list":
            dist.reduce_scatter(out, list(t.chunk(world)), op=redop)
        else:
            dist.reduce_scatter_tensor(out, t, op=redop)
    except ValueError as e:
        return None if "does not let a backend written in Python read the factor" in str(e) else f"wrong error: {e}"
    return "PREMUL_SUM ran with a factor this torch does not show to Python"


def case_reduce_scatter(shape, dtype, redop, rank, world, form):
    blocks = [on_device(seeded(shape, rank * world + q, dtype, redop) if redop != "avg"
                        else seeded(shape, rank, dtype, redop)) for q in range(world)]
    if redop == "avg":
        want = expected_reduction(shape, dtype, redop, range(world))
    else:
        want = expected_reduction(shape, dtype, redop, [r * world + rank for r in range(world)])
    if form == "list":
        out = empty(shape, dtype)
        dist.reduce_scatter(out, blocks, op=REDOPS[redop])
        return _mismatch(out, want)
    inp = torch.cat(blocks)
    out = inp.chunk(world)[rank] if form == "in_place" else empty(shape, dtype)
    dist.reduce_scatter_tensor(out, inp, op=REDOPS[redop])
    return _mismatch(out, want)


def case_all_to_all(shape, dtype, rank, world):
    inp = on_device(torch.cat([seeded(shape, rank * world + q, dtype) for q in range(world)]))
    out = torch.empty_like(inp)
    dist.all_to_all_single(out, inp)
    return _mismatch(out, torch.cat([seeded(shape, q * world + rank, dtype) for q in range(world)]))


def _blocks(shape, dtype, world, adjacent):
    """``world`` tensors of ``shape``: the blocks of one tensor (which gather and scatter move in
    place), or tensors of their own."""
    if adjacent:
        return list(empty((world * shape[0],) + tuple(shape[1:]), dtype).chunk(world))
    return [empty(shape, dtype) for _ in range(world)]


def case_gather(shape, dtype, rank, world, root, adjacent):
    mine = on_device(seeded(shape, rank, dtype))
    outs = _blocks(shape, dtype, world, adjacent) if rank == root else None
    dist.gather(mine, outs, dst=root)
    if rank == root:
        return _mismatch(torch.cat(outs), torch.cat([seeded(shape, r, dtype) for r in range(world)]))
    return _mismatch(mine, on_device(seeded(shape, rank, dtype)))  # the input is left as it was


def case_gather_input_in_output(rank, world):
    """The last rank gathers, its input lying in block 0 of its own output: the block rank 0's
    input goes to, so the input must be read before that block is written."""
    root = world - 1
    out = empty((world * 17,), torch.float32)
    blocks = list(out.chunk(world))
    mine = blocks[0] if rank == root and root != 0 else on_device(seeded((17,), rank, torch.float32))
    mine.copy_(seeded((17,), rank, torch.float32))
    dist.gather(mine, blocks if rank == root else None, dst=root)
    if rank != root:
        return None
    return _mismatch(out, torch.cat([seeded((17,), r, torch.float32) for r in range(world)]))


def case_all_gather_input_in_another_block(rank, world, rows):
    """all_gather_into_tensor whose input is the next rank's block of the output (not its own,
    the in-place form): blocks written before this rank's own goes out must not overwrite it.
    ``rows`` of 33 float32: 3000 span several shm steps."""
    out = empty((world * rows, 33), torch.float32)
    mine = out.chunk(world)[(rank + 1) % world]
    mine.copy_(seeded((rows, 33), rank, torch.float32))
    dist.all_gather_into_tensor(out, mine)
    return _mismatch(out, torch.cat([seeded((rows, 33), r, torch.float32) for r in range(world)]))


def case_all_to_all_in_place(rank, world, rows):
    """all_to_all_single with equal blocks whose output is its input: block q leaves for rank q
    while block q arrives from it, so received blocks must not overwrite blocks not yet sent."""
    x = on_device(torch.cat([seeded((rows, 33), rank * world + q, torch.float32) for q in range(world)]))
    dist.all_to_all_single(x, x)
    return _mismatch(x, torch.cat([seeded((rows, 33), q * world + rank, torch.float32) for q in range(world)]))


def case_scatter_output_in_input(rank, world):
    """Rank 0 scatters from a tensor whose block 1 is its own output: the other blocks must
    leave before that block is written."""
    x = on_device(torch.cat([seeded((17,), q, torch.float32) for q in range(world)]))
    blocks = list(x.chunk(world))
    out = blocks[1] if rank == 0 and world > 1 else empty((17,), torch.float32)
    dist.scatter(out, blocks if rank == 0 else None, src=0)
    return _mismatch(out, seeded((17,), rank, torch.float32))


def case_scatter(shape, dtype, rank, world, root, adjacent):
    ins = None
    if rank == root:
        ins = _blocks(shape, dtype, world, adjacent)
        for q, block in enumerate(ins):
            block.copy_(seeded(shape, root * world + q, dtype))
    out = empty(shape, dtype)
    dist.scatter(out, ins, src=root)
    return _mismatch(out, seeded(shape, root * world + rank, dtype))


def uneven_rows(sender: int, receiver: int, scale: int) -> int:
    """Rows rank ``sender`` sends rank ``receiver`` in the uneven all_to_all cases: 0 to 3 x
    ``scale``, different for each pair and direction (some blocks are empty)."""
    return (2 * sender + receiver) % 4 * scale


def case_all_to_all_uneven(dtype, rank, world, form, scale, width):
    """Blocks of different sizes, as MoE token routing sends: all_to_all_single with split sizes,
    or list all_to_all with tensors of different sizes."""
    sent = [seeded((uneven_rows(rank, q, scale), width), rank * world + q, dtype) for q in range(world)]
    want = [seeded((uneven_rows(q, rank, scale), width), q * world + rank, dtype) for q in range(world)]
    if form == "list":
        outs = [empty(tuple(t.shape), dtype) for t in want]
        dist.all_to_all(outs, [on_device(t) for t in sent])
        return _mismatch(torch.cat(outs), torch.cat(want))
    out = empty((sum(t.shape[0] for t in want), width), dtype)
    dist.all_to_all_single(out, on_device(torch.cat(sent)), output_split_sizes=[t.shape[0] for t in want],
                           input_split_sizes=[t.shape[0] for t in sent])
    return _mismatch(out, torch.cat(want))


def case_all_to_all_one_rank_balanced(rank, world):
    """Split sizes on every rank, equal on rank 0 only (its routing balanced, as happens in MoE):
    rank 0 sends and receives 700 rows from every rank, the others send each other uneven blocks.
    Every rank must take the same path: rank 0 took the equal all_to_all's and met its peers'
    exchange of sizes (a mismatch on shm; a hang on gloo and MPI)."""
    rows = lambda p, q: 700 if 0 in (p, q) else uneven_rows(p, q, 3000)  # noqa: E731
    width = 33
    sent = [seeded((rows(rank, q), width), rank * world + q, torch.float32) for q in range(world)]
    out = empty((sum(rows(q, rank) for q in range(world)), width), torch.float32)
    dist.all_to_all_single(out, on_device(torch.cat(sent)), output_split_sizes=[rows(q, rank) for q in range(world)],
                           input_split_sizes=[rows(rank, q) for q in range(world)])
    return _mismatch(out, torch.cat([seeded((rows(q, rank), width), q * world + rank, torch.float32)
                                     for q in range(world)]))


def case_all_to_all_uneven_in_place(rank, world):
    """An uneven all_to_all_single whose output is its input. Sizes are symmetric (rank p sends
    rank q what q sends p), so every rank's total stays the same, but a block's place in the
    sender's input differs from its place in the receiver's output, and the blocks span several
    shm steps: writing received blocks must not overwrite input that has not left yet."""
    rows = lambda p, q: (uneven_rows(p, q, 3000) + uneven_rows(q, p, 3000)) // 2 + 100 * (p + q)
    width = 33
    x = on_device(torch.cat([seeded((rows(rank, q), width), rank * world + q, torch.float32) for q in range(world)]))
    splits = [rows(rank, q) for q in range(world)]
    dist.all_to_all_single(x, x, output_split_sizes=splits, input_split_sizes=splits)
    return _mismatch(x, torch.cat([seeded((rows(q, rank), width), q * world + rank, torch.float32)
                                   for q in range(world)]))


def case_objects(rank, world):
    """The object collectives a validation loop uses: each pickles into byte tensors and calls
    gather, scatter, all_gather or broadcast."""
    mine = {"rank": rank, "loss": 1.5 * rank, "tokens": list(range(rank + 1))}
    everyone = [{"rank": r, "loss": 1.5 * r, "tokens": list(range(r + 1))} for r in range(world)]
    gathered = [None] * world if rank == world - 1 else None
    dist.gather_object(mine, gathered, dst=world - 1)
    if rank == world - 1 and gathered != everyone:
        return f"gather_object gave {gathered}"
    received = [None]
    dist.scatter_object_list(received, everyone if rank == 0 else None, src=0)
    if received[0] != everyone[rank]:
        return f"scatter_object_list gave {received[0]}"
    all_of_them = [None] * world
    dist.all_gather_object(all_of_them, mine)
    if all_of_them != everyone:
        return f"all_gather_object gave {all_of_them}"
    sent = [everyone if rank == 0 else None]
    dist.broadcast_object_list(sent, src=0)
    return None if sent[0] == everyone else f"broadcast_object_list gave {sent[0]}"


def case_async_pipeline(rank, world):
    """Several async ops in flight at once complete in order with the right values."""
    tensors = [on_device(seeded((257,), rank, torch.float32) + k) for k in range(8)]
    works = [dist.all_reduce(t, async_op=True) for t in tensors]
    chained = works[-1].get_future().then(lambda fut: fut.value()[0] * 2)
    for w in works:
        w.wait()
    for k, t in enumerate(tensors):
        want = expected_reduction((257,), torch.float32, "sum", range(world)) + k * world
        if (problem := _mismatch(t, want)) is not None:
            return f"async op {k}: {problem}"
    return _mismatch(chained.wait(), tensors[-1] * 2)


def case_autograd_leaf(rank, world, op):
    """Parameters (leaves that require grad) go through collectives as plain tensors do, as with
    torch's own backends: a script that averages or broadcasts its parameters by hand."""
    param = torch.nn.Parameter(on_device(seeded((257,), rank, torch.float32, "avg")))
    if op == "all_reduce_avg":
        dist.all_reduce(param, op=dist.ReduceOp.AVG)
        want = expected_reduction((257,), torch.float32, "avg", range(world))
    elif op == "all_reduce_sum":
        dist.all_reduce(param)
        want = sum(seeded((257,), r, torch.float32, "avg") for r in range(world))
    elif op == "broadcast":
        dist.broadcast(param, src=world - 1)
        want = seeded((257,), world - 1, torch.float32, "avg")
    else:  # all_gather_into_tensor from a parameter
        out = empty((world * 257,), torch.float32)
        dist.all_gather_into_tensor(out, param)
        return _mismatch(out, torch.cat([seeded((257,), r, torch.float32, "avg") for r in range(world)]))
    if not (param.requires_grad and param.is_leaf):
        return "the parameter stopped being a leaf that requires grad"
    return _mismatch(param.detach(), want)


def case_barrier(rank, world):
    for _ in range(3):
        dist.barrier()


def case_barrier_holds_every_rank(rank, world, late_s: float = 0.25):
    """No rank leaves a barrier before the last one has entered: the last rank, and then rank 0,
    enter ``late_s`` after the others. The ranks of a test share one machine, hence one monotonic
    clock; their times are compared after an all_gather."""
    for late in dict.fromkeys((world - 1, 0)):
        if rank == late:
            time.sleep(late_s)
        entered = time.monotonic_ns()
        dist.barrier()
        left = time.monotonic_ns()
        everyone = empty((world, 2), torch.int64)
        dist.all_gather_into_tensor(everyone, on_device(torch.tensor([[entered, left]], dtype=torch.int64)))
        times = everyone.cpu().tolist()
        early = [p for p, (_, out) in enumerate(times) if out < times[late][0]]
        if early:
            return f"ranks {early} left the barrier before rank {late}, {late_s} s late, entered it"
    return None


def case_subgroup(rank, world):
    """new_group over the even and the odd ranks (default backend); every rank creates both, as
    torch requires, and uses its own. A world of one has no odd group (torch refuses empty ones)."""
    groups = [dist.new_group([r for r in range(world) if r % 2 == parity]) for parity in (0, 1) if parity < world]
    mine = groups[rank % 2]
    members = [r for r in range(world) if r % 2 == rank % 2]
    t = on_device(seeded((17,), rank, torch.float32))
    dist.all_reduce(t, group=mine)
    return _mismatch(t, expected_reduction((17,), torch.float32, "sum", members))


def _moving_cases(dtype: torch.dtype, shape: tuple[int, ...], world: int):
    """The ops that only move data, for one dtype and shape: broadcast, all_gather in every form,
    all_to_all, gather and scatter (from the first and the last rank, blocks of one tensor or not)."""
    dn, sn = str(dtype).replace("torch.", ""), "x".join(map(str, shape))
    for form in ("list", "tensor", "in_place"):
        yield "all_gather", f"{form}-{dn}-{sn}", case_all_gather, dict(shape=shape, dtype=dtype, form=form)
    yield "all_to_all", f"{dn}-{sn}", case_all_to_all, dict(shape=shape, dtype=dtype)
    for root in sorted({0, world - 1}):
        yield "broadcast", f"root{root}-{dn}-{sn}", case_broadcast, dict(shape=shape, dtype=dtype, root=root)
        for adjacent in (False, True):
            kind = "blocks_of_one" if adjacent else "separate"
            yield "gather", f"root{root}-{kind}-{dn}-{sn}", case_gather, dict(
                shape=shape, dtype=dtype, root=root, adjacent=adjacent)
            yield "scatter", f"root{root}-{kind}-{dn}-{sn}", case_scatter, dict(
                shape=shape, dtype=dtype, root=root, adjacent=adjacent)


def cases(world: int, profile: str = FULL) -> Iterator[tuple[str, str, Callable[..., str | None], dict]]:
    """(group, case id, function, kwargs) in the one order every rank runs them; ``profile``
    (FULL or BYTES) says which cells of the dtype x op x size matrix run (see FULL above)."""
    everything = profile == FULL
    for dtype in DTYPES:
        dn = str(dtype).replace("torch.", "")
        steps = everything or dtype in _STEP_DTYPES  # this dtype crosses steps in every op
        for shape in shapes(dtype):
            if _large(shape) and not steps:
                continue
            every_op = everything or not _large(shape)
            sn = "x".join(map(str, shape))
            for redop in REDOPS:
                if applicable(redop, dtype) and (every_op or redop in _STEP_REDOPS):
                    yield "all_reduce", f"{redop}-{dn}-{sn}", case_all_reduce, dict(shape=shape, dtype=dtype, redop=redop)
            for root in sorted({0, world - 1}):
                yield "reduce", f"root{root}-{dn}-{sn}", case_reduce, dict(shape=shape, dtype=dtype, redop="sum", root=root)
            for form in ("list", "tensor", "in_place"):
                # every op once (each transport reduces blocks its own way), the common ones in every form
                for redop in REDOPS if form == "tensor" else ("sum", "max", "avg"):
                    if applicable(redop, dtype) and (every_op or redop in _STEP_REDOPS):
                        yield "reduce_scatter", f"{form}-{redop}-{dn}-{sn}", case_reduce_scatter, dict(
                            shape=shape, dtype=dtype, redop=redop, form=form)
            yield from _moving_cases(dtype, shape, world)
        # small blocks, and blocks of up to 3 x 3000 rows of 33 (1 MiB of float32: several shm steps)
        for scale, width in ((1, 5), (3000, 33)) if steps else ((1, 5),):
            for form in ("single", "list"):
                yield "all_to_all_uneven", f"{form}-{dn}-{scale}x{width}", case_all_to_all_uneven, dict(
                    dtype=dtype, form=form, scale=scale, width=width)
        yield "all_reduce", f"async-sum-{dn}", case_all_reduce, dict(shape=(257,), dtype=dtype, redop="sum", async_op=True)
        if everything or dtype in (torch.float32, torch.uint8):  # a copy to and from column-major: any dtype's bytes
            yield "all_reduce", f"non_contiguous-{dn}", case_all_reduce, dict(
                shape=(1823, 781), dtype=dtype, redop="max", non_contiguous=True)
    for op in ("all_reduce_sum", "all_reduce_avg", "broadcast", "all_gather"):
        yield "autograd", f"leaf-{op}", case_autograd_leaf, dict(op=op)
    for dtype in MOVED_DTYPES:
        dn = str(dtype).replace("torch.", "")
        # the larger crosses shm's steps (1 MiB) in every op; carried as bytes, these move as
        # uint8 does once viewed, which the small size proves
        for shape in ((17,), (1823, 781)) if everything else ((17,),):
            yield from _moving_cases(dtype, shape, world)
        yield "all_to_all_uneven", f"single-{dn}-3000x33", case_all_to_all_uneven, dict(
            dtype=dtype, form="single", scale=3000, width=33)
        yield "all_to_all_uneven", f"list-{dn}-1x5", case_all_to_all_uneven, dict(
            dtype=dtype, form="list", scale=1, width=5)
    yield "async", "pipeline", case_async_pipeline, {}
    yield "objects", "gather_scatter_all_gather_broadcast", case_objects, {}
    yield "gather", "input_in_another_block_of_the_output", case_gather_input_in_output, {}
    yield "scatter", "output_in_another_block_of_the_input", case_scatter_output_in_input, {}
    yield "all_to_all_uneven", "output_is_the_input", case_all_to_all_uneven_in_place, {}
    for rows in (1, 3000):  # 3000 rows of 33 float32: several shm steps
        yield "all_to_all", f"output_is_the_input-{rows}", case_all_to_all_in_place, dict(rows=rows)
        yield "all_gather", f"input_in_another_block_of_the_output-{rows}", case_all_gather_input_in_another_block, \
            dict(rows=rows)
    yield "all_to_all_uneven", "one_rank_balanced", case_all_to_all_one_rank_balanced, {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for op, group in (("all_reduce", "all_reduce"), ("reduce", "reduce"), ("reduce_scatter_list", "reduce_scatter"),
                          ("reduce_scatter_tensor", "reduce_scatter")):
            for tensor_factor in (False, True):
                yield group, f"premul_sum-{op}-{str(dtype).replace('torch.', '')}-{'tensor' if tensor_factor else 'number'}", \
                    case_premul_sum, dict(dtype=dtype, op=op, tensor_factor=tensor_factor)
    for dtype in (torch.float32, torch.bool, torch.float8_e4m3fn):
        for scale in (1, 3000):  # 3000 rows: several shm steps
            yield "all_gather", f"uneven-{str(dtype).replace('torch.', '')}-{scale}", case_all_gather_uneven, dict(
                dtype=dtype, scale=scale)
    for layout in ("one_tensor", "in_place"):
        for dtype in (torch.float32, torch.float8_e4m3fn):
            yield "all_gather", f"uneven-{layout}-{str(dtype).replace('torch.', '')}-3000", case_all_gather_uneven, dict(
                dtype=dtype, scale=3000, layout=layout)
    for dtype in (torch.int16, torch.float8_e4m3fn, torch.float32):
        for op in ("broadcast", "all_gather"):
            yield op, f"one_element_column-{str(dtype).replace('torch.', '')}", case_one_element_column, dict(
                dtype=dtype, op=op)
    yield "barrier", "three", case_barrier, {}
    yield "barrier", "holds_every_rank", case_barrier_holds_every_rank, {}
    yield "subgroup", "odd_even", case_subgroup, {}


def run(backend: str = "smddp", device: str = "cpu", profile: str = FULL) -> dict[str, str]:
    """Worker entry: initialise, run the profile's cases on ``device`` tensors, report per case id."""
    import smddp_lite

    global DEVICE
    DEVICE = torch.device(device)
    if DEVICE.type == "cuda":  # every rank on the first GPU: the staged path lets them share it
        torch.cuda.set_device(0)
        DEVICE = torch.device("cuda", 0)
    smddp_lite.init(backend=backend)
    report = run_cases(dist.get_rank(), dist.get_world_size(), profile)
    dist.destroy_process_group()
    return report


def run_cases(rank: int, world: int, profile: str = FULL) -> dict[str, str]:
    """The profile's cases on the default group this rank (or thread) has made: "ok", "FAIL: ..."
    or "raised: ..."."""
    report = {}
    for group, case_id, fn, kwargs in cases(world, profile):
        key = f"{group}/{case_id}"
        try:
            problem = fn(rank=rank, world=world, **kwargs)
            report[key] = "ok" if problem is None else f"FAIL: {problem}"
        except Exception as exc:  # recorded per case; reference backends lack some ops
            report[key] = f"raised: {type(exc).__name__}: {str(exc)[:300]}"
    return report
