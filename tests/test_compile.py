"""smddp_lite.compile on one rank: equivalence with torch.optim, AMP, checkpoints, bad input.

Each test trains the compiled model and an eager copy (the reference: torch.optim with
clip_grad_norm_(foreach=True) and GradScaler.unscale_ where used) on the same batches and
compares the loss every step and the parameters at the end.
"""

from __future__ import annotations

import copy
import logging

import pytest

from . import tiers
import torch

import smddp_lite

STEPS = 25


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(13, 31), torch.nn.Tanh(), torch.nn.Linear(31, 17),
                               torch.nn.Tanh(), torch.nn.Linear(17, 5))


def _batches(n: int = STEPS):
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(24, 13, generator=gen), torch.randint(0, 5, (24,), generator=gen)) for _ in range(n)]


def _groups(model: torch.nn.Module, **second):
    """Two param groups with different hyperparameters: weights and biases."""
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return [{"params": weights}, {"params": biases, **second}]


OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=3e-3, weight_decay=0.05),
    "adam_l2": lambda ps: torch.optim.Adam(ps, lr=2e-3, weight_decay=0.01, betas=(0.8, 0.99)),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=1e-3),
    "sgd_nesterov": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True),
    "sgd_dampening": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.5, dampening=0.3),
    "sgd_plain": lambda ps: torch.optim.SGD(ps, lr=0.1),
}


def _train(model, optimizer, batches, *, clip=None, scaler=None, poison=(), scheduler=None):
    losses = []
    for step, (x, y) in enumerate(batches):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        if step in poison:
            loss = loss * float("inf")  # inf/nan gradients: the scaler must skip this step
        losses.append(loss.item())
        (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            if clip is not None:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip, foreach=True)
            scaler.step(optimizer)
            scaler.update()
        else:
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip, foreach=True)
            optimizer.step()
        optimizer.zero_grad()
        if scheduler:
            scheduler.step()
    return losses


def _compare(compiled, eager, losses_c, losses_e, tol=dict(rtol=2e-5, atol=2e-6)):
    # float32 throughout; the fused update orders a few operations differently: ulps per step
    torch.testing.assert_close(torch.tensor(losses_c), torch.tensor(losses_e), **tol)
    for (name, a), b in zip(compiled.module.named_parameters(), eager.parameters()):
        torch.testing.assert_close(a, b, **tol, msg=lambda m: f"{name}: {m}")


def _assert_same_parameters(compiled, eager):
    for a, b in zip(compiled.module.parameters(), eager.parameters()):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("clip", [None, 0.3])
def test_matches_torch_optim_with_schedule_groups_and_clipping(name, clip):
    eager = _model()
    model = copy.deepcopy(eager)
    make = OPTIMIZERS[name]
    opt_e = make(_groups(eager, lr=1e-3 if "adam" in name else 0.02, weight_decay=0.0))
    compiled, opt_c = smddp_lite.compile(model, make(_groups(model, lr=1e-3 if "adam" in name else 0.02,
                                                                weight_decay=0.0)), max_grad_norm=clip)
    sched_e = torch.optim.lr_scheduler.OneCycleLR(opt_e, max_lr=[0.01, 0.005], total_steps=STEPS)
    sched_c = torch.optim.lr_scheduler.OneCycleLR(opt_c, max_lr=[0.01, 0.005], total_steps=STEPS)
    batches = _batches()
    losses_e = _train(eager, opt_e, batches, clip=clip, scheduler=sched_e)
    losses_c = _train(compiled, opt_c, batches, scheduler=sched_c)
    _compare(compiled, eager, losses_c, losses_e)
    if clip is not None:
        assert opt_c.last_grad_norm is not None and opt_c.last_grad_norm.numel() == 1


@pytest.mark.parametrize("clip", [None, 0.3])
def test_grad_scaler_skips_inf_steps_like_torch(clip):
    eager = _model()
    model = copy.deepcopy(eager)
    opt_e = torch.optim.AdamW(eager.parameters(), lr=3e-3)
    compiled, opt_c = smddp_lite.compile(model, torch.optim.AdamW(model.parameters(), lr=3e-3), max_grad_norm=clip)
    scaler_e = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=4)
    scaler_c = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=4)
    batches = _batches()
    losses_e = _train(eager, opt_e, batches, clip=clip, scaler=scaler_e, poison=(3, 4, 11))
    losses_c = _train(compiled, opt_c, batches, scaler=scaler_c, poison=(3, 4, 11))
    assert scaler_c.get_scale() == scaler_e.get_scale()  # the same steps were skipped
    finite = [i for i in range(STEPS) if i not in (3, 4, 11)]
    _compare(compiled, eager, [losses_c[i] for i in finite], [losses_e[i] for i in finite])
    assert opt_c.state_dict()["state"][0]["step"].item() == STEPS - 3  # skipped steps do not count


