"""backend/numerics.py's rules as pure functions over tensors, in this process (no ranks): AVG as a
SUM and one division (integers truncated toward zero, as NCCL), PREMUL_SUM, complex numbers, and
16-bit values summed in float32 in rank order, divided and rounded once."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from smddp_lite.backend import numerics
from smddp_lite.backend.ops import RedOp

LOW = [torch.bfloat16, torch.float16]


def _blocks(w: int, n: int, dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    """``w`` ranks' blocks of 16-bit values that are multiples of 1/8 below 512 in magnitude: a
    sum of up to five of them spans 15 bits, exact in float32, so a float32 sum in any order
    equals the float64 sum, and only the rounding to 16 bits can differ."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(-4096, 4096, (n,), generator=g) / 8).to(dtype) for _ in range(w)]


def _reference(blocks: list[torch.Tensor], divide_by: int | None, dtype: torch.dtype) -> torch.Tensor:
    """float64 sum, float64 division, one rounding to ``dtype``."""
    total = torch.stack([b.double() for b in blocks]).sum(0)
    return (total if divide_by is None else total / divide_by).to(dtype)


# AVG -------------------------------------------------------------------------------------------

def test_avg_is_a_sum_across_ranks_and_other_ops_are_themselves():
    assert numerics.across_ranks(RedOp.AVG) is RedOp.SUM
    for op in RedOp:
        if op is not RedOp.AVG:
            assert numerics.across_ranks(op) is op


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.int8, torch.uint8])
def test_avg_of_integers_truncates_toward_zero(dtype):
    """As NCCL averages integers: -7 / 2 is -3 (floor division would give -4), 7 / 2 is 3."""
    signed = dtype is not torch.uint8
    sums = torch.tensor([-7, 7, -1, 5, 0] if signed else [7, 5, 1, 0, 9], dtype=dtype)
    expected = torch.tensor([-3, 3, 0, 2, 0] if signed else [3, 2, 0, 0, 4], dtype=dtype)
    assert torch.equal(numerics.averaged_(sums.clone(), 2), expected)
    t = sums.clone()
    numerics.finish_(t, RedOp.AVG, 2)
    assert torch.equal(t, expected)
    # through the block reduction too: blocks (sums, zeros) average to sums / 2
    total = torch.empty_like(sums)
    numerics.reduce_blocks_(total, [sums, torch.zeros_like(sums)], RedOp.AVG)
    assert torch.equal(total, expected)


def test_finish_leaves_ops_other_than_avg_alone():
    t = torch.tensor([3.0, -5.0])
    into = torch.empty(2, dtype=torch.bfloat16)
    numerics.finish_(t, RedOp.SUM, 4, into=into)
    assert torch.equal(t, torch.tensor([3.0, -5.0])) and torch.equal(into, t.bfloat16())


@pytest.mark.parametrize("dtype", LOW)
def test_finish_divides_a_float32_sum_before_its_one_rounding(dtype):
    """A widened AVG (the transport summed the float32 copy): divided in float32, rounded once."""
    blocks = _blocks(3, 1001, dtype, seed=1)
    wide = torch.stack([b.float() for b in blocks]).sum(0)  # exact: see _blocks
    out = torch.empty(1001, dtype=dtype)
    numerics.finish_(wide, RedOp.AVG, 3, into=out)
    assert torch.equal(out, _reference(blocks, 3, dtype))


# 16-bit values in float32 ----------------------------------------------------------------------

@pytest.mark.parametrize("dtype", LOW)
@pytest.mark.parametrize("op", [RedOp.SUM, RedOp.AVG])
@pytest.mark.parametrize("w", [2, 3, 5])
def test_16_bit_blocks_are_summed_in_float32_and_rounded_once(dtype, op, w):
    """Bit for bit the float64 sum (and quotient) rounded once to the 16-bit dtype."""
    blocks = _blocks(w, 1823, dtype, seed=w)
    out = torch.empty(1823, dtype=dtype)
    total = numerics.reduce_blocks_(torch.empty(1823), blocks, op, into=[out])
    assert total.dtype is torch.float32
    assert torch.equal(out, _reference(blocks, w if op is RedOp.AVG else None, dtype))


@pytest.mark.parametrize("dtype", LOW)
def test_one_rounding_is_not_a_16_bit_running_sum(dtype):
    """256 + 1 + 1 is 258 in float32 and in both 16-bit dtypes' one rounding; summed in 16 bits,
    each 256 + 1 rounds back to 256 (bfloat16 keeps 8 bits; float16 at 2048 + 1 alike)."""
    big = 256.0 if dtype is torch.bfloat16 else 2048.0
    blocks = [torch.tensor([big], dtype=dtype), torch.tensor([1.0], dtype=dtype), torch.tensor([1.0], dtype=dtype)]
    out = torch.empty(1, dtype=dtype)
    numerics.reduce_blocks_(torch.empty(1), blocks, RedOp.SUM, into=[out])
    assert out.item() == big + 2
    running = blocks[0].clone()
    for b in blocks[1:]:
        running += b
    assert running.item() == big  # what the rule prevents


