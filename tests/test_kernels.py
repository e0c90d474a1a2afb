"""Each fused kernel against its pure-torch reference, over irregular sizes and every dtype.

Without a GPU the kernels run in Triton's interpreter on CPU tensors (TRITON_INTERPRET=1, set
in conftest.py); with one, on the GPU against the reference on the same device.
"""

from __future__ import annotations

import math

import pytest

from . import tiers
import torch

from smddp_lite.kernels import adam_reference, adam_step, sgd_reference, sgd_step, step_scalars, step_scalars_reference
from smddp_lite.kernels._launch import torch_fused_cpu

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SIZES = [1, 17, 257, 1823 * 781]  # odd sizes leave a partial last block
# One fp32 op order differs between kernel and reference (fused multiply-adds, x/sqrt(b) vs
# x*rsqrt(b)): a few ulps. 16-bit parameters round the same fp32 result once: equal or one ulp.
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=8e-3, atol=1e-5),
       torch.float16: dict(rtol=1e-3, atol=1e-5)}


def _scalars(step: float, found_inf: float = 0.0, lr: float = 1e-2, scale: float = 0.5):
    make = lambda v: torch.tensor([v], dtype=torch.float32, device=DEVICE)  # noqa: E731
    return dict(lr=make(lr), step=make(step), scale=make(scale), found_inf=make(found_inf))


def _streams(n: int, dtype: torch.dtype, k: int, seed: int):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    out = [torch.randn(n, generator=gen).to(DEVICE, dtype) for _ in range(k)]
    out[-1] = out[-1].abs() if k == 4 else out[-1]  # exp_avg_sq is never negative
    return out


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam"])
@pytest.mark.parametrize("step", [1.0, 7.0])
def test_adam_kernel_matches_reference(dtype, n, decoupled, step):
    p, g, m, v = _streams(n, dtype, 4, seed=n)
    ref = [t.clone() for t in (p, g, m, v)]
    hyper = dict(beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, decoupled=decoupled, **_scalars(step))
    want_grad = (g.float() * 0.5).to(dtype)  # both leave the gradient times scale (unscaled, clipped)
    adam_step(p, g, m, v, force_triton=True, **hyper)
    adam_reference(*ref, **hyper)
    for got, want in zip((p, g, m, v), ref):
        torch.testing.assert_close(got, want, **TOL[dtype])
    assert torch.equal(g, want_grad) and torch.equal(ref[1], want_grad)


