"""send / recv (backend/p2p.py): real ranks on every transport, against the values they sent."""

from __future__ import annotations

import pytest

from . import harness, tiers

LAUNCHES = {  # name: (ranks, launch arguments)
    "shm-2": (2, {"env": {"SMDDP_TRANSPORT": "shm"}}),
    "shm-3": (3, {"env": {"SMDDP_TRANSPORT": "shm"}}),  # a ring of three: links made concurrently
    "gloo-4": (4, {"env": {"SMDDP_TRANSPORT": "gloo"}}),
    "hierarchical-2x2": (4, {"env": {"SMDDP_ALGORITHM": "hierarchical"}, "hosts_of": 2}),
}


@pytest.mark.parametrize("name", sorted(LAUNCHES))
def test_send_recv_deliver_in_order_by_tag(name):
    ranks, kwargs = LAUNCHES[name]
    results = harness.launch("tests.p2p_programs:point_to_point", ranks, timeout=180, **kwargs)
    for rank, problems in enumerate(harness.values(results)):
        assert problems == {}, f"rank {rank}: {problems}"


@tiers.FULL_ONLY
@pytest.mark.mpi
def test_send_recv_under_mpiexec():
    harness.skip_without_mpiexec()
    results = harness.launch_mpi("tests.p2p_programs:point_to_point", 3, env={"SMDDP_TRANSPORT": "mpi"}, timeout=180)
    for rank, problems in enumerate(harness.values(results)):
        assert problems == {}, f"rank {rank}: {problems}"


EXPECTED = {
    "outside": ["peer rank 5", "0..1"],
    "tag": ["tag -2", "from 0 to 2**31 - 1"],
    "big_tag": ["tag 1099511627776", "from 0 to 2**31 - 1"],
    "recv_expanded": ["cannot receive into a tensor whose elements share memory", "expand"],
    "any_source": ["any source", "src="],
    "never_sent": ["from rank", "tag 9", "3 s"],
    "after_timeout": ["tag 10", "failed earlier", "cannot be used again"],
}


def test_bad_peers_raise_and_a_missing_sender_times_out():
    """(A blocking send to this very rank torch refuses itself, before the backend sees it.)"""
    reports = harness.values(harness.launch("tests.p2p_programs:point_to_point_errors", 2, timeout=120))
    for rank, report in enumerate(reports):
        for case, words in EXPECTED.items():
            error = report[case]
            assert error["type"] is not None, f"rank {rank} {case}: nothing raised"
            for word in words:
                assert word in error["message"], f"rank {rank} {case}: {word!r} not in {error['message']!r}"
            assert f"rank {rank}/2" in error["message"], error["message"]
        assert 2.5 < report["never_sent"]["seconds"] < 15, report["never_sent"]
        assert report["after_timeout"]["seconds"] < 1, report["after_timeout"]
        assert report["never_sent"]["backend_error"], "a timed-out recv must be a DistBackendError"
        assert report["usable_after"]
        assert report["negative_view_received"] == [-2.0], report


def test_a_recv_that_timed_out_before_the_link_existed_is_not_carried_out_later():
    reports = harness.values(harness.launch("tests.p2p_programs:recv_timed_out_before_the_link", 2, timeout=120))
    waiting = reports[1]
    assert waiting["wait"]["type"] == "PeerFailureError", waiting
    assert waiting["wait_seconds"] < 3, waiting  # get_future's watcher waits for 8 s; this wait, 1 s
    assert waiting["first_after"] == [0.0, 0.0, 0.0], waiting
    assert waiting["retry"]["backend_error"] and "cannot be used again" in waiting["retry"]["message"], waiting
    assert reports[0]["send"]["backend_error"], reports[0]


@tiers.FULL_ONLY
def test_pipeline_schedules_match_gloo():
    """torch.distributed.pipelining's GPipe and 1F1B schedules, one stage per rank on 3 ranks,
    move activations and gradients with send/recv: on smddp they must give gloo's losses and
    gradients exactly (the same messages; no arithmetic in the backend)."""
    reports = harness.values(harness.launch("tests.p2p_programs:pipeline_parity", 3, timeout=180))
    for rank, report in enumerate(reports):
        for schedule, r in report.items():
            assert r["same_losses"] and r["same_grads"], (rank, schedule, r)
            assert r["grad_norm"] > 0, (rank, schedule, r)
            assert len(r["losses"]) == (4 if rank == 2 else 0), (rank, schedule, r)
