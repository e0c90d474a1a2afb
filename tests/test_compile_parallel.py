"""smddp_lite.compile across 2 and 3 ranks ends where DDP + torch.optim ends."""

from __future__ import annotations

import pytest
import torch

from . import harness, tiers


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("wire, clip, on_completion", [(None, None, False), (None, 0.5, False),
                                                       ("bfloat16", 0.5, False), ("bfloat16", 0.5, True)],
                         ids=["float32", "float32-clip", "bfloat16-clip", "bfloat16-clip-on-completion"])
def test_compiled_matches_ddp(world, wire, clip, on_completion):
    """``on_completion``: each bucket's copy back from the wire and norm run as its collective's
    future's callback (CUDA's way, forced on CPU tensors), not after backward."""
    results = harness.values(harness.launch("tests.compile_parallel_programs:compiled_parity", world, wire_dtype=wire,
                                            clip=clip,
                                            finish_on_completion=on_completion))
    for rank, r in enumerate(results):
        assert r["buckets"] > 1 and r["arenas"] == 1, r
        if wire is None:
            # float32: the fused update orders its arithmetic differently from torch's AdamW (a few
            # ulps per step, as on one rank); with 3 ranks the average also differs (DDP divides
            # then sums, compile sums then divides), which AdamW's normalisation can amplify on
            # near-zero second moments over 10 steps.
            assert r["max_diff"] <= (1e-6 if world == 2 else 1e-5), (rank, r)
        else:
            # bfloat16 on the wire keeps 8 bits of mantissa: gradients differ by up to 2**-8
            # relative; AdamW's step size bounds the resulting parameter drift to ~lr per step
            assert r["max_diff"] < 10 * 3e-3, (rank, r)
    assert results[0]["losses"]["compiled"][-1] < results[0]["losses"]["compiled"][0]


@tiers.FULL_ONLY
@pytest.mark.parametrize("transport", ["gloo", "mpi"])
def test_a_16_bit_wire_matches_ddp_on_transports_that_sum_in_float32_themselves_not(transport):
    """gloo and MPI cannot sum 16-bit floats in float32: the buckets' 16-bit pieces are
    exchanged and summed in float32 where they land (buckets of 256 KiB, 128 KiB on the wire)."""
    env = {"SMDDP_TRANSPORT": transport}
    args = dict(wire_dtype="bfloat16", clip=0.5, width=2048, bucket_cap_mb=0.25)
    if transport == "mpi":
        harness.skip_without_mpiexec()
        results = harness.values(harness.launch_mpi("tests.compile_parallel_programs:compiled_parity", 2, env=env,
                                                    **args))
    else:
        results = harness.values(harness.launch("tests.compile_parallel_programs:compiled_parity", 2, env=env, **args))
    for rank, r in enumerate(results):
        assert r["buckets"] > 1, r
        assert r["max_diff"] < 10 * 3e-3, (rank, r)  # as test_compiled_matches_ddp's bfloat16 wire
    assert results[0]["losses"]["compiled"][-1] < results[0]["losses"]["compiled"][0]


@pytest.mark.parametrize("transport, world", [("gloo", 2), ("gloo", 3), ("mpi", 2)])
def test_large_16_bit_sums_in_rounds_of_pieces_are_exact(transport, world):
    env = {"SMDDP_TRANSPORT": transport}
    if transport == "mpi":
        harness.skip_without_mpiexec()
        results = harness.values(harness.launch_mpi("tests.compile_parallel_programs:large_16_bit_sums", world,
                                                    env=env))
    else:
        results = harness.values(harness.launch("tests.compile_parallel_programs:large_16_bit_sums", world, env=env))
    assert results == [{"wrong": []}] * world, results


@tiers.FULL_ONLY
@pytest.mark.parametrize("transport", ["gloo", "mpi"])
@pytest.mark.parametrize("wire", ["bfloat16", "float16"])
def test_a_16_bit_wire_sends_half_the_bytes_of_float32(transport, wire):
    """Counted, not assumed: on gloo, the bytes the host's loopback carried per step (both ranks'
    sockets); on gloo and MPI, every buffer the step hands the transport. A float32 wire hands
    one float32 all_reduce per bucket; a 16-bit one, per bucket, an all_to_all of its 16-bit
    pieces and an all_gather of this rank's rounded share: each rank sends (w - 1) / w of the
    bucket in each, half of what the float32 ring all_reduce sends. The collective check's small
    int64 all_gather per call is left out (SMDDP_CHECK_COLLECTIVES=0): it is the same for both
    wires, and this counts the gradients' bytes."""
    env = {"SMDDP_TRANSPORT": transport, "SMDDP_CHECK_COLLECTIVES": "0"}
    launch = harness.launch
    if transport == "mpi":
        harness.skip_without_mpiexec()
        launch = harness.launch_mpi
    program = "tests.compile_parallel_programs:compiled_wire_bytes"
    run = lambda w: harness.values(launch(program, 2, env=env, wire_dtype=w))  # noqa: E731
    wide, narrow = run(None)[0], run(wire)[0]
    grads = wide["gradient_bytes"]
    assert {dtype for _, dtype, _ in wide["handed"]} == {"float32"}, wide["handed"]
    assert sum(n for op, _, n in wide["handed"] if op == "all_reduce") == grads, wide["handed"]
    assert {dtype for _, dtype, _ in narrow["handed"]} == {wire}, narrow["handed"]
    pieces = sum(n for op, _, n in narrow["handed"] if op == "all_to_all")
    shares = sum(n for op, _, n in narrow["handed"] if op == "all_gather")
    assert grads // 2 <= pieces < grads // 2 + 64 and 2 * shares == pieces, narrow["handed"]
    if transport == "gloo":  # MPICH moves one host's bytes through shared memory, not sockets
        ratio = narrow["loopback_per_step"] / wide["loopback_per_step"]
        assert 0.45 <= ratio <= 0.55, (ratio, wide["loopback_per_step"], narrow["loopback_per_step"])


