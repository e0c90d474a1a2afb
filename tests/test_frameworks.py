"""The training frameworks' examples of docs/frameworks.md, each on 2 CPU ranks under torchrun,
on "smddp" and on gloo: the same losses and weights."""

from __future__ import annotations

import importlib.util
import json

import pytest

from . import harness, tiers

# the first, which needs torch alone, is the quick tier's (tests/tiers.py)
EXAMPLES = {"dcp_resume": "torch", "hf_trainer": "transformers", "accelerate_loop": "accelerate",
            "lightning_fit": "lightning"}


# the examples whose --compile turns on the framework's own compile switch (torch.compile around
# the DDP model it wraps): what users of the Trainer's torch_compile=True reach
COMPILED = ("hf_trainer", "accelerate_loop", "lightning_fit")
_gloo_results: dict[tuple[str, bool], dict] = {}  # the reference runs, once per session


def _run(example: str, backend: str, out, *, compiled: bool = False, transport: str | None = None,
         more: tuple[str, ...] = ()) -> dict:
    args = ["-m", f"smddp_lite.examples.{example}", "--backend", backend, "--out", str(out), *more]
    args += ["--compile"] if compiled else []
    env = {"SMDDP_TRANSPORT": transport} if transport else None
    if transport == "mpi":
        run = harness.mpiexec_python(args, cwd=harness.ROOT, env=env)
    else:
        run = harness.torchrun(args, cwd=harness.ROOT, env=env)
    assert run.returncode == 0, f"{example} on {backend} ({transport or 'default transport'}):\n{run.stdout}\n{run.stderr}"
    if transport is not None:  # rank 0 logs the default group's transport
        assert f"uses transport {transport}" in run.stdout + run.stderr, run.stdout + run.stderr
    return json.loads(out.read_text())


def _on_gloo(example: str, compiled: bool, tmp_path) -> dict:
    if (example, compiled) not in _gloo_results:
        _gloo_results[example, compiled] = _run(example, "gloo", tmp_path / "gloo.json", compiled=compiled)
    return _gloo_results[example, compiled]


def _assert_same_training(ours: dict, gloo: dict) -> None:
    assert ours["world_size"] == gloo["world_size"] == 2
    assert len(ours["losses"]) == len(gloo["losses"]) >= 6, (ours["losses"], gloo["losses"])
    # two ranks: every sum has two terms, in either order the same float
    assert ours["losses"] == pytest.approx(gloo["losses"], rel=1e-6), (ours["losses"], gloo["losses"])
    assert ours["parameter_sums"] == pytest.approx(gloo["parameter_sums"], rel=1e-6, abs=1e-9)


@pytest.mark.parametrize("example", list(EXAMPLES))
def test_framework_example_gives_the_results_it_gives_on_gloo(tmp_path, example):
    if importlib.util.find_spec(EXAMPLES[example]) is None:
        pytest.skip(f"{EXAMPLES[example]} is not installed (pip install -e '.[test]' installs it)")
    ours = _run(example, "smddp", tmp_path / "smddp.json")
    _assert_same_training(ours, _on_gloo(example, False, tmp_path))
    if example == "dcp_resume":  # resumed in the compiled step with AdamW's moments: as if never stopped
        assert ours["losses"] == pytest.approx(ours["uninterrupted"], rel=1e-5)


# every example on every CPU transport in the quick tier too: compiling around DDP reaches each
# transport's own code from dynamo's frames (the compile boundary must cover all of them)
@pytest.mark.parametrize("transport", ["shm", "gloo", "mpi"])
@pytest.mark.parametrize("example", [pytest.param(e, marks=tiers.QUICK) for e in COMPILED])
def test_framework_compiled_by_its_own_switch_gives_the_results_it_gives_on_gloo(tmp_path, example, transport):
    """The Trainer's torch_compile=True, Accelerate's dynamo plugin and a compiled LightningModule
    each compile DDP's forward and backward (torch's DDPOptimizer) around calls on this backend."""
    if importlib.util.find_spec(EXAMPLES[example]) is None:
        pytest.skip(f"{EXAMPLES[example]} is not installed (pip install -e '.[test]' installs it)")
    if transport == "mpi":
        harness.skip_without_mpiexec()
    ours = _run(example, "smddp", tmp_path / "smddp.json", compiled=True, transport=transport)
    _assert_same_training(ours, _on_gloo(example, True, tmp_path))


# frameworks that reach the compiled step (smddp_lite.compile) through their own extension point
COMPILED_STEP = ("lightning_fit",)
# examples of their own that reach it (test_the_trainer_reaches_the_compiled_step_...)
COMPILED_STEP_EXAMPLES = ("hf_trainer_compiled_step",)


@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("example", COMPILED_STEP)
def test_framework_reaches_the_compiled_step_with_ddps_results_on_gloo(tmp_path, example, accumulate):
    """Lightning's strategy=CompiledStepStrategy(), also accumulating 2 batches per step (the
    compiled model's no_sync): the losses DDP gives, step for step (two ranks: each sum has two
    terms, the same float in either order), and weights within the fused AdamW's rounding (torch's
    fused CPU kernel, the same arithmetic in another order). Accumulating, against DDP on "smddp",
    which gives gloo's results (the test above)."""
    if importlib.util.find_spec(EXAMPLES[example]) is None:
        pytest.skip(f"{EXAMPLES[example]} is not installed (pip install -e '.[test]' installs it)")
    more = ("--accumulate", str(accumulate)) if accumulate > 1 else ()
    ours = _run(example, "smddp", tmp_path / "compiled_step.json", more=(*more, "--compiled-step"))
    reference = _on_gloo(example, False, tmp_path) if not more else _run(example, "smddp", tmp_path / "ddp.json",
                                                                          more=more)
    _assert_same_losses_close_weights(ours, reference)


def test_the_trainer_reaches_the_compiled_step_with_ddps_results_on_gloo(tmp_path):
    """transformers' Trainer with CompiledStepTrainer (create_optimizer compiles): hf_trainer.py's
    run on gloo, step for step."""
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers is not installed (pip install -e '.[test]' installs it)")
    ours = _run("hf_trainer_compiled_step", "smddp", tmp_path / "compiled_step.json")
    _assert_same_losses_close_weights(ours, _on_gloo("hf_trainer", False, tmp_path))


def _assert_same_losses_close_weights(ours: dict, reference: dict) -> None:
    assert ours["world_size"] == reference["world_size"] == 2
    assert len(ours["losses"]) == len(reference["losses"]) >= 6
    assert ours["losses"] == pytest.approx(reference["losses"], rel=1e-6), (ours["losses"], reference["losses"])
    assert ours["parameter_sums"] == pytest.approx(reference["parameter_sums"], rel=1e-5, abs=1e-6)
