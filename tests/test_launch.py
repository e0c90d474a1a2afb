"""Every way a user starts a job: torchrun, explicit tcp:// and file://, and mpirun."""

from __future__ import annotations

import socket

import pytest

from . import harness, tiers


def _expect(results, world):
    values = harness.values(results)
    total = float(sum(range(1, world + 1)))
    for rank, v in enumerate(values):
        assert v["rank"] == rank and v["world"] == world and v["backend"] == "smddp", v
        assert v["sum"] == [total] * 4, v
    return values


def test_env_rendezvous_like_torchrun():
    _expect(harness.launch("tests.launch_programs:init_auto", 2), 2)


def test_tcp_init_method():
    with socket.socket() as s:  # a free port from the OS, released just before the job binds it
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    _expect(harness.launch("tests.launch_programs:init_explicit", 2, rendezvous=False, method="tcp", port=port), 2)


def test_file_init_method(tmp_path):
    _expect(harness.launch("tests.launch_programs:init_explicit", 3, rendezvous=False, method="file",
                           path=str(tmp_path / "rendezvous")), 3)


@pytest.mark.mpi
@pytest.mark.parametrize("world", [1, 2, 3])
def test_mpirun_without_rank_variables(world):
    harness.skip_without_mpiexec()
    values = _expect(harness.launch_mpi("tests.launch_programs:init_auto", world), world)
    assert [v["env_rank"] for v in values] == [str(r) for r in range(world)]


@tiers.FULL_ONLY
@pytest.mark.mpi
def test_mpi_subgroups_when_the_default_group_is_hierarchical():
    """mpirun over several hosts makes the default group hierarchical; a subgroup that takes MPI
    then failed ("the default smddp group must use MPI before a subgroup can"): it learns its
    members' MPI ranks through its own store now."""
    harness.skip_without_mpiexec()
    reports = harness.values(harness.launch_mpi("tests.launch_programs:mpi_subgroups_on_simulated_hosts", 4))
    for rank, report in enumerate(reports):
        assert report["default"] == "hierarchical", (rank, report)
        if rank in (0, 1):
            assert report["in_host"] == {"transport": "mpi", "sum": [3.0] * 3}, (rank, report)
        if rank in (1, 2, 3):
            assert report["across_hosts"] == {"transport": "mpi", "sum": [9.0] * 3}, (rank, report)


@tiers.FULL_ONLY
@pytest.mark.mpi
def test_mpi_rank_slow_to_leave_is_not_killed(tmp_path):
    """MPICH tells hydra that a rank finished in a C exit handler, not in MPI_Finalize; the test
    worker left by os._exit, so hydra took the first rank out for a crash and SIGKILLed the ones
    still leaving (CI: exit codes 0,9,0,9 after every rank had reported). A rank 1 s slower to
    leave than its peer must now get there."""
    harness.skip_without_mpiexec()
    mark = tmp_path / "rank1-left"
    results = harness.launch_mpi("tests.launch_programs:init_auto", 2,
                                 env={"TEST_LINGER_RANK": "1", "TEST_LINGER_S": "1", "TEST_LINGER_MARK": str(mark)})
    _expect(results, 2)
    assert mark.exists(), results[1].output


@pytest.mark.mpi
def test_mpi_all_reduce_larger_than_one_piece_is_exact():
    """The MPI transport splits an all_reduce above 16 MiB into pieces (MPICH is slow on larger
    ones); 2 pieces and a ragged tail must still give every element its exact sum."""
    harness.skip_without_mpiexec()
    numel = 2 * (16 << 20) // 4 + 1001
    results = harness.launch_mpi("tests.launch_programs:large_all_reduce", 2, numel=numel)
    assert harness.values(results) == [0, 0]
    assert "uses transport mpi" in results[0].output, results[0].output


MADE_AGAIN = {  # name: (ranks, launch arguments)
    "shm": (2, {"env": {"SMDDP_TRANSPORT": "shm"}}),
    "gloo": (3, {"env": {"SMDDP_TRANSPORT": "gloo"}}),
    "hierarchical-2x2": (4, {"env": {"SMDDP_ALGORITHM": "hierarchical"}, "hosts_of": 2}),
}


@pytest.mark.parametrize("name", sorted(MADE_AGAIN))
def test_group_destroyed_and_made_again_on_the_same_store(name):
    """destroy_process_group and init_process_group again, three times, on torchrun's agent
    store: the shm transport's second init opened the first one's segment name (the file was
    gone) before the group's keys were kept apart per incarnation."""
    ranks, kwargs = MADE_AGAIN[name]
    for rank, report in enumerate(harness.values(harness.launch("tests.launch_programs:made_again", ranks, timeout=180,
                                                                **kwargs))):
        assert report["got"] == report["want"], (rank, report)


@tiers.FULL_ONLY
@pytest.mark.mpi
def test_group_destroyed_and_made_again_under_mpiexec():
    harness.skip_without_mpiexec()
    results = harness.launch_mpi("tests.launch_programs:made_again", 2, env={"SMDDP_TRANSPORT": "mpi"}, timeout=180)
    for rank, report in enumerate(harness.values(results)):
        assert report["got"] == report["want"], (rank, report)


def test_subgroup_name_reused_for_a_group_of_another_size():
    results = harness.values(harness.launch("tests.launch_programs:subgroup_made_again", 4, timeout=120))
    for rank, report in enumerate(results):
        assert report["sums"] == [2.0 if rank < 2 else 1.0, 4.0], (rank, report)