def test_avg_of_host_sums_divides_by_every_rank():
    """``mean_of``: blocks that are sums over 2 ranks each (a host's) average over all 4 ranks."""
    ranks = _blocks(4, 257, torch.bfloat16, seed=7)
    host_sums = [(ranks[0].double() + ranks[1].double()).bfloat16(), (ranks[2].double() + ranks[3].double()).bfloat16()]
    out = torch.empty(257, dtype=torch.bfloat16)
    numerics.reduce_blocks_(torch.empty(257), host_sums, RedOp.AVG, mean_of=4, into=[out])
    assert torch.equal(out, _reference(host_sums, 4, torch.bfloat16))


@pytest.mark.parametrize("piece", [1 << 20, 100])
def test_widening_into_a_buffer_gives_the_bits_of_a_mixed_dtype_add(piece):
    """``widen_in`` (the gloo transport's kept block buffer; smaller: pieces) changes the speed
    only."""
    blocks = _blocks(3, 1001, torch.bfloat16, seed=3)
    plain, widened = torch.empty(1001), torch.empty(1001)
    numerics.reduce_blocks_(plain, blocks, RedOp.AVG)
    numerics.reduce_blocks_(widened, blocks, RedOp.AVG, widen_in=torch.empty(min(piece, 1001)))
    assert torch.equal(plain, widened)


def test_product_of_16_bit_blocks_is_taken_in_float32():
    blocks = [torch.tensor([1.5, -3.0], dtype=torch.bfloat16), torch.tensor([1.5, 0.5], dtype=torch.bfloat16),
              torch.tensor([1.5, 2.0], dtype=torch.bfloat16)]
    out = torch.empty(2, dtype=torch.bfloat16)
    numerics.reduce_blocks_(torch.empty(2), blocks, RedOp.PRODUCT, into=[out])
    assert torch.equal(out, torch.tensor([3.375, -3.0]).bfloat16())


def test_add_widened_equals_a_float64_sum_rounded_once_past_one_piece():
    """The sharded step's ``param += rounded update``: piece by piece on the CPU, the same bits."""
    n = 3 * (1 << 18) + 17  # more than one piece, and a partial last one
    g = torch.Generator().manual_seed(11)
    total = torch.randn(n, generator=g)
    part = torch.randn(n, generator=g).bfloat16()
    expected = (total.double() + part.double()).float()
    numerics.add_widened_(total, part)
    assert torch.equal(total, expected)


# PREMUL_SUM ------------------------------------------------------------------------------------

@pytest.mark.skipif(not numerics.FACTOR_READABLE, reason="this torch keeps a PREMUL_SUM's factor from Python")
def test_premul_sum_is_a_sum_of_inputs_times_the_factor():
    op, factor = numerics.reduction(dist._make_nccl_premul_sum(2.5))
    assert op is RedOp.SUM and factor == 2.5
    op, factor = numerics.reduction(dist._make_nccl_premul_sum(torch.tensor([0.5])))
    assert op is RedOp.SUM and isinstance(factor, torch.Tensor) and factor.shape == () and factor.item() == 0.5
    assert numerics.reduction(dist.ReduceOp.MAX) == (RedOp.MAX, None)

    t = torch.tensor([1.0, -2.0])
    copy = numerics.premultiplied(t, 2.5, in_place=False)
    assert torch.equal(copy, torch.tensor([2.5, -5.0])) and torch.equal(t, torch.tensor([1.0, -2.0]))
    same = numerics.premultiplied(t, factor, in_place=True)
    assert same is t and torch.equal(t, torch.tensor([0.5, -1.0]))
    assert numerics.premultiplied(t, None, in_place=True) is t


@pytest.mark.skipif(not numerics.FACTOR_READABLE, reason="this torch keeps a PREMUL_SUM's factor from Python")
def test_premul_sum_refuses_a_factor_that_is_not_one_float():
    with pytest.raises(ValueError, match=r"PREMUL_SUM needs a factor that is a number or a one-element "
                                         r"floating-point tensor, found a tensor of shape \(\) and dtype int64"):
        numerics.reduction(dist._make_nccl_premul_sum(torch.tensor(2)))


# complex numbers -------------------------------------------------------------------------------

@pytest.mark.parametrize("op", [RedOp.SUM, RedOp.AVG])
def test_complex_sums_are_sums_of_real_and_imaginary_parts(op):
    z = torch.tensor([1 + 2j, -3 + 0.5j], dtype=torch.complex64)
    real = torch.ones(2)
    as_real, untouched = numerics.complex_as_real([z, real], op)
    assert as_real.shape == (2, 2) and as_real.dtype is torch.float32 and untouched is real
    as_real.mul_(2)  # a view: results land in the complex tensor
    assert torch.equal(z, torch.tensor([2 + 4j, -6 + 1j], dtype=torch.complex64))


def test_complex_is_left_for_the_checks_under_other_ops_and_as_a_lazy_conjugate():
    z = torch.tensor([1 + 2j], dtype=torch.complex64)
    assert numerics.complex_as_real([z], RedOp.MAX)[0] is z
    conj = z.conj()
    assert numerics.complex_as_real([conj], RedOp.SUM)[0] is conj