@pytest.mark.parametrize("beta1, beta2", [(0.9, 0.999), (0.0, 0.99)])
@pytest.mark.parametrize("step", [1.0, 7.0, 1000.0])
@pytest.mark.parametrize("use_kernel", [True, False], ids=["triton", "reference"])
def test_adam_update_is_the_float64_update_rounded_once(beta1, beta2, step, use_kernel):
    """The update against the same arithmetic in float64 from the same float32 inputs. The bias
    corrections are where float32 fails: 1 - float32(0.999) is 1.3e-5 off, and on the GPU
    float32 exp/log (beta**step) left 1 - beta2 1e-4 off at step 1. Starting from zero weights,
    the new weight is the update alone, so float32 rounding of the weight hides nothing."""
    n = 4099
    gen = torch.Generator().manual_seed(3)
    g, m = torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 0.1
    v = torch.rand(n, generator=gen) + 0.1  # well away from 0: the comparison is of the corrections
    lr = 1e-2
    m64, v64 = m.double() * beta1 + (1 - beta1) * g.double(), v.double() * beta2 + (1 - beta2) * g.double() ** 2
    want = -lr / (1 - beta1 ** step) * m64 / (v64.sqrt() / math.sqrt(1 - beta2 ** step) + 1e-8)
    p, g, m, v = (t.to(DEVICE) for t in (torch.zeros(n), g, m, v))
    adam_step(p, g, m, v, beta1=beta1, beta2=beta2, eps=1e-8, weight_decay=0.0, decoupled=True,
              force_triton=use_kernel, **_scalars(step, lr=lr, scale=1.0))
    # float32 rounding of m where its two terms cancel is 1e-10 here; the corrections' errors
    # moved every weight by 6e-6 or more of itself
    torch.testing.assert_close(p.cpu().double(), want, rtol=1e-6, atol=1e-7 * float(want.abs().max()))
    torch.testing.assert_close(v.cpu().double(), v64, rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("momentum, dampening, nesterov", [(0.0, 0.0, False), (0.9, 0.0, False),
                                                           (0.9, 0.1, False), (0.9, 0.0, True)])
@pytest.mark.parametrize("step", [1.0, 3.0])
def test_sgd_kernel_matches_reference(dtype, n, momentum, dampening, nesterov, step):
    p, g, buf = _streams(n, dtype, 3, seed=n + 1)
    ref_p, ref_g, ref_buf = p.clone(), g.clone(), buf.clone()
    hyper = dict(momentum=momentum, dampening=dampening, weight_decay=0.01, nesterov=nesterov, **_scalars(step))
    want_grad = (g.float() * 0.5).to(dtype)
    sgd_step(p, g, buf, force_triton=True, **hyper)
    sgd_reference(ref_p, ref_g, ref_buf, **hyper)
    torch.testing.assert_close(p, ref_p, **TOL[dtype])
    torch.testing.assert_close(buf, ref_buf, **TOL[dtype])
    assert torch.equal(g, want_grad) and torch.equal(ref_g, want_grad)


@pytest.mark.parametrize("family", ["adamw", "sgd_momentum"])
@pytest.mark.parametrize("force_triton", [True, False, None], ids=["kernel", "reference", "cpu-path"])
def test_write_grad_changes_only_the_gradient(family, force_triton):
    """write_grad=False leaves the gradient as it was (the kernel and the reference), and the
    update is the one a written-back step makes; torch's fused CPU kernels (``cpu-path``) write
    the unscaled gradient in the same pass whichever is asked."""
    if force_triton is None and DEVICE != "cpu":
        pytest.skip("the CPU path (torch's fused kernels) serves CPU tensors")
    p, g, m, v = _streams(1823, torch.bfloat16, 4, seed=9)
    g_before = g.clone()
    runs = []
    for write_grad in (False, True):
        state = [t.clone() for t in (p, g, m, v)]
        scalars = _scalars(3.0, scale=0.5)
        if family == "adamw":
            adam_step(*state, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, decoupled=True,
                      write_grad=write_grad, force_triton=force_triton, **scalars)
        else:
            sgd_step(state[0], state[1], state[2], momentum=0.9, dampening=0.0, weight_decay=0.01, nesterov=False,
                     write_grad=write_grad, force_triton=force_triton, **scalars)
        runs.append(state)
    for i, (unwritten, written) in enumerate(zip(*runs)):
        if i != 1:  # parameter and state
            assert torch.equal(unwritten, written)
    halved = (g_before.float() * 0.5).to(g_before.dtype)
    assert torch.equal(runs[1][1], halved)
    op = "_fused_adamw_" if family == "adamw" else "_fused_sgd_"
    torchs_kernel = force_triton is None and torch_fused_cpu(torch.device(DEVICE), op, torch.bfloat16)
    assert torch.equal(runs[0][1], halved if torchs_kernel else g_before)


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("family", ["adamw", "sgd_momentum", "sgd"])
def test_the_cpu_path_matches_the_reference(dtype, family):
    """On the CPU the launchers hand updates to torch's fused kernels where those work: its
    fused SGD left 16-bit parameters unchanged but for the last few elements (torch 2.13)."""
    gen = torch.Generator().manual_seed(3)
    p, g, m, v = (torch.randn(1823, generator=gen).to(dtype) for _ in range(4))
    v = v.abs()  # exp_avg_sq is never negative
    start = p.clone()
    ref_p, ref_m, ref_v = p.clone(), m.clone(), v.clone()
    # lr 0.1: steps large enough to move every bfloat16 parameter; torch's fused kernels write
    # the unscaled gradient back, so each update gets its own
    scalars = {k: t.cpu() for k, t in _scalars(3.0, lr=0.1).items()}
    g_fused, g_ref = g.clone(), g.clone()
    if family == "adamw":
        hyper = dict(beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, decoupled=True, **scalars)
        adam_step(p, g_fused, m, v, **hyper)
        adam_reference(ref_p, g_ref, ref_m, ref_v, **hyper)
    else:
        hyper = dict(momentum=0.9 if family == "sgd_momentum" else 0.0, dampening=0.0, weight_decay=0.01,
                     nesterov=False, **scalars)
        sgd_step(p, g_fused, m, **hyper)
        sgd_reference(ref_p, g_ref, ref_m, **hyper)
    assert (p != start).float().mean() > 0.9, "the update left most parameters unchanged"
    # float32: torch's kernel orders its operations its own way, a few ulps of a 0.1-sized step
    tol = dict(rtol=1e-4, atol=1e-5) if dtype is torch.float32 else TOL[dtype]
    torch.testing.assert_close(p, ref_p, **tol)
    torch.testing.assert_close(m, ref_m, **tol)
    # torch divides by 1/scale where the reference multiplies by scale: equal for scale 0.5
    assert torch.equal(g_fused, (g.float() * 0.5).to(dtype)) and torch.equal(g_ref, g_fused)


@pytest.mark.parametrize("use_kernel", [True, False], ids=["kernel", "reference"])
def test_found_inf_leaves_everything_untouched(use_kernel):
    p, g, m, v = _streams(257, torch.float32, 4, seed=3)
    before = [t.clone() for t in (p, g, m, v)]
    adam_step(p, g, m, v, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, decoupled=True,
              force_triton=use_kernel, **_scalars(2.0, found_inf=1.0))
    for got, want in zip((p, g, m, v), before):
        assert torch.equal(got, want)
    p, g, buf = _streams(257, torch.float32, 3, seed=4)
    before = [p.clone(), g.clone(), buf.clone()]
    sgd_step(p, g, buf, momentum=0.9, dampening=0.0, weight_decay=0.0, nesterov=False,
             force_triton=use_kernel, **_scalars(2.0, found_inf=1.0))
    assert all(torch.equal(got, want) for got, want in zip((p, g, buf), before))


def test_float64_updates_take_the_reference_in_float64():
    """The kernels compute in float32 and Triton passes Python floats as float32: float64
    parameters take the reference, with float64 scalars, and forcing the kernel says why not."""
    p, g, m, v = (t.double() for t in _streams(257, torch.float32, 4, seed=6))
    scalars = {k: torch.tensor([float(t)], dtype=torch.float64, device=DEVICE)
               for k, t in dict(lr=0.1, step=3.0, scale=0.5, found_inf=0.0).items()}
    hyper = dict(beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, decoupled=True, **scalars)
    with pytest.raises(ValueError, match="float64 parameters take the reference"):
        adam_step(p, g, m, v, force_triton=True, **hyper)
    with pytest.raises(ValueError, match="lr must be a 1-element float64 tensor .* for float64 parameters"):
        adam_step(p, g, m, v, **{**hyper, "lr": torch.tensor([0.1], device=DEVICE)})
    want_m = 0.9 * m + 0.1 * g * 0.5
    want_v = 0.999 * v + 0.001 * (g * 0.5) ** 2
    want_p = p * (1 - 0.1 * 0.1) - 0.1 / (1 - 0.9**3) * want_m / (want_v.sqrt() / (1 - 0.999**3) ** 0.5 + 1e-8)
    adam_step(p, g, m, v, **hyper)
    for got, want in ((p, want_p), (m, want_m), (v, want_v)):
        torch.testing.assert_close(got, want, rtol=1e-14, atol=1e-15)


def test_launcher_rejects_mismatched_buffers():
    p, g, m, v = _streams(17, torch.float32, 4, seed=5)
    with pytest.raises(ValueError, match="exp_avg_sq must be a flat contiguous tensor of 17 elements"):
        adam_step(p, g, m, v[:5], beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=True,
                  **_scalars(1.0))
    with pytest.raises(ValueError, match="lr must be a 1-element float32 tensor"):
        sgd_step(p, g, None, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False,
                 **{**_scalars(1.0), "lr": torch.tensor([0.1, 0.2])})


@tiers.FULL_ONLY
@pytest.mark.parametrize("block, num_warps", [(1024, 4), (8192, 8)])
def test_the_adam_kernel_launch_shape_changes_nothing_but_speed(block, num_warps):
    """adam_kernel_sweep.py times other launch shapes: each element's arithmetic is the same in
    every one, so the results must be equal to the default's bit for bit (a last, partial block
    included: 1823 x 781 is not a multiple of any block)."""
    hyper = dict(beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, decoupled=True, **_scalars(3.0))
    default = _streams(1823 * 781, torch.float32, 4, seed=5)
    shaped = [t.clone() for t in default]
    adam_step(*default, force_triton=True, **hyper)
    adam_step(*shaped, force_triton=True, block=block, num_warps=num_warps, **hyper)
    for got, want in zip(shaped, default):
        assert torch.equal(got, want)


@pytest.mark.parametrize("use_kernel", [True, False], ids=["triton", "reference"])
def test_tensor_betas_update_as_number_betas(use_kernel):
    """torch.optim.AdamW takes betas as tensors too, and the compiled step passes a param group's
    betas on as they are."""
    hyper = dict(eps=1e-8, weight_decay=0.1, decoupled=True, force_triton=use_kernel, **_scalars(3.0))
    numbers = _streams(4099, torch.float32, 4, seed=9)
    tensors = [t.clone() for t in numbers]
    adam_step(*numbers, beta1=0.9, beta2=0.999, **hyper)
    # float64 tensors hold the same numbers as the floats (a float32 0.9 is another beta)
    adam_step(*tensors, beta1=torch.tensor(0.9, dtype=torch.float64), beta2=torch.tensor(0.999, dtype=torch.float64),
              **hyper)
    for got, want in zip(tensors, numbers):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("n", [1, 49, 2500])  # 2500: more norms than one block of the kernel reads
@pytest.mark.parametrize("grad_scale, found_inf, max_norm", [(None, None, None), (1024.0, 0.0, 1.0),
                                                             (8.0, 1.0, 0.3), (None, None, 1e6), (None, 0.0, 0.3)])
def test_step_scalars_kernel_matches_reference(n, grad_scale, found_inf, max_norm):
    """The one-launch scalars: multiplier, found_inf, the unscaled global norm (clip_grad_norm_'s)
    and whether the step counts, against the torch ops they replace."""
    pytest.importorskip("triton")
    norms = torch.rand(n, generator=torch.Generator().manual_seed(n)).to(DEVICE) * 3
    as_tensor = lambda x: None if x is None else torch.tensor([x], device=DEVICE)  # noqa: E731
    got = step_scalars(norms, as_tensor(grad_scale), as_tensor(found_inf), max_norm,
                       torch.zeros(4, device=DEVICE), force_triton=True)
    want = step_scalars_reference(norms, as_tensor(grad_scale), as_tensor(found_inf), max_norm,
                                  torch.zeros(4, device=DEVICE))
    # the norm's sum of squares in another order: float32 ulps
    torch.testing.assert_close(got, want, rtol=2e-6, atol=0)
    inv = 1.0 / (grad_scale or 1.0)
    norm = float(norms.double().norm()) * inv
    multiplier = inv * (min(max_norm / (norm + 1e-6), 1.0) if max_norm is not None else 1.0)
    inf = found_inf or 0.0
    expected = [multiplier, inf, norm if max_norm is not None else 0.0, 1.0 - inf]
    torch.testing.assert_close(got.double().cpu(), torch.tensor(expected, dtype=torch.float64), rtol=1e-5, atol=0)


def test_step_scalars_refuses_a_wrong_output():
    with pytest.raises(ValueError, match="out must be 4 contiguous elements of torch.float32"):
        step_scalars(torch.ones(3), None, None, None, torch.zeros(3))