@tiers.FULL_ONLY
def test_compile_starts_every_rank_from_rank_0s_weights_frozen_ones_included():
    results = harness.values(harness.launch("tests.compile_parallel_programs:compiled_frozen_start", 2))
    assert results[1] == results[0]


@tiers.FULL_ONLY
def test_every_rank_ends_with_rank_0s_batchnorm_statistics_as_under_ddp():
    """DDP broadcasts rank 0's buffers before each training forward; compile did so only once, so
    each rank's running statistics drifted with its own batches and evaluation differed by rank."""
    ranks = harness.values(harness.launch("tests.compile_parallel_programs:compiled_batchnorm_buffers", 2))
    for rank, r in enumerate(ranks):
        assert r["compiled"]["buffers"] == r["eager"]["buffers"] == ranks[0]["eager"]["buffers"], rank
        torch.testing.assert_close(torch.tensor(r["compiled"]["eval"]), torch.tensor(ranks[0]["eager"]["eval"]))
    # off, as DDP's broadcast_buffers=False: each rank keeps its own statistics
    own = harness.values(harness.launch("tests.compile_parallel_programs:compiled_batchnorm_buffers", 2,
                                        broadcast_buffers=False))
    assert own[0]["compiled"]["buffers"] != own[1]["compiled"]["buffers"]


# what the last rank changes, and what every rank must be told. Before compile compared them,
# on gloo: a wider layer or a frozen bias aborted a rank in gloo at the first backward, and a
# rank alone clipping gradients or rounding them to bfloat16 trained on silently, its parameters
# apart from the other rank's after 5 steps (clipping: on shm too); so would one alone with
# another learning rate
COMPILED_APART = {
    "model": "trainable parameters: 4 tensors of 2501 elements on rank 0, 4 tensors of 2540 elements on rank 1",
    "frozen": "frozen parameters and buffers (broadcast from rank 0): 0 tensors of 0 elements on rank 0, 1 tensor "
              "of 64 elements on rank 1",
    "bucket": "buckets (bucket_cap_mb, first_bucket_mb; SMDDP_BUCKET_CAP_MB, SMDDP_FIRST_BUCKET_MB): 1 bucket",
    "wire": "wire_dtype (SMDDP_WIRE_DTYPE): unset on rank 0, bfloat16 on rank 1",
    "clip": "max_grad_norm (SMDDP_MAX_GRAD_NORM): None on rank 0, 0.01 on rank 1",
    "buffers": "broadcast_buffers (SMDDP_BROADCAST_BUFFERS): True on rank 0, False on rank 1",
    "shard": "shard_optimizer_state (SMDDP_SHARD_OPTIMIZER_STATE): False on rank 0, True on rank 1",
    "lr": "optimizer settings: group 0: lr=0.001, betas=(0.9, 0.999), eps=1e-08, weight_decay=0.01 on rank 0, "
          "group 0: lr=0.002, betas=(0.9, 0.999), eps=1e-08, weight_decay=0.01 on rank 1. Give the optimizer the "
          "same settings on every rank",
}


@tiers.FULL_ONLY
@pytest.mark.parametrize("kind", sorted(COMPILED_APART))
def test_ranks_compiling_different_models_or_options_are_told_on_every_rank(kind):
    ranks = harness.values(harness.launch("tests.compile_parallel_programs:compiled_apart", 2,
                                          env={"SMDDP_TRANSPORT": "gloo"},
                                          kind=kind))
    for rank, report in enumerate(ranks):
        error = report["compile"]
        assert error["type"] == "ValueError", (rank, report)
        assert error["message"].startswith(f"smddp_lite.compile (rank {rank}/2): the ranks compiled different"), error
        assert COMPILED_APART[kind] in error["message"], error
        assert "Nothing was compiled" in error["message"], error


def test_ranks_compiling_the_same_model_and_options_train():
    ranks = harness.values(harness.launch("tests.compile_parallel_programs:compiled_apart", 2, kind="same"))
    for report in ranks:
        assert report["compile"]["type"] is None and report["train"]["type"] is None, report
        assert report["params"] == ranks[0]["params"], ranks
