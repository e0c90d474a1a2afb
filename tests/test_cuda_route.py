"""The CUDA route, decided before a call runs: NCCL's table (backend/cuda/support.py) and the
router's questions (backend/cuda/route.py). Both are plain data and functions of the call's
arguments, so they run here without a GPU; the GPU tests (test_cuda.py) run the calls."""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch
import torch.distributed as dist

from smddp_lite.backend.cuda.communicators import NCCL_DTYPE_NAMES, NCCL_OP_NAMES
from smddp_lite.backend.cuda.route import gathers_unevenly, staging_reason
from smddp_lite.backend.cuda.support import NCCL_FORMS, NcclSupport
from smddp_lite.backend.ops import RedOp

# NCCL's codes as cupy numbers them matter only as distinct values: the table copies them
DTYPE_CODES = {dt: i for i, dt in enumerate(NCCL_DTYPE_NAMES)}
OP_CODES = {op: 100 + i for i, op in enumerate(NCCL_OP_NAMES)}
NCCL_2_21, NCCL_2_9 = 22100, 2908


def table(world_size: int = 2, version: int = NCCL_2_21) -> NcclSupport:
    return NcclSupport(DTYPE_CODES, OP_CODES, world_size, version)


def test_nccl_reduces_its_dtypes_with_its_ops_and_nothing_divides_on_a_recent_nccl():
    support = table()
    for dtype in DTYPE_CODES:
        for red in (RedOp.SUM, RedOp.PRODUCT, RedOp.MIN, RedOp.MAX, RedOp.AVG):
            code = support.reduce_code(dtype, red)
            assert (code.dtype, code.op, code.divide) == (DTYPE_CODES[dtype], OP_CODES[red], False), (dtype, red)


@pytest.mark.parametrize("red", [RedOp.BAND, RedOp.BOR, RedOp.BXOR])
@pytest.mark.parametrize("dtype", [torch.int32, torch.uint8, torch.int64])
def test_bitwise_reductions_are_staged(dtype, red):
    assert "bitwise" in table().staging_reason("all_reduce", [dtype], red)


def test_bool_reduces_as_uint8_with_the_op_that_gives_bools_answer():
    support = table()
    uint8 = DTYPE_CODES[torch.uint8]
    for red, on_bytes in ((RedOp.SUM, RedOp.MAX), (RedOp.BOR, RedOp.MAX), (RedOp.MAX, RedOp.MAX),
                          (RedOp.PRODUCT, RedOp.MIN), (RedOp.BAND, RedOp.MIN), (RedOp.MIN, RedOp.MIN)):
        assert support.reduce_code(torch.bool, red) == (uint8, OP_CODES[on_bytes], False), red
    assert "BXOR" in support.staging_reason("all_reduce", [torch.bool], RedOp.BXOR)


def test_avg_before_nccl_2_10_is_a_sum_then_a_division_and_bfloat16_is_staged():
    support = table(version=NCCL_2_9)
    assert support.reduce_code(torch.float32, RedOp.AVG) == (DTYPE_CODES[torch.float32], OP_CODES[RedOp.SUM], True)
    assert "bfloat16" in support.staging_reason("reduce_scatter_tensor", [torch.bfloat16], RedOp.SUM)
    # moved, bfloat16 travels as its bytes: two uint8 per element
    assert support.move_code(torch.bfloat16) == (DTYPE_CODES[torch.uint8], 2)


def test_avg_of_one_rank_is_a_sum():
    code = table(world_size=1).reduce_code(torch.float16, RedOp.AVG)
    assert code == (DTYPE_CODES[torch.float16], OP_CODES[RedOp.SUM], False)


def test_dtypes_without_an_nccl_type_move_as_their_bytes_and_are_never_staged():
    support = table()
    for dtype in (torch.float8_e4m3fn, torch.int16, torch.complex64, torch.complex128):
        assert support.move_code(dtype) == (DTYPE_CODES[torch.uint8], dtype.itemsize), dtype
        for op in ("broadcast", "all_gather", "all_gather_into_tensor", "all_to_all_single"):
            assert support.staging_reason(op, [dtype], None) is None, (op, dtype)
    assert support.move_code(torch.bool) == (DTYPE_CODES[torch.uint8], 1)
    assert support.move_code(torch.float32) == (DTYPE_CODES[torch.float32], 1)


def test_a_call_nccl_cannot_run_fails_loudly_if_it_reaches_the_nccl_path():
    with pytest.raises(AssertionError, match="route.py must stage it"):
        table().reduce_code(torch.int32, RedOp.BXOR)


def test_ops_without_an_nccl_form_are_staged():
    for op in ("all_to_all", "gather", "scatter", "send", "recv"):
        assert op not in NCCL_FORMS
        assert "no NCCL form" in table().staging_reason(op, [torch.float32], None)


