"""Small CPU all_reduces on the caller's thread (backend/fast_cpu.py): the general route's
results, pairing, errors and records, in a fraction of its time."""

from __future__ import annotations

import pytest

from . import harness, tiers

SHM = {"SMDDP_TRANSPORT": "shm"}


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=tiers.QUICK)])
def test_the_fast_path_gives_the_general_routes_bits_without_warnings(world):
    results = harness.values(harness.launch("tests.fast_cpu_programs:same_bits_as_the_general_route", world,
                                            env=SHM, numels=[1, 5, 4096]))
    for r in results:
        assert r == {"wrong": [], "fast": 1, "warnings": []}, r


def test_a_fast_call_pairs_with_a_peers_call_on_the_general_route():
    results = harness.values(harness.launch("tests.fast_cpu_programs:pairs_with_a_peer_on_the_general_route", 2,
                                            env=SHM))
    assert results == [{"sum": [3.0] * 4, "broadcast": [0.0] * 4, "gathered": [1.0, 1.0, 2.0, 2.0],
                        "later": [2.0] * 3}] * 2, results


def test_a_mismatch_on_the_fast_path_is_named_on_every_rank_as_on_the_general_route():
    fast = harness.values(harness.launch("tests.fast_cpu_programs:mismatch_is_named", 2, env=SHM))
    general = harness.values(harness.launch("tests.fast_cpu_programs:mismatch_on_the_general_route", 2, env=SHM))
    for mine, theirs in zip(fast, general):
        error = mine["error"]
        assert error["type"] == "CollectiveMismatchError" and error["backend_error"], error
        assert "rank 0: all_reduce(numel=2" in error["message"] and "rank 1: all_reduce(numel=4" in error["message"]
        assert (error["message"], mine["after"]["message"]) == (theirs["error"]["message"], theirs["after"]["message"])


def test_the_flight_recorder_holds_fast_calls():
    results = harness.values(harness.launch("tests.fast_cpu_programs:recorded", 2, env=SHM))
    for r in results:
        assert r == {"name": "gloo:all_reduce", "sizes": [[[3], "torch.float32"]], "started": True, "completed": True, "fast": 1}, r


def test_a_fast_barrier_waits_for_the_late_rank_and_keeps_calls_paired():
    results = harness.values(harness.launch("tests.fast_cpu_programs:barriers_pair_across_routes", 2, env=SHM))
    assert all(r["fast"] and r["sum"] == [2.0] * 4 for r in results), results
    assert results[0]["waited"] > 0.2, results


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=tiers.FULL_ONLY)])
def test_broadcast_and_all_gather_move_every_dtype_as_the_general_route(world):
    results = harness.values(harness.launch("tests.fast_cpu_programs:moves_as_the_general_route", world, env=SHM))
    for r in results:
        assert r == {"wrong": [], "fast": [True, True]}, r
