"""smddp_lite.compile(..., shard_optimizer_state=True): each rank keeps and updates only its share
of every bucket, and training ends where DDP + torch.optim ends."""

from __future__ import annotations

import pytest

from smddp_lite.config import compile_config

from . import harness, tiers

PROGRAMS = "tests.sharded_programs"


def _values(world: int, program: str, env: dict | None = None, launcher: str = "env", **kwargs) -> list:
    if launcher == "mpi":
        harness.skip_without_mpiexec()
        return harness.values(harness.launch_mpi(f"{PROGRAMS}:{program}", world, env=env, **kwargs))
    return harness.values(harness.launch(f"{PROGRAMS}:{program}", world, env=env, **kwargs))


def _assert_parity(results: list, bound: float) -> None:
    for rank, r in enumerate(results):
        assert r["replicas_differ"] == 0.0, (rank, r)  # every rank ends with the same parameters
        assert r["max_diff"] <= bound, (rank, r)
        assert r["scales"]["compiled"] == r["scales"]["eager"], (rank, r)  # GradScaler skipped alike
    assert results[0]["losses"]["compiled"][-1] < results[0]["losses"]["compiled"][0]


# float32: the fused update orders its arithmetic differently from torch's (a few ulps a step),
# and with 3 ranks the average differs too (DDP divides then sums), as in test_compiled_matches_ddp
CASES = [
    pytest.param(2, dict(family="adamw", clip=0.5, scaler=True), 1e-6, id="w2-adamw-clip-gradscaler"),
    pytest.param(2, dict(family="sgd", frozen=True), 1e-6, id="w2-sgd-nesterov-frozen"),
    # bfloat16 keeps 8 bits of mantissa: AdamW's step size bounds the drift to ~lr a step
    pytest.param(2, dict(family="adamw", clip=0.5, wire_dtype="bfloat16"), 0.03, id="w2-adamw-bfloat16-wire"),
    pytest.param(3, dict(family="adamw", clip=0.5, scaler=True), 1e-5, id="w3-adamw-clip-gradscaler"),
    pytest.param(3, dict(family="adam", no_sync_every=2), 1e-5, id="w3-adam-no-sync"),
    pytest.param(3, dict(family="sgd", frozen=True, wire_dtype="float16"), 1e-3, id="w3-sgd-frozen-float16-wire"),
]


@pytest.mark.parametrize("world, options, bound", CASES)
def test_sharded_step_matches_ddp(world, options, bound):
    """Buckets of 5, 335, 67 and 2345 elements (none divisible by 2 or 3), a OneCycleLR schedule;
    with GradScaler, one element of rank 1's gradient is infinite at step 3, and both runs must skip it and
    back their scales off alike on every rank."""
    _assert_parity(_values(world, "parity", **options), bound)


@pytest.mark.parametrize("transport, world, layout, launcher", [
    ("gloo", 3, {}, "env"),
    ("mpi", 2, {}, "mpi"),
    ("hierarchical", 4, {"hosts_of": 2}, "env"),
])
@tiers.FULL_ONLY
def test_sharded_step_matches_ddp_on_every_cpu_transport(transport, world, layout, launcher):
    env = {"SMDDP_ALGORITHM": "hierarchical"} if transport == "hierarchical" else {"SMDDP_TRANSPORT": transport}
    _assert_parity(_values(world, "parity", env=env, launcher=launcher, family="adamw", clip=0.5, scaler=True,
                           **layout), 1e-5)


@tiers.FULL_ONLY
def test_each_rank_holds_a_third_of_the_optimizer_state_at_3_ranks():
    """AdamW's moments on a model of 41,005 parameters in buckets of 5,005 (padded to 5,007) and 36,000;
    unsharded, both buckets lie in one arena, the second starting at a multiple of 128 elements."""
    for rank, s in enumerate(_values(3, "state_sizes", width=1000)):
        assert s["torch"] == 2 * 4 * 41_005, s
        assert s["unsharded"] == s["torch"] + s["alignment"] and 0 < s["alignment"] < 2 * 4 * 128, s
        assert s["padding_bytes_per_bucket"] > 0, s
        assert s["torch"] / 3 <= s["sharded"] <= s["torch"] / 3 + s["padding_bytes_per_bucket"], (rank, s)


