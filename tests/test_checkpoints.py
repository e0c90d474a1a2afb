"""Checkpoints load into a compiled optimizer in every order, through torch.optim's
load_state_dict and torch.distributed.checkpoint (DCP), and a checkpoint that does not fit is
refused. One process: DCP saves and loads without a process group."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import smddp_lite

OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.05),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, betas=(0.8, 0.99)),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "sgd_nesterov": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True),
}
STATE_KEYS = {"adamw": ("step", "exp_avg", "exp_avg_sq"), "adam": ("step", "exp_avg", "exp_avg_sq"),
              "sgd_momentum": ("momentum_buffer",), "sgd_nesterov": ("momentum_buffer",)}
# what the compiled model has been through when the checkpoint is loaded
ORDERS = ["fresh", "zero_grad", "backward", "stepped"]


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(6, 9), torch.nn.Tanh(), torch.nn.Linear(9, 4))


def _batches(n: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 6, generator=gen), torch.randint(0, 4, (8,), generator=gen)) for _ in range(n)]


def _train(model, optimizer, batches) -> list[float]:
    losses = []
    for x, y in batches:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        losses.append(loss.item())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return losses


def _plain_run(name: str):
    """A plain torch model and optimizer after 3 steps: the run a checkpoint comes from."""
    torch.manual_seed(0)
    model = _model()
    optimizer = OPTIMIZERS[name](model.parameters())
    _train(model, optimizer, _batches(3, seed=1))
    return model, optimizer


def _compiled(name: str, order: str):
    torch.manual_seed(5)  # other weights than the checkpoint's: loading must replace them
    model, optimizer = smddp_lite.compile(module := _model(), OPTIMIZERS[name](module.parameters()))
    if order == "zero_grad":
        optimizer.zero_grad()
    elif order == "backward":
        x, y = _batches(1, seed=7)[0]
        torch.nn.functional.cross_entropy(model(x), y).backward()
    elif order == "stepped":
        _train(model, optimizer, _batches(2, seed=7))
    return model, optimizer


def _assert_state_is(name, compiled_model, compiled_opt, plain_model, plain_opt):
    for (n, mine), theirs in zip(compiled_model.module.named_parameters(), plain_model.parameters()):
        assert torch.equal(mine, theirs), n
        assert mine in compiled_opt.state, f"{n}: no optimizer state was loaded"
        for key in STATE_KEYS[name]:
            assert torch.equal(compiled_opt.state[mine][key].float(), plain_opt.state[theirs][key].float()), (n, key)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_dcp_loads_optimizer_state_into_a_compiled_optimizer_in_every_order(tmp_path, name, order):
    """A DCP checkpoint of a plain run loaded through get_state_dict / dcp.load / set_state_dict.
    Before the first step DCP's template held no optimizer state, so the moments were silently
    left out and training restarted from zero moments."""
    plain_model, plain_opt = _plain_run(name)
    with warnings.catch_warnings():  # DCP says it saves and loads in one process
        warnings.simplefilter("ignore", UserWarning)
        model_sd, optim_sd = get_state_dict(plain_model, plain_opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp_path)
        model, optimizer = _compiled(name, order)
        model_sd, optim_sd = get_state_dict(model.module, optimizer)
        dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp_path)
        set_state_dict(model.module, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    _assert_state_is(name, model, optimizer, plain_model, plain_opt)
    # and training goes on as the plain run does
    batches = _batches(3, seed=2)
    if order in ("backward",):
        optimizer.zero_grad()
    losses_plain, losses = _train(plain_model, plain_opt, batches), _train(model, optimizer, batches)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(losses_plain), rtol=2e-5, atol=2e-6)
    for mine, theirs in zip(model.module.parameters(), plain_model.parameters()):
        torch.testing.assert_close(mine, theirs, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("name", ["adamw", "sgd_momentum"])
def test_load_state_dict_loads_a_plain_checkpoint_in_every_order(name, order):
    plain_model, plain_opt = _plain_run(name)
    model, optimizer = _compiled(name, order)
    model.module.load_state_dict(plain_model.state_dict())
    optimizer.load_state_dict(copy.deepcopy(plain_opt.state_dict()))
    _assert_state_is(name, model, optimizer, plain_model, plain_opt)


def test_a_compiled_checkpoint_before_the_first_step_resumes_as_a_fresh_run(tmp_path):
    """The zero entries a compiled Adam reports before its first step are the state torch starts
    from: loaded into plain AdamW, the run matches a fresh AdamW's."""
    torch.manual_seed(0)
    model, optimizer = smddp_lite.compile(module := _model(), OPTIMIZERS["adamw"](module.parameters()))
    entries = optimizer.state_dict()["state"]
    assert sorted(entries) == list(range(4)) and all(float(e["step"]) == 0 for e in entries.values())
    assert len(optimizer.state) == 0  # the live state is torch's: nothing before the first step
    resumed = copy.deepcopy(model.module)
    resumed_opt = OPTIMIZERS["adamw"](resumed.parameters())
    resumed_opt.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    fresh = copy.deepcopy(model.module)
    fresh_opt = OPTIMIZERS["adamw"](fresh.parameters())
    batches = _batches(3, seed=3)
    assert _train(resumed, resumed_opt, batches) == _train(fresh, fresh_opt, batches)
    for a, b in zip(resumed.parameters(), fresh.parameters()):
        assert torch.equal(a, b)


def test_sgd_with_dampening_reports_no_state_before_its_first_step():
    """A zero momentum buffer is not torch's starting state when dampening is set (the first
    buffer is the gradient, not (1 - dampening) x gradient): none is reported, as torch reports none."""
    model = _model()
    _, optimizer = smddp_lite.compile(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9,
                                                            dampening=0.5))
    assert optimizer.state_dict()["state"] == {}


def test_a_checkpoint_for_another_model_is_refused_with_the_shapes():
    """A state tensor of another shape was broadcast into the flat buffers without a word."""
    plain_model, plain_opt = _plain_run("adamw")
    checkpoint = copy.deepcopy(plain_opt.state_dict())
    checkpoint["state"][0]["exp_avg"] = checkpoint["state"][0]["exp_avg"][:1]  # (1, 6) instead of (9, 6)
    _, optimizer = _compiled("adamw", "fresh")
    with pytest.raises(ValueError, match=r"'exp_avg' for a parameter of shape \(9, 6\) has shape \(1, 6\)"):
        optimizer.load_state_dict(checkpoint)