def test_user_unscale_before_step_with_max_grad_norm_clips_the_unscaled_norm():
    """A script that calls scaler.unscale_(optimizer) itself (to log or clip) divides the buckets
    after backward took their norms; the step must clip by the norm of the unscaled gradients."""
    eager = _model()
    model = copy.deepcopy(eager)
    opt_e = torch.optim.AdamW(eager.parameters(), lr=3e-3)
    compiled, opt_c = smddp_lite.compile(model, torch.optim.AdamW(model.parameters(), lr=3e-3), max_grad_norm=0.3)
    scaler_e = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler_c = torch.amp.GradScaler("cpu", init_scale=1024.0)
    batches = _batches(10)
    losses_e = _train(eager, opt_e, batches, clip=0.3, scaler=scaler_e)
    losses_c = []
    for x, y in batches:
        loss = torch.nn.functional.cross_entropy(compiled(x), y)
        losses_c.append(loss.item())
        scaler_c.scale(loss).backward()
        scaler_c.unscale_(opt_c)
        scaler_c.step(opt_c)
        scaler_c.update()
        opt_c.zero_grad()
    _compare(compiled, eager, losses_c, losses_e)


@pytest.mark.parametrize("path", ["cpu", "triton"])
@pytest.mark.parametrize("name", ["adamw", "adam_l2", "sgd_momentum"])
@pytest.mark.parametrize("scaled, clip", [(True, None), (False, 0.3), (True, 0.3), (False, None)],
                         ids=["scaler", "clip", "scaler+clip", "neither"])
@pytest.mark.parametrize("write_back", [True, False], ids=["write_back", "no_write_back"])
def test_grads_after_step_are_unscaled_and_clipped_as_torchs_when_asked(monkeypatch, path, name, scaled, clip,
                                                                        write_back):
    """With ``write_back_grads=True``, after step() ``.grad`` holds what a torch.optim script
    leaves there: unscaled (GradScaler.unscale_, or torch's fused step given grad_scale) and
    clipped (clip_grad_norm_). Without it the fused kernels (``triton``: in Triton's interpreter
    without a GPU, as on CUDA) leave ``.grad`` as backward left it, while torch's fused CPU
    kernels (``cpu``) unscale and clip it in the same pass either way; the update is the same."""
    if path == "triton":
        pytest.importorskip("triton")
        for module in ("adam", "sgd"):
            monkeypatch.setattr(f"smddp_lite.kernels.{module}.use_triton", lambda device, force, dtype: True)
    eager = _model()
    model = copy.deepcopy(eager)
    make = OPTIMIZERS[name]
    opt_e = make(eager.parameters())
    compiled, opt_c = smddp_lite.compile(model, make(model.parameters()), max_grad_norm=clip,
                                         write_back_grads=write_back)
    scaler_e, scaler_c = (torch.amp.GradScaler("cpu", init_scale=1024.0, enabled=scaled) for _ in range(2))
    losses = {"eager": [], "compiled": []}
    as_backward_left = []
    for step, (x, y) in enumerate(_batches(3)):
        for net, opt, scaler, clips in ((eager, opt_e, scaler_e, clip), (compiled, opt_c, scaler_c, None)):
            loss = torch.nn.functional.cross_entropy(net(x), y)
            losses["eager" if net is eager else "compiled"].append(loss.item())
            scaler.scale(loss).backward()
            if clips is not None:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(net.parameters(), clips, foreach=True)
            if net is compiled:
                as_backward_left = [p.grad.clone() for p in net.parameters()]
            scaler.step(opt)
            scaler.update()
        torchs = write_back or path == "cpu"
        for (pname, a), b, left in zip(compiled.module.named_parameters(), eager.parameters(), as_backward_left):
            # float32; 1/scale multiplies where torch divides, and the clipping coefficient
            # comes from a norm summed in another order: ulps
            torch.testing.assert_close(a.grad, b.grad if torchs else left, rtol=2e-5, atol=1e-7,
                                       msg=lambda m: f"step {step} {pname}: {m}")
        opt_e.zero_grad()
        opt_c.zero_grad()
    _compare(compiled, eager, losses["compiled"], losses["eager"])


