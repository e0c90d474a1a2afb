"""The 8-bit wire's blockwise quantizer (smddp_lite/kernels/quantize.py): the Triton kernels
against the torch reference, bit for bit (dequantize_add on a GPU: to a fused multiply-add's
rounding), and the reference against the error bound the module states, on irregular sizes,
blocks of very different magnitudes, zero, constant and non-finite blocks. Without a GPU the
kernels run in Triton's interpreter (TRITON_INTERPRET=1, conftest.py).
"""

from __future__ import annotations

import pytest
import torch

from smddp_lite.kernels import dequantize_add, quantize
from smddp_lite.kernels.quantize import FORMATS, blocks_of, error_bound

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
WIRES = list(FORMATS)
IDS = [str(d).replace("torch.", "") for d in WIRES]


def _message(n: int, block: int, seed: int) -> torch.Tensor:
    """Normal values whose blocks' magnitudes span 1e-6 to 1e4 (gradients' layers differ so),
    with a few values among each format's subnormals."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen)
    magnitudes = 10.0 ** torch.randint(-6, 5, (blocks_of(n, block),), generator=gen).float()
    return (x * magnitudes.repeat_interleave(block)[:n]).to(DEVICE)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


@pytest.mark.parametrize("dtype", WIRES, ids=IDS)
@pytest.mark.parametrize("n, block", [(1, 16), (1000, 16), (4099, 256), (70000, 4096)])
def test_the_kernels_match_the_reference_bit_for_bit(dtype, n, block):
    x = _message(n, block, seed=n)
    q_kernel, s_kernel = quantize(x, dtype, block, force_triton=True)
    q_ref, s_ref = quantize(x, dtype, block, force_triton=False)
    assert torch.equal(_bits(q_kernel), _bits(q_ref)), (_bits(q_kernel) != _bits(q_ref)).sum()
    assert torch.equal(s_kernel, s_ref)
    acc_kernel = torch.randn(n, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    acc_ref = acc_kernel.clone()
    dequantize_add(acc_kernel, q_ref, s_ref, block, force_triton=True)
    dequantize_add(acc_ref, q_ref, s_ref, block, force_triton=False)
    if DEVICE == "cpu":  # the interpreter rounds q * scale, then the sum, as the reference does
        assert torch.equal(acc_kernel, acc_ref)
        return
    # On a GPU the kernel's multiply-add is one fused operation (torch.addcmul's): it skips the
    # rounding of q * scale, so it differs from the reference's two roundings by at most that one
    # (half an ulp of the product) and each result's own (half an ulp of each), each within 2**-24
    # of its value. Not a bound in ulps of the result alone: where acc and the product nearly
    # cancel, half an ulp of the product is many ulps of the result.
    product = q_ref.float() * s_ref.repeat_interleave(block)[:n]  # rounded as the reference rounds it
    bound = 2.0 ** -24 * (product.abs() + acc_ref.abs() + acc_kernel.abs()) + 2.0 ** -149  # (subnormals: absolute)
    error = (acc_kernel - acc_ref).abs()
    assert (error <= bound).all(), ((error / bound).max(), (error > bound).sum())


@pytest.mark.parametrize("dtype", WIRES, ids=IDS)
@pytest.mark.parametrize("n, block", [(4099, 16), (70000, 1024)])
def test_every_element_is_within_the_stated_bound_and_the_bound_is_tight(dtype, n, block):
    x = _message(n, block, seed=7)
    q, scales = quantize(x, dtype, block)
    back = torch.zeros_like(x)
    dequantize_add(back, q, scales, block)
    error, bound = (back - x).abs(), error_bound(x, scales, dtype, block)
    # float32's own roundings (x times the inverse scale, q times the scale) add a few ulps of x
    assert (error <= bound * (1 + 1e-5) + x.abs() * 2e-7).all(), (error / bound).max()
    assert (error > 0.5 * bound).any(), "the bound is far from the error seen: it says little"
    # every block uses the format's whole range: its largest value maps to the largest code
    largest = x.abs().reshape(-1)[: n // block * block].view(-1, block).amax(1)
    assert torch.allclose(scales[: n // block] * FORMATS[dtype][0], largest, rtol=1e-6)


@pytest.mark.parametrize("dtype", WIRES, ids=IDS)
@pytest.mark.parametrize("force_triton", [True, False], ids=["kernel", "reference"])
def test_zero_constant_and_non_finite_blocks(dtype, force_triton):
    block = 16
    x = torch.cat([torch.zeros(block), torch.full((block,), -3.25), torch.randn(block),
                   torch.randn(block), torch.randn(block), torch.ones(5)]).to(DEVICE)
    x[2 * block + 3] = float("inf")
    x[3 * block + 9] = float("nan")
    q, scales = quantize(x, dtype, block, force_triton=force_triton)
    assert scales[0] == 0 and not _bits(q[:block]).any(), "a zero block: scale 0, values 0"
    back = torch.zeros_like(x)
    dequantize_add(back, q, scales, block, force_triton=force_triton)
    assert torch.equal(back[:block], x[:block])
    assert torch.allclose(back[block : 2 * block], x[block : 2 * block], rtol=1e-6), "a constant block"
    # inf and nan: their blocks become NaN scales (all NaN where they land), the others are kept
    assert scales[2].isnan() and scales[3].isnan() and not scales[[0, 1, 4, 5]].isnan().any()
    assert back[2 * block : 4 * block].isnan().all() and back[4 * block :].isfinite().all()
    assert torch.allclose(back[4 * block :], x[4 * block :], rtol=0.13, atol=error_bound(
        x[4 * block :], scales[4:], dtype, block).max().item())


@pytest.mark.parametrize("dtype", WIRES, ids=IDS)
@pytest.mark.parametrize("force_triton", [True, False], ids=["kernel", "reference"])
def test_blocks_of_vanishing_magnitude_travel_as_zeros_not_nan(dtype, force_triton):
    """The reciprocal of a scale of 1e-39 overflows float32 and made every value NaN (e4m3fn);
    error feedback leaves a residual alone in a block to shrink towards such sizes step by step.
    Blocks from 2**-100 up keep their values; below it, they travel as zeros."""
    block = 16
    x = torch.cat([torch.full((block,), 1e-39), torch.full((block,), -3e-31), torch.linspace(-1, 1, block) * 2.0 ** -99,
                   torch.linspace(-1, 1, block) * 2.0 ** -90]).to(DEVICE)
    q, scales = quantize(x, dtype, block, force_triton=force_triton)
    back = torch.zeros_like(x)
    dequantize_add(back, q, scales, block, force_triton=force_triton)
    assert back.isfinite().all() and scales.isfinite().all(), (back, scales)
    assert scales[0] == 0 and scales[1] == 0 and not back[: 2 * block].any(), "below TINY: zeros"
    assert scales[2] > 0 and scales[3] > 0
    bound = error_bound(x, scales, dtype, block)
    assert ((back - x).abs() <= bound * (1 + 1e-5)).all(), ((back - x).abs() / bound).max()



@pytest.mark.parametrize("dtype", WIRES, ids=IDS)
def test_the_reference_needs_no_clamp_where_the_scaled_value_rounds_past_the_largest_code(dtype):
    """The reference takes x * fl(QMAX / largest) without clamping it to [-QMAX, QMAX]: that product
    is at most QMAX (1 + 2**-24)**2, which rounds (int8) or casts (float8) to QMAX. Blocks whose
    largest magnitude makes the product land above QMAX (a fifth of them, at their largest element) come
    out as the clamped computation's, bit for bit, and in range; the short last block too."""
    qmax = FORMATS[dtype][0]
    block = 16
    gen = torch.Generator().manual_seed(3)
    largest = torch.rand(4096, generator=gen) * 10.0 ** torch.randint(-20, 20, (4096,), generator=gen).float()
    x = torch.rand(4096, block, generator=gen) * 2 - 1
    x[:, 0] = 1.0
    x = (x * largest[:, None] * torch.where(torch.rand(4096, 1, generator=gen) < 0.5, -1.0, 1.0)).reshape(-1)[:-5]
    blocks = torch.cat([x, x.new_zeros(5)]).view(-1, block)
    peak = blocks.abs().amax(1, keepdim=True)
    scaled = blocks * (qmax / peak)
    assert (scaled.abs() > qmax).any(), "no block reaches past QMAX: the case is not exercised"
    want = (scaled.round() if dtype == torch.int8 else scaled).clamp(-qmax, qmax).to(dtype).reshape(-1)[: x.numel()]
    q, scales = quantize(x.to(DEVICE), dtype, block, force_triton=False)
    assert torch.equal(_bits(q.cpu()), _bits(want)), (_bits(q.cpu()) != _bits(want)).sum()
    assert torch.equal(scales.cpu(), (peak / qmax).reshape(-1))
    assert q.float().abs().max() == qmax