@tiers.FULL_ONLY
def test_checkpoints_move_between_sharded_unsharded_and_torch_and_across_world_sizes(tmp_path):
    """state_dict() is torch.optim's full format on every rank; it loads into AdamW (under DDP)
    and an unsharded compiled step, theirs into a sharded one, and a 2-rank checkpoint resumes
    at 3 ranks as DDP + AdamW resumes it."""
    for rank, r in enumerate(_values(2, "checkpoint_round_trips", directory=str(tmp_path))):
        assert r["problems"] == [], (rank, r)
        for direction, diff in r["diffs"].items():
            assert diff <= 1e-6, (rank, direction, r)
    for rank, r in enumerate(_values(3, "resume_elsewhere", directory=str(tmp_path))):
        assert r["max_diff"] <= 1e-5, (rank, r)


@tiers.FULL_ONLY
def test_torch_distributed_checkpoint_saves_and_resumes_a_sharded_step(tmp_path):
    for rank, r in enumerate(_values(2, "distributed_checkpoint", directory=str(tmp_path / "dcp"))):
        assert r["max_diff"] == 0.0, (rank, r)


@tiers.FULL_ONLY
def test_compiling_again_after_unfreezing_carries_the_sharded_state_over():
    for rank, r in enumerate(_values(2, "compile_again_after_unfreezing")):
        assert r["max_diff"] <= 1e-6, (rank, r)


def test_the_option_comes_from_the_environment_and_is_checked():
    assert compile_config({}, {"SMDDP_SHARD_OPTIMIZER_STATE": "1"}).shard_optimizer_state is True
    assert compile_config({"shard_optimizer_state": False}, {"SMDDP_SHARD_OPTIMIZER_STATE": "1"}).shard_optimizer_state is False
    with pytest.raises(ValueError, match=r"SMDDP_SHARD_OPTIMIZER_STATE='maybe' is not a boolean; use 1/0"):
        compile_config({}, {"SMDDP_SHARD_OPTIMIZER_STATE": "maybe"})


@tiers.FULL_ONLY
def test_a_forward_waits_for_the_gathers_of_its_own_parameters_only():
    """The gathers of updated shares overlap the next forward: on a GPU they run on the
    communication stream, so a layer must wait for its own buckets before it reads them."""
    for seen in _values(2, "what_waits_for_the_gathers"):
        assert seen["after step"] == [0, 1, 2, 3], seen
        assert seen["last layer's buckets"] == [0, 1], seen
        assert seen["after the last layer's forward"] == [2, 3], seen
        assert seen["after state_dict"] == [], seen


@tiers.FULL_ONLY
def test_a_state_dict_called_on_one_rank_only_is_told_not_waited_out():
    ranks = _values(2, "state_dict_on_one_rank")
    assert ranks[1]["error"] is None
    message = ranks[0]["error"]
    assert message is not None and message.startswith("smddp_lite (rank 0/2): optimizer.state_dict() is a collective"), message
    assert "rank(s) [1] did not call it within 2 s" in message and "state = optimizer.state_dict()" in message, message


def test_an_optimizer_the_fused_step_does_not_support_is_refused_by_name():
    import torch

    import smddp_lite

    model = torch.nn.Linear(4, 2)
    with pytest.raises(ValueError, match=r"torch\.optim\.rmsprop\.RMSprop is not supported; supported: "
                                         r"torch\.optim\.AdamW, torch\.optim\.Adam, torch\.optim\.SGD"):
        smddp_lite.compile(model, torch.optim.RMSprop(model.parameters()), shard_optimizer_state=True)


@tiers.FULL_ONLY
def test_the_sharded_step_benchmark_runs_and_its_variants_train_alike():
    """The CPU smoke run of benchmarks/sharded_step.py: the five variants train the same model on
    the same batches, so they end together; the sharded one holds half the state at 2 ranks."""
    import json
    import subprocess
    import sys

    root = harness.ROOT
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "benchmarks/sharded_step.py", "--width", "96", "--steps", "2", "--warmup", "1",
                           "--block", "1"], cwd=root, check=True, timeout=180, capture_output=True, text=True)
    report = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("{")))
    variants = report["variants"]
    assert set(variants) == {"ddp", "zero-default", "zero", "compiled", "sharded"}
    for name, v in variants.items():
        assert v["max_param_diff_vs_compiled"] <= 1e-6, (name, v)
        assert v["optimizer_step_ms"] > 0 and v["train_step_ms"] > 0, (name, v)
    assert variants["sharded"]["state_bytes_per_rank_max"] < 0.51 * variants["compiled"]["state_bytes_per_rank_max"]