def test_last_grad_norm_is_clip_grad_norm_s_and_each_step_keeps_its_own():
    """``optimizer.last_grad_norm`` is the unscaled global norm clipping used, as
    clip_grad_norm_ returns it, and a norm kept from one step is not overwritten by the next."""
    eager = _model()
    model = copy.deepcopy(eager)
    opt_e = torch.optim.AdamW(eager.parameters(), lr=3e-3)
    compiled, opt_c = smddp_lite.compile(model, torch.optim.AdamW(model.parameters(), lr=3e-3), max_grad_norm=0.3)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    kept, expected = [], []
    for x, y in _batches(3):
        torch.nn.functional.cross_entropy(eager(x), y).backward()
        expected.append(torch.nn.utils.clip_grad_norm_(eager.parameters(), 0.3))
        opt_e.step()
        opt_e.zero_grad()
        scaler.scale(torch.nn.functional.cross_entropy(compiled(x), y)).backward()
        scaler.step(opt_c)
        scaler.update()
        opt_c.zero_grad()
        kept.append(opt_c.last_grad_norm)
    # the gradients of a loss scaled by a power of two, unscaled: float32 rounding of the norm
    torch.testing.assert_close(torch.cat(kept), torch.stack(expected), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name", ["adamw", "adam_l2", "sgd_nesterov"])
def test_float64_models_update_in_float64(name):
    """A float64 model's update matches torch.optim's to float64 rounding, clipping included:
    float32 scalars alone (a learning rate of 3e-3 rounds at 2e-8) left it 1e-9 off."""
    eager = _model().double()
    model = copy.deepcopy(eager)
    make = OPTIMIZERS[name]
    opt_e = make(eager.parameters())
    compiled, opt_c = smddp_lite.compile(model, make(model.parameters()), max_grad_norm=0.3)
    batches = [(x.double(), y) for x, y in _batches(10)]
    losses_e = _train(eager, opt_e, batches, clip=0.3)
    losses_c = _train(compiled, opt_c, batches)
    _compare(compiled, eager, losses_c, losses_e, tol=dict(rtol=1e-12, atol=1e-14))
    assert opt_c.last_grad_norm.dtype == torch.float64


@pytest.mark.parametrize("name", ["adamw", "sgd_momentum", "sgd_plain"])
def test_optimizer_state_holds_torchs_entries_after_each_step(name):
    """Scripts read optimizer.state[p] directly (to log second moments, or to move state after a
    checkpoint loads): it holds what torch's would, follows each step without a state_dict()
    call, and writes into it reach the update."""
    eager = _model()
    model = copy.deepcopy(eager)
    make = OPTIMIZERS[name]
    opt_e = make(eager.parameters())
    compiled, opt_c = smddp_lite.compile(model, make(model.parameters()))
    assert len(opt_c.state) == 0 == len(opt_e.state)
    for i, batch in enumerate(_batches(4)):
        _train(compiled, opt_c, [batch])
        _train(eager, opt_e, [batch])
        ours = {n: opt_c.state[p] for n, p in compiled.module.named_parameters() if p in opt_c.state}
        torchs = {n: opt_e.state[p] for n, p in eager.named_parameters() if p in opt_e.state}
        assert sorted(ours) == sorted(torchs)
        for n in torchs:
            assert sorted(ours[n]) == sorted(torchs[n]), n
            for key, value in torchs[n].items():
                torch.testing.assert_close(ours[n][key].float(), value.float(), rtol=2e-5, atol=2e-6)
        if i == 1 and torchs:  # an in-place write (a user resetting the moments) reaches the next step
            for state in (opt_c.state, opt_e.state):
                for entry in state.values():
                    next(v for k, v in entry.items() if k != "step").mul_(0.5)
    for a, b in zip(compiled.module.parameters(), eager.parameters()):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-6)
    # a checkpoint's step is its own CPU copy: it does not replace the live state
    opt_c.state_dict()
    if "adam" in name:
        _train(compiled, opt_c, _batches(1))
        assert next(iter(opt_c.state.values()))["step"].item() == 5


@pytest.mark.parametrize("name", ["adamw", "sgd_momentum"])
def test_checkpoints_move_both_ways_between_compiled_and_torch(name):
    make = OPTIMIZERS[name]
    batches = _batches(12)
    base = _model()
    # compiled for 6 steps, then its checkpoint resumes in plain torch.optim
    model_a = copy.deepcopy(base)
    compiled, opt_c = smddp_lite.compile(model_a, make(model_a.parameters()))
    _train(compiled, opt_c, batches[:6])
    plain = copy.deepcopy(model_a)
    opt_p = make(plain.parameters())
    # state_dict() returns references to live state, as torch's does: copy it, as saving would
    opt_p.load_state_dict(copy.deepcopy(opt_c.state_dict()))
    # ... and plain torch's checkpoint resumes in a freshly compiled copy
    model_b = copy.deepcopy(model_a)
    compiled_b, opt_b = smddp_lite.compile(model_b, make(model_b.parameters()))
    opt_b.load_state_dict(copy.deepcopy(opt_p.state_dict()))
    losses_p = _train(plain, opt_p, batches[6:])
    losses_a = _train(compiled, opt_c, batches[6:])
    losses_b = _train(compiled_b, opt_b, batches[6:])
    _compare(compiled, plain, losses_a, losses_p)
    _compare(compiled_b, plain, losses_b, losses_p)