def x(dtype=torch.float32, n=4):
    return torch.zeros(n, dtype=dtype)


def reduce_opts(op, options=dist.AllreduceOptions):
    opts = options()
    opts.reduceOp = op
    return opts


def test_the_router_reads_the_reduce_op_from_the_calls_options():
    support = table()
    tensors = [x(torch.int32)]
    assert staging_reason(support, "all_reduce", (tensors, reduce_opts(dist.ReduceOp.SUM)), {}, tensors) is None
    assert "bitwise" in staging_reason(support, "all_reduce", (tensors, reduce_opts(dist.ReduceOp.BAND)), {}, tensors)
    assert "bitwise" in staging_reason(support, "all_reduce", (tensors,), {"opts": reduce_opts(dist.ReduceOp.BOR)},
                                       tensors)
    assert staging_reason(support, "all_reduce", (tensors,), {}, tensors) is None  # torch's default: SUM
    out, inp = x(torch.uint8, 2), x(torch.uint8, 4)
    assert "bitwise" in staging_reason(support, "reduce_scatter_tensor",
                                       (out, inp, reduce_opts(dist.ReduceOp.BXOR, dist.ReduceScatterOptions)), {},
                                       [out, inp])


def test_the_router_reduces_complex_as_its_real_dtype_and_a_premul_sum_as_a_sum():
    support = table()
    tensors = [x(torch.complex64)]
    assert staging_reason(support, "all_reduce", (tensors, reduce_opts(dist.ReduceOp.AVG)), {}, tensors) is None
    premul = dist._make_nccl_premul_sum(0.5)
    assert staging_reason(support, "all_reduce", (tensors, reduce_opts(premul)), {}, [x(torch.float16)]) is None


def test_the_router_leaves_a_call_it_cannot_read_to_the_calls_own_checks():
    """A PREMUL_SUM with an unreadable factor is refused by the call itself, on the NCCL route,
    before anything is enqueued: the router does not stage it."""
    tensors = [x()]
    opts = reduce_opts(dist._make_nccl_premul_sum(torch.ones(1, dtype=torch.int64)))
    assert staging_reason(table(), "all_reduce", (tensors, opts), {}, tensors) is None


def test_uneven_all_gather_is_staged_and_even_ones_go_to_nccl():
    support, inp = table(), x(n=4)
    even, uneven = [[x(n=4), x(n=4)]], [[x(n=4), x(n=6)]]
    assert staging_reason(support, "all_gather", (even, [inp]), {}, [inp]) is None
    assert "different sizes" in staging_reason(support, "all_gather", (uneven, [inp]), {}, [inp])
    assert gathers_unevenly([x(n=4), x(n=6)], inp) and not gathers_unevenly([x(n=4)] * 2, [inp])
    assert not gathers_unevenly([], [])
    # malformed arguments are the call's to refuse, with its own message: the router only steps aside
    assert staging_reason(support, "all_gather", (x(n=8), inp), {}, [inp]) is None
    assert staging_reason(support, "all_gather", (), {}, []) is None


def test_without_nccl_every_cuda_call_is_staged():
    assert staging_reason(None, "broadcast", ([x()],), {}, [x()]) == "NCCL is not in use"


def _imports(package_dir: pathlib.Path, package: str) -> dict[str, set[str]]:
    """module -> the modules of ``package`` it imports at its top level or inside functions."""
    graph: dict[str, set[str]] = {}
    for path in package_dir.rglob("*.py"):
        parts = list(path.relative_to(package_dir).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        module = ".".join([package, *parts])
        here = module if is_package else module.rsplit(".", 1)[0]
        found = graph.setdefault(module, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = here.rsplit(".", node.level - 1)[0] if node.level > 1 else here
                target = f"{base}.{node.module}" if node.module else base
                # ``from . import numerics`` imports the module numerics; ``from .ops import X`` ops
                found.update([f"{target}.{a.name}" for a in node.names] if not node.module else [target])
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(package):
                found.add(node.module)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.startswith(package))
    return {m: {t for t in targets if t in graph and t != m} for m, targets in graph.items()}


def test_the_backend_has_no_import_circle():
    """STYLE: layers import downwards. A circle (fast_path <-> nccl_path, until the route table)
    hides which module owns what."""
    root = pathlib.Path(__file__).resolve().parents[1] / "backend"
    graph = _imports(root, "backend")
    assert "backend.cuda.route" in graph["backend.process_group"]  # the walk reads the imports
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                circle = path[path.index(target):] + [target] if target in path else [module, target]
                raise AssertionError(f"import circle: {' -> '.join(circle)}")
            if target not in state:
                visit(target, path + [target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
