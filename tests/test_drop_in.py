"""Calls that torch's own backends accept are accepted by smddp, with their results."""

from __future__ import annotations

import pytest

from . import harness

TRANSPORTS = {
    "shm": {"SMDDP_TRANSPORT": "shm"},
    "gloo": {"SMDDP_TRANSPORT": "gloo"},
    "hierarchical": {"SMDDP_ALGORITHM": "hierarchical"},
}


@pytest.mark.parametrize("transport", [*TRANSPORTS, "mpi"])
def test_integer_averages_truncate_as_nccl_does(transport):
    """A training framework's DDP strategy averages an int64 counter with ReduceOp.AVG at its
    first metric sync; torch's nccl computes the sum divided by the group's size, truncated."""
    if transport == "mpi":
        harness.skip_without_mpiexec()
        results = harness.launch_mpi("tests.programs:integer_averages", 3, env={"SMDDP_TRANSPORT": "mpi"})
    else:
        world, layout = (4, {"hosts_of": 2}) if transport == "hierarchical" else (3, {})  # 2 hosts x 2 ranks
        results = harness.launch("tests.programs:integer_averages", world, env=TRANSPORTS[transport], **layout)
    assert all(r == {"wrong": []} for r in harness.values(results)), harness.values(results)


def test_all_gather_coalesced_lays_out_outputs_as_gloo_does():
    """Output lists indexed by rank, then by input; 3 ranks and 2 inputs were refused before
    ("expected 3 output tensors (one per rank), found 1")."""
    ours = harness.values(harness.launch("tests.programs:all_gather_coalesced_layout", 3))
    reference = harness.values(harness.launch("tests.programs:all_gather_coalesced_layout", 3, backend="gloo"))
    for rank, (mine, theirs) in enumerate(zip(ours, reference)):
        assert mine["outputs"] == theirs["outputs"], (rank, mine["outputs"], theirs["outputs"])
        assert mine["outputs"][2][1] == [20.0, 21.0, 22.0, 23.0], mine
        error = mine["wrong_count"]
        assert error["type"] == "ValueError" and "expected 3 output lists" in error["message"], error


def test_compile_and_its_steps_raise_no_warning_from_this_project():
    """compile's agreement check used torch's deprecated all_gather_into_tensor, which printed a
    FutureWarning on every rank."""
    import os

    root = os.fspath(harness.ROOT)
    for report in harness.values(harness.launch("tests.programs:warnings_of_compile", 2)):
        ours = [w for w in report["warnings"] if w.startswith(root) and "/tests/" not in w]
        assert ours == [], ours