def test_gradient_accumulation_with_no_sync_and_grads_are_bucket_views():
    eager = _model()
    model = copy.deepcopy(eager)
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.1)
    compiled, opt_c = smddp_lite.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), bucket_cap_mb=0.0004,
                                         first_bucket_mb=0.0002)
    assert len(opt_c.buckets) > 2  # small caps: several buckets
    (x1, y1), (x2, y2) = _batches(2)
    for net, ctx in ((eager, None), (compiled, compiled.no_sync())):
        if ctx:
            with ctx:
                torch.nn.functional.cross_entropy(net(x1), y1).backward()
        else:
            torch.nn.functional.cross_entropy(net(x1), y1).backward()
        torch.nn.functional.cross_entropy(net(x2), y2).backward()
    opt_e.step()
    opt_c.step()
    for a, b in zip(compiled.module.parameters(), eager.parameters()):
        torch.testing.assert_close(a, b)
        owners = [bk for bk in opt_c.buckets if any(p is a for p in bk.params)]
        assert len(owners) == 1 and owners[0].grad_flat.data_ptr() <= a.grad.data_ptr()


def test_model_zero_grad_set_to_none_is_repaired():
    model = _model()
    compiled, opt = smddp_lite.compile(model, torch.optim.SGD(model.parameters(), lr=0.1))
    (x, y), = _batches(1)
    compiled.module.zero_grad(set_to_none=True)  # autograd will store fresh tensors
    torch.nn.functional.cross_entropy(compiled(x), y).backward()
    flat = opt.buckets[0]
    assert all(p.grad is not None for p in flat.params)
    assert flat.grad_flat.abs().sum() > 0  # the fresh gradients were copied into the bucket


def test_unused_parameter_is_documented_behaviour(caplog):
    model = _model()
    model.add_module("unused", torch.nn.Linear(3, 3))
    compiled, opt = smddp_lite.compile(model, torch.optim.SGD(model.parameters(), lr=0.1))
    (x, y), = _batches(1)
    with caplog.at_level(logging.WARNING, logger="smddp_lite"):
        smddp_lite_logger = logging.getLogger("smddp_lite")
        smddp_lite_logger.propagate = True
        try:
            torch.nn.functional.cross_entropy(compiled.module[:5](x), y).backward()
        finally:
            smddp_lite_logger.propagate = False
    assert "got no gradient" in caplog.text
    before = model.unused.weight.detach().clone()
    opt.step()
    assert torch.equal(model.unused.weight, before)  # zero gradient, no weight decay: unchanged


@pytest.mark.parametrize("make, match", [
    (lambda m: torch.optim.RMSprop(m.parameters()), "RMSprop is not supported; supported: torch.optim.AdamW"),
    (lambda m: torch.optim.AdamW(m.parameters(), amsgrad=True), r"amsgrad=True\) is not supported"),
    (lambda m: torch.optim.SGD(list(m.parameters())[:2], lr=0.1), "not in the optimizer"),
])
def test_unsupported_optimizers_are_refused_by_name(make, match):
    model = _model()
    with pytest.raises(ValueError, match=match):
        smddp_lite.compile(model, make(model))


def test_bad_options_and_models_are_refused():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="unknown option.*bucket_size.*known: .*bucket_cap_mb"):
        smddp_lite.compile(model, opt, bucket_size=4)
    with pytest.raises(ValueError, match="wire_dtype='int4'.*expected one of .*int8, float8_e4m3fn"):
        smddp_lite.compile(model, opt, wire_dtype="int4")
    with pytest.raises(ValueError, match="max_grad_norm"):
        smddp_lite.compile(model, opt, max_grad_norm=-1.0)
    mixed = _model()
    mixed[0].to("meta")
    with pytest.raises(ValueError, match="several devices"):
        smddp_lite.compile(mixed, torch.optim.SGD(mixed.parameters(), lr=0.1))


