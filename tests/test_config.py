"""SMDDP_* environment variables: parsed in one place, typos and bad values refused by name."""

from __future__ import annotations

import pytest
import torch

from smddp_lite.config import BackendConfig, backend_config

from . import harness


def test_defaults_and_overrides():
    assert backend_config({}) == BackendConfig()
    cfg = backend_config({"SMDDP_TRANSPORT": "Gloo", "SMDDP_DEBUG": "on", "SMDDP_SHM_CHUNK_BYTES": "0x10000"})
    assert (cfg.transport, cfg.debug, cfg.shm_chunk_bytes) == ("gloo", True, 65536)
    assert cfg.checks_collectives


def test_unknown_variable_is_named_with_the_known_ones():
    with pytest.raises(ValueError, match="SMDDP_TRANSPRT.*SMDDP_TRANSPORT"):
        backend_config({"SMDDP_TRANSPRT": "gloo"})


@pytest.mark.parametrize("env, words", [
    ({"SMDDP_TRANSPORT": "nccl2"}, "expected one of auto, shm, gloo, mpi"),
    ({"SMDDP_DEBUG": "maybe"}, "not a boolean"),
    ({"SMDDP_SHM_CHUNK_BYTES": "100"}, "multiple of 64"),
    ({"SMDDP_SHM_CHUNK_BYTES": "lots"}, "not an integer"),
    ({"SMDDP_INTER_NODE_ACCUMULATE": "bf16"}, "expected one of float32, wire"),
    ({"SMDDP_SCRATCH_MAX_BYTES": "-1"}, "must be 0"),
])
def test_bad_values_say_what_is_expected(env, words):
    with pytest.raises(ValueError, match=words):
        backend_config(env)


def test_the_containers_variables_reach_every_rank_without_stopping_the_backend():
    """docs/docker.md names SMDDP_STOP_GRACE_S and SMDDP_MPI_DONE_WAIT_S, which the container's
    PID 1 reads; on SageMaker an estimator's environment= sets them for every rank too, where
    init_process_group refused them as unknown and the whole job died."""
    env = {"SMDDP_STOP_GRACE_S": "5", "SMDDP_MPI_DONE_WAIT_S": "30"}
    assert backend_config(env) == BackendConfig()
    assert harness.values(harness.launch("tests.config_programs:sum_of_ranks", 2, env=env)) == [1, 1]
    with pytest.raises(ValueError, match="unknown environment variable SMDDP_STOP_GRACE; known: .*SMDDP_STOP_GRACE_S"):
        backend_config({"SMDDP_STOP_GRACE": "5"})


def test_aws_only_variables_warn_instead_of_failing():
    with pytest.warns(UserWarning, match="AWS SMDDP setting"):
        assert backend_config({"SMDDP_AG_SCRATCH_BUFFER_SIZE_BYTES": "1"}) == BackendConfig()


def test_sagemaker_import_path_registers_the_backend():
    import torch.distributed as dist

    import smddp_lite.torch_smddp  # noqa: F401

    assert "SMDDP" in dist.Backend._plugins
    assert dist.Backend._plugins["SMDDP"].creator_fn.__module__ == "smddp_lite.backend.process_group"


def test_scratch_keeps_buffers_up_to_its_bound_only():
    from smddp_lite.backend.scratch import Scratch

    scratch = Scratch(max_bytes=4096)
    small = scratch.get("wire", torch.float32, 1024)  # 4096 bytes: kept and handed out again
    assert scratch.get("wire", torch.float32, 512).data_ptr() == small.data_ptr()
    big = scratch.get("wire", torch.float32, 1025)  # beyond the bound: fresh, and not kept
    assert big.numel() == 1025 and scratch.kept_bytes() == 4096
    assert scratch.get("wire", torch.float32, 1025).data_ptr() != small.data_ptr()


@pytest.mark.parametrize("limit, keeps", [(None, True), ("1048576", False)])
def test_groups_keep_no_working_buffer_above_scratch_max_bytes(limit, keeps):
    """A group's float32 copies of a 4 MiB bfloat16 message (8 MiB each) stay with the group by
    default, and are not kept when SMDDP_SCRATCH_MAX_BYTES is below their size."""
    env = {"SMDDP_TRANSPORT": "gloo", **({"SMDDP_SCRATCH_MAX_BYTES": limit} if limit else {})}
    for report in harness.values(harness.launch("tests.config_programs:scratch_kept", 2, env=env)):
        assert report["right"], report
        assert (report["kept"] >= 8 << 20) if keeps else (report["kept"] == 0), report