@pytest.mark.parametrize("block, says", [(100, "power of two"), (8, "from 16"), (1 << 17, "to 65536"),
                                         (16.0, "power of two")])
def test_a_bad_block_size_is_refused_saying_what_is_taken(block, says):
    with pytest.raises(ValueError, match=says):
        quantize(torch.ones(64, device=DEVICE), torch.int8, block)


def test_a_wire_dtype_that_is_not_8_bit_is_refused_naming_those_that_are():
    with pytest.raises(ValueError, match="int8, float8_e4m3fn, float8_e5m2"):
        quantize(torch.ones(64, device=DEVICE), torch.bfloat16, 64)
    with pytest.raises(ValueError, match="float32"):
        quantize(torch.ones(64, dtype=torch.float16, device=DEVICE), torch.int8, 64)
    with pytest.raises(ValueError, match="1 float32 scales"):
        dequantize_add(torch.zeros(64, device=DEVICE), torch.zeros(64, dtype=torch.int8, device=DEVICE),
                       torch.zeros(2, device=DEVICE), 64)


def test_the_bandwidth_benchmark_runs_and_checks_the_kernels_on_cpu(tmp_path):
    """benchmarks/quantize_kernels.py, the GPU measurement, as a smoke run in the interpreter
    (conftest.py sets TRITON_INTERPRET=1): every variant timed, the kernels checked against the
    reference (it exits non-zero otherwise). In this process: a fresh one spends seconds importing."""
    import json

    from benchmarks import quantize_kernels

    out = tmp_path / "quantize.json"
    quantize_kernels.main(["--device", "cpu", "--numel", "4K", "--dtypes", "int8,float8_e4m3fn", "--blocks", "1024",
                           "--rounds", "2", "--calls", "1", "--json", str(out)])
    report = json.loads(out.read_text())
    assert report["wrong"] == [] and len(report["rows"]) == 1 + 2 * 2 * 2, report["rows"]
    assert all(r["median_us"] > 0 and r["gbps"] > 0 for r in report["rows"])