@pytest.mark.parametrize("variable", ["WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"])
def test_compile_before_the_group_in_a_job_of_several_ranks_is_refused(monkeypatch, variable):
    """Under torchrun (or mpiexec) with 2 ranks, compiling before init_process_group trained each
    rank alone, with no error, and the ranks' weights drifted apart."""
    monkeypatch.setenv(variable, "2")
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=f"{variable}=2 says this job runs 2 processes.*smddp_lite.init()"):
        smddp_lite.compile(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert all(torch.equal(a, b) and a.grad is None for a, b in zip(model.parameters(), before))
    monkeypatch.setenv(variable, "1")  # a one-process job is fine without a group
    smddp_lite.compile(model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_options_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("SMDDP_MAX_GRAD_NORM", "0.25")
    model = _model()
    _, opt = smddp_lite.compile(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert opt.max_grad_norm == 0.25
    model = _model()
    _, opt = smddp_lite.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), max_grad_norm=None)
    assert opt.max_grad_norm is None  # a keyword argument beats the environment


def test_scale_lr_rule():
    assert smddp_lite.scale_lr(1e-3, 4) == pytest.approx(4e-3)
    assert smddp_lite.scale_lr(1e-3, 4, "sqrt") == pytest.approx(2e-3)
    with pytest.raises(ValueError, match="linear' or 'sqrt"):
        smddp_lite.scale_lr(1e-3, 4, "cubic")


def test_buckets_close_once_they_reach_their_cap_as_in_ddp():
    from smddp_lite.compiler.buckets import plan_buckets

    kib = 1024
    sizes = [64, 512 * 256, 256, 2048 * 256, 64]  # bias, weight, bias, weight, bias (float32 elements)
    params = [torch.nn.Parameter(torch.zeros(n)) for n in sizes]
    buckets = plan_buckets([(0, p) for p in params], cap_bytes=1024 * kib, first_cap_bytes=256 * kib)
    # the first bucket takes the 512 KiB weight that crosses its 256 KiB cap (DDP does the same),
    # so the last layer's weight is reduced early in backward instead of with the last bucket
    assert [[p.numel() for p in b.params] for b in buckets] == [[64, 512 * 256], [256, 2048 * 256], [64]]
    assert [b.offsets for b in buckets] == [[0, 64], [0, 256], [0]]
    half = [torch.nn.Parameter(torch.zeros(8, dtype=torch.float16)), torch.nn.Parameter(torch.zeros(8))]
    assert len(plan_buckets([(0, p) for p in half], 1 << 20, 1 << 20)) == 2  # one dtype per bucket


def test_frozen_parameters_may_be_in_the_optimizer_and_unfreezing_them_is_refused():
    """AdamW(model.parameters()) on a partly frozen model: accepted (torch.optim skips them), the
    frozen layer stays as it is, and one unfrozen afterwards is refused at step() rather than
    silently left out of the buckets."""
    model = _model()
    model[0].requires_grad_(False)
    eager = copy.deepcopy(model)
    compiled, opt = smddp_lite.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-2)
    for x, y in _batches(3):
        for net, o in ((compiled, opt), (eager, opt_e)):
            torch.nn.functional.cross_entropy(net(x), y).backward()
            o.step()
            o.zero_grad()
    _assert_same_parameters(compiled, eager)
    model[0].requires_grad_(True)
    x, y = _batches(1)[0]
    torch.nn.functional.cross_entropy(compiled(x), y).backward()
    with pytest.raises(ValueError, match=r"requires_grad=False when the model was compiled.*compile again"):
        opt.step()


def test_add_param_group_and_mixed_decoupled_adam_groups_are_refused():
    model = _model()
    _, opt = smddp_lite.compile(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="add_param_group after compile is not supported"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(3))]})
    model = _model()
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    adam = torch.optim.Adam([{"params": weights, "decoupled_weight_decay": True}, {"params": biases}], lr=1e-3)
    with pytest.raises(ValueError, match="decoupled_weight_decay=True on some param groups"):
        smddp_lite.compile(model, adam)


def test_model_zero_grad_then_an_unused_parameter_is_not_updated_with_its_old_gradient():
    """model.zero_grad() sets .grad to None; a parameter that then gets no gradient must be
    updated as if it were zero (the warning says so), not with the gradient of the step before."""
    model = _model()
    model.add_module("head", torch.nn.Linear(5, 5))
    compiled, opt = smddp_lite.compile(model, torch.optim.SGD(model.parameters(), lr=0.1))
    (x1, y1), (x2, y2) = _batches(2)
    torch.nn.functional.cross_entropy(model.head(compiled(x1)), y1).backward()
    opt.step()
    compiled.zero_grad()  # set_to_none=True
    before = model.head.weight.detach().clone()
    torch.nn.functional.cross_entropy(compiled.module[:5](x2), y2).backward()
    opt.step()
    assert torch.equal(model.head.weight, before)


