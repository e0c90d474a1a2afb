"""DistributedDataParallel runs unchanged on "smddp" and ends where it ends on "gloo"."""

from __future__ import annotations

import pytest

from . import harness, tiers


@pytest.mark.parametrize("world", [2, 3])
def test_ddp_matches_gloo(world):
    results = harness.values(harness.launch("tests.ddp_programs:ddp_parity", world, steps=12))
    for rank, result in enumerate(results):
        if world == 2:
            # a + b == b + a in IEEE arithmetic and both backends round a float16 sum once:
            # two ranks must agree bit for bit, with and without the fp16 compression hook
            assert result["plain"] == 0.0 and result["fp16_hook"] == 0.0, (rank, result)
        else:
            # three addends may be summed in another order by gloo's ring: a few float32 ulps
            assert result["plain"] < 1e-6, (rank, result)
            # gloo adds float16 in float16 hop by hop (two roundings); smddp sums in float32 and
            # rounds once: up to one float16 ulp (~1e-3 relative) apart per step, over 12 steps
            assert result["fp16_hook"] < 5e-3, (rank, result)
    losses = results[0]["losses"]
    assert losses[-1] < losses[0], losses


@tiers.FULL_ONLY
@pytest.mark.parametrize("divide", [True, False], ids=["initial-world-size", "ranks-left"])
@pytest.mark.parametrize("transport", ["shm", "gloo"])
def test_ddp_join_trains_ranks_with_uneven_inputs_to_the_same_end(transport, divide):
    """SMDDP's users met hangs with uneven last batches. Under DDP's join(), ranks that run out
    of batches shadow the others' all_reduces; each rank has a different number of batches here,
    and every rank must finish, agree, and end where gloo ends (without join() they would wait
    for each other until the timeout). With divide_by_initial_world_size=False, DDP hands the
    forward pass's all_reduce Work to its C++ reducer and drops it: that hung on shm and failed
    on gloo ("getFuture not implemented") once Python had freed the Work."""
    results = harness.values(harness.launch("tests.ddp_programs:ddp_uneven_inputs", 3, timeout=200,
                                            env={"SMDDP_TRANSPORT": transport},
                                            divide_by_initial_world_size=divide))
    for rank, result in enumerate(results):
        assert result["ranks_agree"], (rank, result)
        assert result["max_diff"] < 1e-6, (rank, result)  # three addends: gloo's ring may add in another order
