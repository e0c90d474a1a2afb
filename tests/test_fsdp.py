"""FSDP2 (fully_shard) on the smddp backend against the same model on gloo, side by side in one job,
and torch's functional collectives, which FSDP2's DTensors and compiled code call.

FSDP is the user of all_gather_into_tensor and reduce_scatter_tensor: it gathers each layer's
parameters before use and reduce-scatters its gradients. The smddp model takes fully_shard's
default mesh, built from the default group, which is how a user's script gets one.
"""

from __future__ import annotations

import pytest

from . import harness, tiers

HIER = {"SMDDP_ALGORITHM": "hierarchical", "SMDDP_HIERARCHICAL_CHUNK_BYTES": "4096"}  # several pieces per call


@pytest.mark.parametrize("layout, param_dtype, tolerance", [
    # two ranks on shared memory: a + b == b + a, so both backends agree bit for bit
    ("one-host", None, 0.0),
    ("one-host", "bfloat16", 0.0),
    # 2 simulated hosts x 2 ranks, hierarchical: four addends summed in another order than gloo's
    # ring, a float32 ulp or so
    ("two-hosts", None, 1e-6),
    # bfloat16 gradients: gloo adds them in bfloat16 hop by hop, smddp in float32 with each host's
    # sum rounded once; measured 2.4e-4 apart after 6 steps, under one bfloat16 ulp of the largest
    # parameter (0.18: 2**-10)
    ("two-hosts", "bfloat16", 2.0**-10),
])
def test_fully_shard_trains_as_on_gloo(layout, param_dtype, tolerance):
    world, env, hosts_of = (2, {}, 0) if layout == "one-host" else (4, HIER, 2)
    results = harness.values(harness.launch("tests.fsdp_programs:fsdp_parity", world, env=env, hosts_of=hosts_of,
                                            param_dtype=param_dtype))
    for rank, result in enumerate(results):
        assert result["max_diff"] <= tolerance, (rank, result)


@tiers.FULL_ONLY
@pytest.mark.parametrize("param_dtype", [None, "bfloat16"])
def test_gradient_divide_factor_trains_as_on_gloo(param_dtype):
    """``set_gradient_divide_factor`` makes FSDP2 reduce-scatter with PREMUL_SUM(1 / factor), which
    gloo refuses; smddp runs it, and trains as gloo's average times world size / factor does. The
    factor is a power of two, so both round alike: bit for bit."""
    results = harness.values(harness.launch("tests.fsdp_programs:fsdp_parity", 2, param_dtype=param_dtype,
                                            divide_factor=8.0))
    for rank, result in enumerate(results):
        assert result["max_diff"] == 0.0, (rank, result)


@tiers.FULL_ONLY
@pytest.mark.parametrize("param_dtype, tolerance", [(None, 1e-6), ("bfloat16", 2.0**-10)])
def test_hybrid_sharding_across_hosts_trains_as_on_gloo(param_dtype, tolerance):
    """HSDP on 2 simulated hosts x 2 ranks: each host's ranks shard (a subgroup on shared memory,
    reduce_scatter AVG), the hosts replicate (two subgroups of one rank per host, all_reduce AVG,
    hierarchical: bfloat16 crosses as it is, divided before its last rounding)."""
    results = harness.values(harness.launch("tests.fsdp_programs:hsdp_parity", 4,
                                            env={"SMDDP_ALGORITHM": "hierarchical"},
                                            hosts_of=2, param_dtype=param_dtype))
    for rank, result in enumerate(results):
        assert result["max_diff"] <= tolerance, (rank, result)


@tiers.FULL_ONLY
def test_functional_collectives_find_the_group_by_its_name():
    # DTensor (FSDP2's parameters), tensor parallelism and compiled code call these; before the
    # group kept its name, each raised "ProcessGroup name not set"
    world = 3
    results = harness.values(harness.launch("tests.fsdp_programs:functional_collectives", world))
    for rank, result in enumerate(results):
        assert result["all_reduce"] == [6.0] * 4
        assert result["all_gather"] == [0.0, 0.0, 1.0, 1.0, 2.0, 2.0]
        assert result["reduce_scatter"] == [2.0 * rank * world, (2.0 * rank + 1) * world]
        assert result["group_name"] == results[0]["group_name"] != ""


@tiers.FULL_ONLY
def test_checkpoint_code_that_asks_the_group_for_its_devices_works(tmp_path):
    """Loading a full checkpoint into FSDP2 from rank 0 (broadcast_from_rank0), DCP's async_save,
    and FSDP1's optimizer state dict ask the group which devices it serves; "smddp" answered
    none, and each failed."""
    ranks = harness.values(harness.launch("tests.fsdp_programs:checkpoint_paths", 2, directory=str(tmp_path / "ckpt")))
    for rank, report in enumerate(ranks):
        assert report == {"loaded_rank_0s": True, "async_saved": True, "default_device": "cpu",
                          "object_device": "cpu"}, (rank, report)