def test_a_backward_that_raised_part_way_does_not_break_later_steps():
    """An error in backward after some gradient hooks ran (an out-of-memory error caught and the
    batch retried) left the reducer counting that backward: later backwards never took their
    gradient norms, and clipping used a stale one."""
    class FailsOnce(torch.autograd.Function):
        armed = True

        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            if FailsOnce.armed:
                FailsOnce.armed = False
                raise RuntimeError("simulated out of memory")
            return g

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.a, self.b = torch.nn.Linear(13, 31), torch.nn.Linear(31, 5)

        def forward(self, x):
            return self.b(FailsOnce.apply(torch.tanh(self.a(x))))

    eager = Net()
    model = copy.deepcopy(eager)
    compiled, opt = smddp_lite.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), max_grad_norm=0.1)
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.1)
    (x0, y0), *rest = _batches(4)
    with pytest.raises(RuntimeError, match="simulated out of memory"):
        torch.nn.functional.cross_entropy(compiled(x0), y0).backward()
    opt.zero_grad()
    for x, y in rest:
        torch.nn.functional.cross_entropy(eager(x), y).backward()
        norm = torch.nn.utils.clip_grad_norm_(eager.parameters(), 0.1)
        opt_e.step()
        opt_e.zero_grad()
        torch.nn.functional.cross_entropy(compiled(x), y).backward()
        opt.step()
        opt.zero_grad()
        torch.testing.assert_close(opt.last_grad_norm.reshape(()), norm, rtol=1e-5, atol=1e-7)
    _assert_same_parameters(compiled, eager)


def test_sgd_momentum_turned_on_mid_run_starts_its_buffer_at_the_gradient():
    """A schedule that turns momentum on after two steps (dampening 0.5): torch starts the
    buffer at the gradient on the first step with momentum, not at (1 - dampening) x gradient."""
    model = _model()
    eager = copy.deepcopy(model)
    compiled, opt = smddp_lite.compile(model, torch.optim.SGD(model.parameters(), lr=0.05, dampening=0.5))
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.05, dampening=0.5)
    assert opt.state_dict()["state"] == {}
    for i, (x, y) in enumerate(_batches(5)):
        for o in (opt, opt_e):
            o.param_groups[0]["momentum"] = 0.9 if i >= 2 else 0.0
        for net, o in ((compiled, opt), (eager, opt_e)):
            torch.nn.functional.cross_entropy(net(x), y).backward()
            o.step()
            o.zero_grad()
        if i == 1:  # no step with momentum yet: no state, as torch keeps none
            assert opt.state_dict()["state"] == {} == opt_e.state_dict()["state"]
    _assert_same_parameters(compiled, eager)
    ours, torchs = opt.state_dict()["state"], opt_e.state_dict()["state"]
    assert sorted(ours) == sorted(torchs)
    for key in torchs:
        torch.testing.assert_close(ours[key]["momentum_buffer"], torchs[key]["momentum_buffer"])


def test_a_scheduler_made_before_compile_drives_the_compiled_steps():
    """Porting a script is adding the compile line after the optimizer and its scheduler exist:
    the scheduler edits the optimizer passed in, whose groups the compiled step must read (it
    read copies, and the learning rate never moved). Also after a checkpoint is loaded."""
    model = _model()
    eager = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.1)
    compiled, opt = smddp_lite.compile(model, opt)
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.1, momentum=0.9)
    scheduler_e = torch.optim.lr_scheduler.StepLR(opt_e, step_size=2, gamma=0.1)
    batches = _batches(8)
    _train(compiled, opt, batches[:4], scheduler=scheduler)
    _train(eager, opt_e, batches[:4], scheduler=scheduler_e)
    opt.load_state_dict(opt_e.state_dict())  # resuming: torch makes new group dicts
    _train(compiled, opt, batches[4:], scheduler=scheduler)
    _train(eager, opt_e, batches[4:], scheduler=scheduler_e)
    assert opt.param_groups[0]["lr"] == pytest.approx(opt_e.param_groups[0]["lr"]) == pytest.approx(1e-5)
    _assert_same_parameters(compiled, eager)


def test_clipping_measures_gradients_changed_in_place_after_backward():
    """A loss summed over the batch, its gradients divided by the batch size before step():
    backward's norms were of the undivided gradients, and the step clipped 24x too hard."""
    model = _model()
    eager = copy.deepcopy(model)
    compiled, opt = smddp_lite.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), max_grad_norm=0.1)
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.1)
    for x, y in _batches(4):
        for net, o in ((compiled, opt), (eager, opt_e)):
            torch.nn.functional.cross_entropy(net(x), y, reduction="sum").backward()
            for p in net.parameters():
                p.grad.div_(len(x))
            if o is opt_e:
                norm = torch.nn.utils.clip_grad_norm_(eager.parameters(), 0.1)
            o.step()
            o.zero_grad()
        torch.testing.assert_close(opt.last_grad_norm.reshape(()), norm, rtol=1e-5, atol=1e-7)
    _assert_same_parameters(compiled, eager)


def test_a_step_with_no_backward_after_model_zero_grad_applies_no_old_gradient():
    """model.zero_grad() set every .grad to None and step() came without a backward: the
    buckets still held the last gradients, and plain SGD moved every parameter by them again."""
    model = _model()
    compiled, opt = smddp_lite.compile(model, torch.optim.SGD(model.parameters(), lr=0.1))
    ((x, y),) = _batches(1)
    torch.nn.functional.cross_entropy(compiled(x), y).backward()
    opt.step()
    compiled.zero_grad()
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())


@pytest.mark.parametrize("how", ["param_groups", "checkpoint"])
def test_options_the_fused_step_lacks_are_refused_when_set_after_compile(how):
    """amsgrad and maximize were refused at compile only: turned on in param_groups, or by
    loading a plain Adam(amsgrad=True) checkpoint, the step silently went without them."""
    model = _model()
    compiled, opt = smddp_lite.compile(model, torch.optim.Adam(model.parameters(), lr=1e-3))
    if how == "param_groups":
        opt.param_groups[0]["amsgrad"] = True
        with pytest.raises(ValueError, match=r"Adam\(amsgrad=True\) is not supported \(set after compile\)"):
            opt.step()
    else:
        plain = torch.optim.Adam(_model().parameters(), lr=1e-3, amsgrad=True)
        with pytest.raises(ValueError, match=r"Adam\(amsgrad=True\) is not supported \(in the checkpoint\)"):
            opt.load_state_dict(plain.state_dict())
        assert opt.param_groups[0]["amsgrad"] is False  # the optimizer is left as it was
    opt.param_groups[0]["amsgrad"] = False
    opt.param_groups[0]["decoupled_weight_decay"] = True
    with pytest.raises(ValueError, match="decoupled_weight_decay=True differs from the compiled step's"):
        opt.step()


@pytest.mark.parametrize("how", ["compiled_optimizer", "torch_optimizer_with_its_state"])
def test_compiling_again_after_unfreezing_keeps_the_optimizer_state(how):
    """The README says to compile again after changing requires_grad: the compiled optimizer was
    refused there, and a torch one loaded with its state failed ("different step counts"), since
    the unfrozen parameters have none. They now get buckets of their own; the earlier compile's
    gradient hooks are removed (each bucket would be all-reduced twice)."""
    model = _model()
    model[0].requires_grad_(False)
    eager = copy.deepcopy(model)
    compiled, opt = smddp_lite.compile(model, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.05))
    opt_e = torch.optim.AdamW(eager.parameters(), lr=3e-3, weight_decay=0.05)
    batches = _batches(8)
    _train(compiled, opt, batches[:4])
    _train(eager, opt_e, batches[:4])
    model[0].requires_grad_(True)
    eager[0].requires_grad_(True)
    if how == "torch_optimizer_with_its_state":
        again = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.05)
        again.load_state_dict(opt.state_dict())
        opt = again
    compiled, opt = smddp_lite.compile(model, opt)
    assert all(len(p._post_accumulate_grad_hooks) == 1 for p in model.parameters())
    _train(compiled, opt, batches[4:])
    _train(eager, opt_e, batches[4:])
    _assert_same_parameters(compiled, eager)


def test_optimizer_benchmark_baselines_are_the_step_they_claim_to_be():
    """benchmarks/optimizer_step.py's fair baselines: the fullgraph function and the folded fused
    AdamW must update as unscale + clip_grad_norm_ + torch.optim.AdamW do, or their times say
    nothing about the step smddp replaces."""
    from benchmarks.optimizer_step import build_folded, clipped_adamw, make_params

    def reference(steps: int):
        params = make_params(50_000, "cpu")
        opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)
        for k in range(steps):
            for i, p in enumerate(params):
                p.grad = torch.full_like(p, 1024.0 * (k + 1)) * torch.linspace(-1, 1, p.numel()).view_as(p)
                p.grad.mul_(1 / 1024.0)
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
        return params

    want = reference(3)
    params = [p.detach() for p in make_params(50_000, "cpu")]
    m, v = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
    step_t, lr, scale = torch.zeros(()), torch.tensor(1e-2), torch.tensor(1024.0)
    for k in range(3):
        grads = [torch.full_like(p, 1024.0 * (k + 1)) * torch.linspace(-1, 1, p.numel()).view_as(p) for p in params]
        clipped_adamw(params, grads, m, v, step_t, lr, scale)
    for got, ref in zip(params, want):
        torch.testing.assert_close(got, ref.detach(), rtol=1e-5, atol=1e-6)

    folded = build_folded(make_params(50_000, "cpu"), "cpu", flat=False)
    before = [p.detach().clone() for p in folded.params]
    folded.step()
    eager = make_params(50_000, "cpu")
    opt = torch.optim.AdamW(eager, lr=1e-4, weight_decay=0.01)
    for p, g in zip(eager, folded.grads):
        p.grad = g / 1024.0
    torch.nn.utils.clip_grad_norm_(eager, 1.0)
    opt.step()
    for got, ref, start in zip(folded.params, eager, before):
        assert not torch.equal(got, start)
        torch.testing.assert_close(got.detach(), ref.detach(), rtol=1e-5, atol=1e-7)


@tiers.FULL_ONLY
def test_optimizer_benchmark_runs_on_cpu(tmp_path):
    """The smoke run CI makes of the GPU benchmark: every eager variant, small sizes."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "step.json"
    subprocess.run([sys.executable, "benchmarks/optimizer_step.py", "--device", "cpu", "--params", "20K", "--rounds",
                    "2", "--no-torch-compile", "--json", str(out)], cwd=root, check=True, timeout=120,
                   capture_output=True)
    rows = json.loads(out.read_text())["rows"]
    assert {r["variant"] for r in rows} == {"eager", "folded", "folded-flat", "smddp", "smddp-all"}
    assert all(r["median_ms"] > 0 for r in rows)


@tiers.FULL_ONLY
def test_train_step_benchmark_runs_on_cpu_and_its_three_ways_agree(tmp_path):
    """The CPU smoke run of benchmarks/train_step.py: DDP on gloo, DDP on smddp and the compiled
    step train the same tiny model on the same batches, so their losses must agree (bfloat16
    autocast: to its precision)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "train.json"
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                    "benchmarks/train_step.py", "--size", "tiny", "--steps", "3", "--rounds", "1", "--json", str(out)],
                   cwd=root, check=True, timeout=180, capture_output=True)
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"ddp-gloo", "ddp-smddp", "compiled"}
    losses = [r["final_loss"] for r in rows.values()]
    assert max(losses) - min(losses) < 0.02 * max(losses), rows
    assert all(r["tokens_per_s"] > 0 for r in rows.values())


class _CountOps(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the aten ops run inside it: on a GPU each is a launch (or a host-side view)."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", ["adamw", "sgd_momentum"])
@pytest.mark.parametrize("scaled", [True, False], ids=["scaler", "no_scaler"])
def test_the_step_s_launches_do_not_grow_with_the_number_of_buckets(name, scaled):
    """One update per param group (its buckets share one arena) and one launch for the step's
    scalars: a step over 5 buckets runs the same ops as over 1, and clipping reads the norms
    backward took, not the gradients."""
    counts, buckets = [], []
    for cap in (1e-6, 100.0):  # every parameter its own bucket; one bucket for all
        model = _model()
        compiled, opt = smddp_lite.compile(model, OPTIMIZERS[name](_groups(model)), max_grad_norm=0.3,
                                           bucket_cap_mb=cap, first_bucket_mb=cap)
        scaler = torch.amp.GradScaler("cpu", init_scale=64.0, enabled=scaled)
        for step, (x, y) in enumerate(_batches(3)):
            scaler.scale(torch.nn.functional.cross_entropy(compiled(x), y)).backward()
            if step == 2:
                opt.grad_scale = scaler._scale if scaled else None  # what GradScaler.step hands over
                opt.found_inf = torch.zeros(1) if scaled else None
                with _CountOps() as mode:
                    opt.step()
                counts.append(sorted(mode.ops))
                del opt.grad_scale, opt.found_inf
            else:
                scaler.step(opt)
                scaler.update()
            opt.zero_grad()
        buckets.append(len(opt.buckets))
        assert len(opt.arenas) == 2  # the two param groups
    assert buckets[0] == 6 and buckets[1] == 2, buckets
    assert counts[0] == counts[1], counts
    # the norm of the buckets' norms (the CPU's torch ops for the scalars' launch), no bucket's
    assert sum("linalg_vector_norm" in op for op in counts[0]) == 1, counts[0]
