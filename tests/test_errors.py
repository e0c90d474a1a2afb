"""Bad input and failures: a clear error on every rank, in bounded time, never a hang."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from smddp_lite.backend.transports import refusals

from . import harness, tiers

# the behaviour with SMDDP_CHECK_COLLECTIVES=0: only the waits' comparison finds calls that differ
UNCHECKED = {"SMDDP_CHECK_COLLECTIVES": "0"}

TRANSPORT_ENVS = {
    "shm": {"SMDDP_TRANSPORT": "shm"},
    # gloo and MPI check signatures by default (one extra small all_gather per call)
    "gloo": {"SMDDP_TRANSPORT": "gloo"},
}

# what each bad input must say, in words a user can act on
EXPECTED_WORDS = {
    "dtype": ["float8_e4m3fn", "not supported by reductions", "float32", "take any dtype"],
    "device": ["meta", ".cpu()"],
    "quantized": ["quantized", "qint8", "int_repr()"],
    "sparse": ["dense", "to_dense"],
    "avg_bool": ["AVG", "bool"],
    "bitwise_float": ["BAND", "float32"],
    "premul_sum": ["PREMUL_SUM needs a factor", "dtype int64", "PREMUL_SUM(factor)"],
    "premul_sum_int": ["PREMUL_SUM needs floating-point tensors", "int32"],
    "gather_size": ["expected", "found 5"],
    "scatter_size": ["expected", "found 5"],
    "list_count": ["expected 2", "found 1"],
    "root": ["root rank 6", "0..1"],
    "recv_any_source": ["any source", "src="],
    "lazy_negative": ["lazy negative view", ".resolve_neg()"],
    "send_tag": ["tag -1", "from 0 to 2**31 - 1"],
    "split_sum": ["input_split_sizes=[1, 2] adds up to 3 rows", "has 4"],
    "split_count": ["output_split_sizes=[4]", "expected 2 non-negative row counts"],
    "all_to_all_count": ["expected 2 output tensors", "found 1"],
    "all_gather_own_size": ["output tensor", "(this rank's)", "must hold its own input"],
}


@pytest.mark.parametrize("transport", sorted(TRANSPORT_ENVS))
def test_bad_input_raises_on_every_rank_and_group_stays_usable(transport):
    reports = harness.values(harness.launch("tests.errors_programs:bad_input", 2, env=TRANSPORT_ENVS[transport]))
    for rank, report in enumerate(reports):
        assert set(report) == set(EXPECTED_WORDS)
        for case, words in EXPECTED_WORDS.items():
            error = report[case]
            assert error["type"] is not None, f"rank {rank} {case}: no error raised"
            for word in words:
                assert word in error["message"], f"rank {rank} {case}: {word!r} not in {error['message']!r}"
            if case != "premul_sum" or "smddp" in error["message"]:
                assert f"rank {rank}/2" in error["message"] or case == "premul_sum", error["message"]
            assert error["usable_after"], f"rank {rank}: group unusable after {case}"


MISMATCH_HINTS = {  # where a mismatch's message tells the user to look, by what differs (the default: sizes)
    "op": "look for a collective that only some ranks call",
    "all_gather_paths": "Some ranks passed split sizes (or output tensors of different sizes) and others did not",
    "dtype": "Every rank must pass tensors of the same dtype to a collective: look for a cast",
    "moved_dtype": "Every rank must pass tensors of the same dtype to a collective: look for a cast",
}


@pytest.mark.parametrize("transport", sorted(TRANSPORT_ENVS))
@pytest.mark.parametrize("kind", ["size", "dtype", "op", "moved_dtype", "all_gather_sizes", "all_gather_paths",
                                  "premul_all_reduce_size", "premul_reduce_size"])
def test_mismatched_calls_raise_on_every_rank(transport, kind):
    reports = harness.values(harness.launch("tests.errors_programs:mismatch", 2, env=TRANSPORT_ENVS[transport],
                                            kind=kind))
    # a mismatch found in a table every rank gathered (split sizes; SMDDP_CHECK_COLLECTIVES'
    # signatures, as on gloo here) leaves nothing posted: the group goes on. One that shm's
    # headers find (the check costs nothing there) may have left a peer inside the call.
    recoverable = transport == "gloo" or kind == "all_gather_sizes"
    for rank, error in enumerate(reports):
        assert "CollectiveMismatchError" in error["classes"], (rank, error)
        assert error["backend_error"], "must be a torch DistBackendError"
        if recoverable:
            assert error["type"] == "RecoverableMismatchError", (rank, error)
            assert "the group can still be used" in error["message"], error["message"]
            assert error["usable_after"] is True, (rank, error)
            # nothing moved, and nothing was changed: a PREMUL_SUM's input is not yet scaled
            assert error["premul_input_after"] == [1.0], (rank, error)
        else:
            assert error["type"] == "CollectiveMismatchError", (rank, error)
            assert "can no longer be used" in error["usable_after"], (rank, error)
        if kind == "all_gather_sizes":
            assert "rank 1 sends 5 elements to rank 0, which expects 4" in error["message"], error["message"]
            assert f"[smddp rank {rank}/2 " in error["message"] and "all_gather" in error["message"], error["message"]
            assert "output tensor p must have as many elements as rank p's input" in error["message"], error["message"]
        else:
            # both ranks' calls, as the check and the waiting ranks' look name them, and where to look
            sizes = "Every rank must pass tensors of the same size to a collective: look for a tensor whose shape"
            for words in ("called different collectives as call #1 of this group: rank 0: ", "; rank 1: ",
                          MISMATCH_HINTS.get(kind, sizes)):
                assert words in error["message"], (rank, words, error["message"])
        if kind in ("dtype", "moved_dtype"):  # named, not as the codes that travel
            for name in (("float32", "float64") if kind == "dtype" else ("float8_e4m3fn", "uint8")):
                assert f"dtype={name}" in error["message"], error["message"]
        assert error["seconds"] < 30, error


@pytest.mark.parametrize("transport", ["gloo", "mpi", "hierarchical"])
def test_calls_of_different_sizes_are_caught_by_default(transport):
    """Under mpiexec, ranks passing tensors of different sizes to one all_reduce got wrong sums
    and no error (MPI pairs them), and gloo aborted a rank: the check was off by default. Now
    every rank raises, naming both calls, before any data moves, and the group goes on."""
    if transport == "mpi":
        harness.skip_without_mpiexec()
        results = harness.launch_mpi("tests.errors_programs:mismatch", 2, env={"SMDDP_TRANSPORT": "mpi"}, kind="size")
    elif transport == "gloo":
        results = harness.launch("tests.errors_programs:mismatch", 2, env={"SMDDP_TRANSPORT": "gloo"}, kind="size")
    else:  # 2 simulated hosts of one rank: the calls meet between hosts only
        results = harness.launch("tests.errors_programs:mismatch", 2, env={"SMDDP_ALGORITHM": "hierarchical"},
                                 hosts_of=1, kind="size")
    for rank, error in enumerate(harness.values(results)):
        assert error["type"] == "RecoverableMismatchError", (rank, error)
        for words in (f"[smddp rank {rank}/2 ", "called different collectives as call #1 of this group: rank 0: ",
                      "the group can still be used"):
            assert words in error["message"], (rank, words, error["message"])
        assert error["usable_after"] is True, (rank, error)


@tiers.FULL_ONLY
@pytest.mark.parametrize("transport", ["gloo", "mpi"])
def test_a_call_that_pairs_with_a_peers_exchange_of_sizes_is_told(transport):
    """Without SMDDP_CHECK_COLLECTIVES, rank 0's list all_gather takes the equal path and rank 1's
    the uneven one, whose exchange of sizes moves as many bytes as rank 0's all_gather: gloo and
    MPI pair the two without an error. Rank 1 finds rank 0's row unmarked and raises, naming
    both; rank 0's call has completed (with rank 1's sizes as data), and its next call raises
    the same mismatch, heard on the group's board, instead of waiting for the timeout."""
    env = {"SMDDP_TRANSPORT": transport, **UNCHECKED}
    if transport == "mpi":
        harness.skip_without_mpiexec()
        results = harness.launch_mpi("tests.errors_programs:mismatch", 2, env=env, kind="all_gather_paths")
    else:
        results = harness.launch("tests.errors_programs:mismatch", 2, env=env, kind="all_gather_paths")
    first, second = harness.values(results)
    said = ("as call #1 of this group: rank 0: another collective of 48 bytes per rank, which paired with",
            "rank 1: all_gather(with outputs of different sizes, dtype=int64)",
            MISMATCH_HINTS["all_gather_paths"])
    assert second["type"] == "CollectiveMismatchError", second
    assert second["backend_error"], second
    for words in (*said, "[smddp rank 1/2 ", "can no longer be used"):
        assert words in second["message"], (words, second["message"])
    assert first["type"] is None, first  # the limit: its call paired and returned
    assert first["usable_after"].startswith("CollectiveMismatchError: [smddp rank 0/2 "), first
    for words in said:
        assert words in first["usable_after"], (words, first["usable_after"])


@tiers.FULL_ONLY
def test_ranks_of_one_host_whose_sizes_give_the_same_share_are_told():
    """On 2 hosts x 2 ranks each host's ranks all-reduce 100000 and 99999 elements: the steps
    inside the hosts move shares of 50000 alike, so their headers alone would match, and the
    steps between hosts too; the headers also carry the user's call, and every rank raises."""
    reports = harness.values(harness.launch("tests.errors_programs:mismatch", 4,
                                            env={"SMDDP_ALGORITHM": "hierarchical", **UNCHECKED},
                                            hosts_of=2, kind="host_share_size"))
    for rank, error in enumerate(reports):
        assert error["type"] == "CollectiveMismatchError", (rank, error)
        for words in ("all_reduce(numel=100000, dtype=float32, op=SUM)", "all_reduce(numel=99999, dtype=float32, op=SUM)",
                      f"[smddp rank {rank}/4 "):
            assert words in error["message"], (rank, words, error["message"])
        assert error["seconds"] < 30, error


@tiers.FULL_ONLY
def test_ranks_of_one_host_passing_different_dtypes_to_a_hierarchical_all_gather_are_told():
    """Rank 3 passes float8, the others uint8 of the same size: the same bytes. Without
    SMDDP_CHECK_COLLECTIVES, only the step inside a host (shm) compares the ranks' calls: its
    headers must name the user's call (an all_gather of 8 elements, not the step gathering 16
    bytes inside the host), and its message the user's ranks, not the host group's. (Ranks 0
    and 1, on the other host, agree with each other and with what gloo checks between hosts:
    their call completes; the mismatch reaches them on the group's board, in a later wait.)"""
    reports = harness.values(harness.launch("tests.errors_programs:mismatch", 4,
                                            env={"SMDDP_ALGORITHM": "hierarchical", **UNCHECKED},
                                            hosts_of=2, kind="moved_dtype"))
    for rank in (2, 3):
        error = reports[rank]
        assert error["type"] == "CollectiveMismatchError", (rank, error)
        assert "can no longer be used" in error["usable_after"], (rank, error)
        for words in ("as call #1 of this group: rank 2: all_gather(numel=8, dtype=uint8)",
                      "rank 3: all_gather(numel=8, dtype=float8_e4m3fn)", f"[smddp rank {rank}/4 "):
            assert words in error["message"], error["message"]
        assert error["seconds"] < 30, error


def _waiting_mismatch_words(kind: str, world: int) -> list[str]:
    """What the error must say each side called, for programs.WAITING_MISMATCHES[kind], and where
    it must tell the user to look."""
    extra_call = "look for a collective that only some ranks call (under `if rank == 0:`"
    return {
        "op": ["all_reduce(numel=10, dtype=float32, op=SUM)", "broadcast(numel=10, dtype=float32, root=0)",
               extra_call],
        "extra_call": ["all_reduce(numel=1, dtype=float32, op=SUM)", "barrier()", extra_call],
        "root": ["broadcast(numel=10, dtype=float32, root=0)", f"broadcast(numel=10, dtype=float32, root={world - 1})",
                 "Every rank must pass the same root and reduce op"],
        "all_to_all_splits": ["all_to_all(with split sizes, dtype=float32)",
                              f"all_to_all(numel={2 * world}, dtype=float32)",
                              "Some ranks passed split sizes (or output tensors of different sizes) and others"],
    }[kind]


WAITING_MISMATCH_LAUNCHES = {  # transport: (ranks, the ranks making the other call, launch arguments)
    "gloo": (2, [1], {"env": {"SMDDP_TRANSPORT": "gloo", **UNCHECKED}}),
    "mpi": (2, [1], {"env": {"SMDDP_TRANSPORT": "mpi", **UNCHECKED}}),
    # one simulated host calls one thing, the other host another: ranks wait between hosts (gloo)
    "hierarchical": (6, [3, 4, 5], {"env": {"SMDDP_ALGORITHM": "hierarchical", **UNCHECKED}, "hosts_of": 3}),
}
WAITING_MISMATCH_ODD_RANKS = {
    # rank 3 alone skips the all_reduce: ranks 4 and 5, on its host, wait for it in shared memory
    # (the step inside the host), and the one that looks at the store second may first see the
    # other's segment flag that it raised
    ("hierarchical", "extra_call"): [3],
}
WAITING_MISMATCH_CASES = [("gloo", kind) for kind in ("op", "extra_call", "root", "all_to_all_splits")] + [
    # MPI pairs the other kinds without an error (ranks' calls are matched by order only)
    ("mpi", "op"),
    ("hierarchical", "op"), ("hierarchical", "extra_call"), ("hierarchical", "all_to_all_splits"),
    ("hierarchical", "root"),
]


@tiers.FULL_ONLY
@pytest.mark.parametrize("transport,kind", WAITING_MISMATCH_CASES)
def test_ranks_waiting_in_different_calls_raise_without_the_check(transport, kind):
    """Without SMDDP_CHECK_COLLECTIVES, ranks whose calls differ and leave them waiting for each
    other compare their calls through the store once a wait lasts a second, and every rank
    raises, naming both calls, instead of waiting for the group's timeout (60 s here)."""
    world, odd, launch = WAITING_MISMATCH_LAUNCHES[transport]
    odd = WAITING_MISMATCH_ODD_RANKS.get((transport, kind), odd)
    if transport == "mpi":
        harness.skip_without_mpiexec()
        results = harness.launch_mpi("tests.errors_programs:mismatch_that_waits", world, kind=kind, odd_ranks=odd,
                                     **launch)
    else:
        results = harness.launch("tests.errors_programs:mismatch_that_waits", world, kind=kind, odd_ranks=odd, **launch)
    for rank, error in enumerate(harness.values(results)):
        assert error["type"] == "CollectiveMismatchError", (rank, error)
        assert error["backend_error"], "must be a torch DistBackendError"
        for words in [f"[smddp rank {rank}/{world} ", "called different collectives as call #1",
                      *_waiting_mismatch_words(kind, world)]:
            assert words in error["message"], (rank, words, error["message"])
        assert "can no longer be used" in error["usable_after"], (rank, error)
        assert error["seconds"] < 10, (rank, error)


@tiers.FULL_ONLY
def test_a_rank_arriving_after_its_peers_found_a_mismatch_is_told():
    """Ranks 0 and 1 differ and raise after about a second; rank 2, which calls what rank 0 does,
    arrives 3 s later: it must raise the same error, not wait for the timeout (its peers have
    left the call, and may have exited)."""
    results = harness.launch("tests.errors_programs:mismatch_that_waits", 3,
                             env={"SMDDP_TRANSPORT": "gloo", **UNCHECKED},
                             kind="op",
                             odd_ranks=[1], late_rank=2, late_s=3.0)
    for rank, error in enumerate(harness.values(results)):
        assert error["type"] == "CollectiveMismatchError", (rank, error)
        for words in [f"[smddp rank {rank}/3 ", "called different collectives as call #1",
                      *_waiting_mismatch_words("op", 3)]:
            assert words in error["message"], (rank, words, error["message"])
        assert error["seconds"] < 10, (rank, error)


@tiers.FULL_ONLY
def test_gloo_sizes_that_differ_abort_one_rank_and_the_other_is_told_what_to_look_for():
    """Not found by waiting: gloo aborts the rank that receives more bytes than it posted before
    anyone waits. The other rank can only see a closed connection in its next call; its error
    must say what the aborted rank's output shows when that is the cause, and how to be told."""
    aborted, survivor = harness.launch("tests.errors_programs:sizes_differ_on_gloo", 2,
                                       env={"SMDDP_TRANSPORT": "gloo", **UNCHECKED})
    assert aborted.returncode != 0, aborted
    assert "Received data size doesn't match expected size" in aborted.output, aborted.output
    assert survivor.returncode == 0, survivor
    # the closed connection reaches the survivor in its next call, or in this one where gloo
    # aborted the other rank before the survivor's own part of the call had completed
    first = survivor.value["call"]
    error = f"{first['type']}: {first['message']}" if first["type"] is not None else survivor.value["next"]
    assert "PeerFailureError" in error and "by peer" in error, error
    for words in ("Received data size doesn't match expected size", "ranks called collectives of different sizes",
                  "Without SMDDP_CHECK_COLLECTIVES=0 (the check is on by default)"):
        assert words in error, (words, error)


@tiers.FULL_ONLY
@pytest.mark.parametrize("transport", sorted(WAITING_MISMATCH_LAUNCHES))
def test_a_slow_rank_whose_calls_match_is_not_taken_for_a_mismatch(transport):
    """Waits that last over a second compare the ranks' calls; calls that match, including one of
    two dtypes (two steps) and an uneven all_to_all, must all complete with the right values."""
    world, _, launch = WAITING_MISMATCH_LAUNCHES[transport]
    if transport == "mpi":
        harness.skip_without_mpiexec()
        results = harness.launch_mpi("tests.errors_programs:slow_rank_matching_calls", world, **launch)
    else:
        results = harness.launch("tests.errors_programs:slow_rank_matching_calls", world, **launch)
    total = float(sum(range(world)))
    for rank, report in enumerate(harness.values(results)):
        assert report["sums"] == [[total] * 3, [total] * 2], (rank, report)
        assert report["broadcast"] == [float(world - 1)] * 4, (rank, report)
        assert report["received"] == [float(p) for p in range(world) for _ in range(p + 1)], (rank, report)
        if rank < world - 1:  # it waited long enough in each call to compare
            assert min(report["waits"]) > refusals.MISMATCH_LOOK_AFTER_S, (rank, report)


@pytest.mark.parametrize("transport", ["shm", "gloo", "mpi", "hierarchical"])
def test_uneven_all_to_all_sizes_that_disagree_raise_on_every_rank_and_the_group_goes_on(transport):
    """Checked always (not only with SMDDP_CHECK_COLLECTIVES): MPI fills the outputs partly and
    raises nothing when the sizes disagree, and gloo notices only some disagreements. Every rank
    finds the disagreement in the same gathered table before any data moves, so the group stays
    usable (it refused every later call before)."""
    env = {"SMDDP_TRANSPORT": transport}
    if transport == "mpi":
        harness.skip_without_mpiexec()
        results = harness.launch_mpi("tests.errors_programs:uneven_splits_disagree", 2, env=env)
    elif transport == "hierarchical":  # 2 simulated hosts of one rank: the exchange crosses hosts
        results = harness.launch("tests.errors_programs:uneven_splits_disagree", 2,
                                 env={"SMDDP_ALGORITHM": "hierarchical"},
                                 hosts_of=1)
    else:
        results = harness.launch("tests.errors_programs:uneven_splits_disagree", 2, env=env)
    for rank, error in enumerate(harness.values(results)):
        assert error["type"] == "RecoverableMismatchError", (rank, error)
        assert "rank 1 sends 2 elements to rank 0, which expects 3" in error["message"], error["message"]
        assert f"rank {rank}/2" in error["message"] and "all_to_all_single" in error["message"], error["message"]
        assert error["usable_after"] is True, (rank, error)
        assert error["agreed_after"] == ([0.0, 10.0, 11.0, 12.0] if rank == 0 else [1.0, 2.0, 13.0]), (rank, error)


REFUSAL_LAUNCHES = {  # transport: (ranks, launch arguments)
    "shm": (2, {"env": {"SMDDP_TRANSPORT": "shm"}}),
    # unchecked: the waiting rank is inside the call itself when it hears of the refusal
    "gloo": (2, {"env": {"SMDDP_TRANSPORT": "gloo", **UNCHECKED}}),
    # 2 simulated hosts x 2 ranks: rank 3's host peer waits in shared memory, the others in gloo
    "hierarchical": (4, {"env": {"SMDDP_ALGORITHM": "hierarchical", **UNCHECKED}, "hosts_of": 2}),
    "mpi": (2, {"env": {"SMDDP_TRANSPORT": "mpi", **UNCHECKED}}),
    # as by default: the waiting rank is inside the signature check's all_gather when it hears of the refusal
    "gloo-checked": (2, {"env": {"SMDDP_TRANSPORT": "gloo"}}),
}


# what the refusing rank's error says, by what it passed (programs.REFUSED_CALLS)
REFUSAL_WORDS = {"dtype": "float8_e4m3fn", "op": "PREMUL_SUM", "reduce_scatter": "float8_e4m3fn",
                 "gather": "is on meta", "all_to_all_uneven": "is on meta"}
REFUSED_OP = {"dtype": "all_reduce", "op": "all_reduce", "reduce_scatter": "reduce_scatter_tensor",
              "gather": "gather", "all_to_all_uneven": "all_to_all_single"}
REFUSAL_CASES = [(transport, "dtype") for transport in sorted(REFUSAL_LAUNCHES) if transport != "gloo-checked"] + [
    ("gloo-checked", "dtype"),
    # refused while the call reads its arguments, before its checks: on transports whose waits
    # hear of refusals only through the store, the call must still be numbered and announced
    ("gloo", "op"), ("mpi", "op"),
    # gloo's own reduce_scatter could not be waited on in slices; hierarchical's crosses hosts in gloo
    ("gloo", "reduce_scatter"), ("hierarchical", "reduce_scatter"),
    # the collectives added on 2026-11-24
    ("shm", "gather"), ("mpi", "gather"), ("gloo", "gather"), ("gloo", "all_to_all_uneven"),
    ("hierarchical", "all_to_all_uneven"),
]


@pytest.mark.parametrize("transport,world,op", [("gloo", 4, "broadcast"), ("gloo", 4, "scatter"),
                                               ("mpi", 2, "broadcast")])
def test_a_refused_call_that_some_ranks_finish_without_the_refuser_fails_the_group_everywhere(transport, world, op):
    """Those ranks never waited in the refused call, so they never looked for its refusal: the
    refuser waited for their outcome and they for the refuser in the next call, both until the
    group's timeout. They hear of it in their next wait now."""
    env = {"SMDDP_TRANSPORT": transport}
    if transport == "mpi":
        harness.skip_without_mpiexec()
        results = harness.launch_mpi("tests.errors_programs:rooted_call_refused", world, env=env, op=op)
    else:
        results = harness.launch("tests.errors_programs:rooted_call_refused", world, env=env, op=op)
    reports = harness.values(results)
    assert "is on meta" in reports[-1]["message"], reports[-1]
    assert "can no longer be used" in reports[-1]["next"], reports[-1]
    for rank, report in enumerate(reports[:-1]):
        assert report["backend_error"] and "can no longer be used" in report["message"], (rank, report)
        assert f"rank {world - 1} refused" in report["message"], (rank, report)
        assert report["seconds"] < 4, (rank, report)


@pytest.mark.parametrize("retry", [False, True], ids=["refuser-stops", "refuser-retries"])
@pytest.mark.parametrize("transport,kind", REFUSAL_CASES)
def test_rank_refusing_a_call_releases_its_waiting_peers(transport, kind, retry):
    world, launch = REFUSAL_LAUNCHES[transport]
    if transport == "mpi":
        harness.skip_without_mpiexec()
        reports = harness.values(harness.launch_mpi("tests.errors_programs:one_rank_refuses", world, retry=retry,
                                                    kind=kind,
                                                    **launch))
    else:
        reports = harness.values(harness.launch("tests.errors_programs:one_rank_refuses", world, retry=retry, kind=kind,
                                                **launch))
    refuser = world - 1
    if retry:  # its next call would pair with the operations the others left posted: it must fail
        again = reports[refuser]["retry"]
        assert again["backend_error"] and "can no longer be used" in again["message"], again
        if transport != "shm":  # shm's own check sees the call numbers differ (CollectiveMismatchError)
            assert "were inside it" in again["message"] and "no longer line up" in again["message"], again
    words = REFUSAL_WORDS[kind]
    assert reports[refuser]["type"] == "InvalidCallError" and words in reports[refuser]["message"], reports[refuser]
    assert reports[refuser]["message"].startswith(f"[smddp rank {refuser}/{world} "), reports[refuser]
    # the others are inside the all_reduce when the last rank refuses it: each hears so and says
    # why, long before the 60 s timeout (the group's default is 30 minutes)
    for rank, report in enumerate(reports[:refuser]):
        assert report["backend_error"], (rank, report)
        # named as the user's group numbers it (the hierarchical transport's parts number their
        # own), in the call the user made (not a step of it: a part's, or the signature check's)
        assert report["message"].startswith(f"[smddp rank {rank}/{world} "), (rank, report)
        assert report["message"].split("] ", 1)[1].startswith(REFUSED_OP[kind]), (rank, report)
        assert "checking that every rank" not in report["message"], (rank, report)
        assert report["seconds"] < 4, (rank, report)  # the refusing rank lives 5 s after refusing
        assert "can no longer be used" in report["message"], (rank, report)
        if transport == "shm" and retry and report["type"] == "CollectiveMismatchError":
            # the retry reached shared memory before the waiting rank's next look for refusals:
            # its header check names both calls instead
            assert f"rank {refuser}: call #3" in report["message"], (rank, report)
            continue
        assert f"rank {refuser} refused this call" in report["message"], (rank, report)
        assert words in report["message"], (rank, report)


@pytest.mark.parametrize("transport", ["shm", "gloo-checked", "hierarchical", "mpi"])
def test_a_refusal_is_reported_as_itself_when_the_refuser_is_already_in_its_next_call(transport, tmp_path):
    """The refuser goes on to its next call before its peers enter the refused one, so they first
    see a peer in another call: shm's header check reported call numbers that differ instead of
    the refusal and its reason. Every rank's error names the refusal now, the refuser's included."""
    world, launch = REFUSAL_LAUNCHES[transport]
    if transport == "mpi":
        harness.skip_without_mpiexec()
        results = harness.launch_mpi("tests.errors_programs:one_rank_refuses", world, kind="dtype",
                                     peers_late=str(tmp_path / "refused"), **launch)
    else:
        results = harness.launch("tests.errors_programs:one_rank_refuses", world, kind="dtype",
                                 peers_late=str(tmp_path / "refused"), **launch)
    reports = harness.values(results)
    refuser = world - 1
    assert reports[refuser]["type"] == "InvalidCallError", reports[refuser]
    assert "this rank refused" in reports[refuser]["retry"]["message"], reports[refuser]
    for rank, report in enumerate(reports[:refuser]):
        assert report["type"] == "PeerRefusedError", (rank, report)
        assert f"rank {refuser} refused this call" in report["message"], (rank, report)
        assert REFUSAL_WORDS["dtype"] in report["message"], (rank, report)


def test_shm_forced_across_hosts_is_refused_on_every_rank():
    """Rank 0 decides the transport; it raised the clear error, and the other ranks waited for
    its decision until the group's timeout."""
    reports = harness.values(harness.launch("tests.errors_programs:init_refused", 2, env={"SMDDP_TRANSPORT": "shm"},
                                            interleaved_hosts=2))
    for rank, error in enumerate(reports):
        assert f"[smddp rank {rank}/2" in error["message"], error
        assert "SMDDP_TRANSPORT=shm needs every rank on one host" in error["message"], error
        assert error["seconds"] < 10, error


# launch options, the variables one rank or host sets, and what every rank must be told. Before
# init compared them: shm returned a wrong sum (the chunk size lays out shared memory), the hosts
# with the other chunk size aborted in gloo, the rank that checked calls waited out the timeout
SETTINGS_DIFFER_CASES = {
    "shm-chunk": (2, {"env": {"SMDDP_TRANSPORT": "shm"}}, {"1": {"SMDDP_SHM_CHUNK_BYTES": "65536"}},
                  "SMDDP_SHM_CHUNK_BYTES is 1048576 on rank 0 and 65536 on rank 1"),
    "hierarchical-chunk-on-one-host": (
        4, {"env": {"SMDDP_ALGORITHM": "hierarchical"}, "hosts_of": 2},
        {"2": {"SMDDP_HIERARCHICAL_CHUNK_BYTES": "65536"}, "3": {"SMDDP_HIERARCHICAL_CHUNK_BYTES": "65536"}},
        "SMDDP_HIERARCHICAL_CHUNK_BYTES is 4194304 on ranks 0-1 and 65536 on ranks 2-3"),
    "check-off-on-one-rank": (2, {"env": {"SMDDP_TRANSPORT": "gloo"}}, {"1": {"SMDDP_CHECK_COLLECTIVES": "0"}},
                              "SMDDP_CHECK_COLLECTIVES (SMDDP_DEBUG turns it on too) is enabled on rank 0 and "
                              "disabled on rank 1"),
    "wire-dtype-on-one-host": (4, {"env": {}, "hosts_of": 2},
                               {"0": {"SMDDP_INTER_NODE_WIRE_DTYPE": "bfloat16"},
                                "1": {"SMDDP_INTER_NODE_WIRE_DTYPE": "bfloat16"}},
                               "SMDDP_INTER_NODE_WIRE_DTYPE is bfloat16 on ranks 0-1 and unset on ranks 2-3"),
}


@pytest.mark.parametrize("case", sorted(SETTINGS_DIFFER_CASES))
def test_ranks_whose_settings_differ_are_refused_at_init_on_every_rank(case):
    world, launch, settings, said = SETTINGS_DIFFER_CASES[case]
    reports = harness.values(harness.launch("tests.errors_programs:settings_differ", world, settings_of_rank=settings,
                                            **launch))
    for rank, report in enumerate(reports):
        error = report["init"]
        assert error["type"] == "ValueError", (rank, report)
        assert f"[smddp rank {rank}/{world}" in error["message"], error
        assert said in error["message"], error
        assert "mpirun needs -x VARIABLE" in error["message"], error
        assert error["seconds"] < 10, error


def test_ranks_whose_settings_agree_are_not_refused():
    """Settings that stay on their rank (the scratch size, blocking waits) may differ."""
    settings = {"1": {"SMDDP_SCRATCH_MAX_BYTES": "0", "SMDDP_BLOCKING_WAIT": "1"}}
    for report in harness.values(harness.launch("tests.errors_programs:settings_differ", 2, settings_of_rank=settings,
                                                env={"SMDDP_TRANSPORT": "shm"})):
        assert report["init"]["type"] is None and report["call"]["type"] is None and report["sum_right"], report


@pytest.mark.parametrize("late_rank", [-1, 1], ids=["together", "rank-1-late"])
def test_steps_that_differ_under_one_call_are_named_as_a_bug(late_rank):
    """With settings that agree, ranks of one host cannot take different steps for one call;
    if they do (the program makes them), the message names the steps and says it is a bug in
    smddp-lite, not a hint about the user's tensors. With rank 1 late, rank 0 waits for it and
    hears the other host's finding first (the race that failed the quick tier once)."""
    reports = harness.values(harness.launch("tests.errors_programs:steps_differ_under_one_call", 4, hosts_of=2,
                                            env={"SMDDP_ALGORITHM": "hierarchical"}, late_rank=late_rank))
    for rank, error in enumerate(reports):
        assert error["type"] == "CollectiveMismatchError", (rank, error)
        # each host's ranks find it in their headers, and announce it to the other host's: a rank
        # may hear the other host's pair before it reads its own headers (both are the same bug)
        pairs = [f"rank {first}: all_reduce(numel=8, dtype=float32, op=SUM); "
                 f"rank {first + 1}: broadcast(numel=8, dtype=float32, root=0)" for first in (0, 2)]
        assert any(pair in error["message"] for pair in pairs), f"rank {rank}: {error['message']}"
        assert "this is a bug in smddp-lite" in error["message"], f"rank {rank}: {error['message']}"
        assert "same size" not in error["message"], f"rank {rank}: {error['message']}"


@pytest.mark.parametrize("transport", sorted(TRANSPORT_ENVS))
def test_dead_peer_raises_naming_rank_and_op(transport):
    results = harness.launch("tests.errors_programs:peer_dies", 2, env=TRANSPORT_ENVS[transport])
    error = results[0].value
    assert error is not None, results[0].output[-3000:]
    assert error["backend_error"], error
    assert "all_reduce" in error["message"], error
    # gloo's own text names the peer by its socket address alone ([127.0.0.1]:port)
    assert "rank 1" in error["message"] and "died" in error["message"], error
    assert error["seconds"] < 60, error  # the group timeout is 120 s: detected, not timed out
    for refused in (error["next_call"], error["send_after"]):
        assert refused["backend_error"] and "can no longer be used" in refused["message"], error
    # the refusal of the next call waited for the dead rank's outcome: destroy took 5 s and left
    # the communication thread waiting for the group's timeout
    assert error["destroy_seconds"] < 2 and error["threads_after"] == [], error


def test_rank_0_killed_during_init_leaves_no_segment_behind():
    """Rank 0 removed the segment's name once every rank had mapped it; killed while it waited,
    it left a segment of the job's size in /dev/shm for good."""
    results = harness.launch("tests.errors_programs:rank_0_killed_while_others_map", 2, env={"SMDDP_TRANSPORT": "gloo"})
    assert results[0].returncode == -9, results[0].output[-3000:]
    error = results[1].value
    assert error is not None and error["type"] == "PeerFailureError", (results[1].error, results[1].output[-3000:])
    assert "rank 0" in error["message"] and "died" in error["message"], error
    assert harness.segments_left_by(results) == []


@pytest.mark.mpi
@pytest.mark.parametrize("world", [2, 3])
def test_dead_peer_under_mpiexec_is_named_by_every_survivor_within_seconds(world, tmp_path):
    """MPI says nothing when a peer's process ends; under a launcher that lets the survivors live
    (hydra's -disable-auto-cleanup) they waited in the call until the group's timeout (120 s
    here, 30 minutes by default) and the message named no rank."""
    harness.skip_without_mpiexec()
    results = harness.launch_mpi("tests.errors_programs:mpi_peer_dies", world, env={"SMDDP_TRANSPORT": "mpi"},
                                 timeout=100,
                                 launcher_flags=("-disable-auto-cleanup",), reported=str(tmp_path))
    for survivor in results[:-1]:
        error = survivor.value
        assert error is not None, (survivor.rank, survivor.error, survivor.output[-3000:])
        assert error["backend_error"] and error["type"] == "PeerFailureError", error
        assert f"rank {world - 1} on this machine died" in error["message"], error
        assert error["seconds"] < 5, error


DDP_DEATH_LAUNCHES = {  # transport: (ranks, launch arguments)
    "shm": (2, {"env": {"SMDDP_TRANSPORT": "shm"}}),
    "gloo": (2, {"env": {"SMDDP_TRANSPORT": "gloo"}}),
    # 2 simulated hosts x 2 ranks: rank 0 shares rank 1's host, ranks 2 and 3 reach it through gloo
    "hierarchical": (4, {"env": {"SMDDP_ALGORITHM": "hierarchical"}, "hosts_of": 2}),
}


@pytest.mark.parametrize("transport", sorted(DDP_DEATH_LAUNCHES))
def test_peer_dying_during_ddp_backward_raises_on_every_survivor(transport):
    """DDP's reducer takes each bucket's all_reduce through the work's future, not its wait():
    the failure must be an error of that future, which backward() raises, on every rank left."""
    world, launch = DDP_DEATH_LAUNCHES[transport]
    results = harness.launch("tests.errors_programs:ddp_peer_dies", world, **launch)
    assert results[1].returncode == 3, results[1].output[-3000:]
    for result in results[:1] + results[2:]:
        error = result.value
        assert result.returncode == 0 and error is not None, (result.rank, result.returncode, result.output[-3000:])
        assert "PeerFailureError" in error["message"] and "all_reduce" in error["message"], (result.rank, error)
        assert error["seconds"] < 60, (result.rank, error)  # the group timeout is 120 s: detected, not timed out


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="mounting a small /dev/shm in a private mount namespace needs root and unshare")
@tiers.FULL_ONLY
def test_full_dev_shm_says_so_on_every_rank_instead_of_crashing():
    """A segment larger than /dev/shm's free room (Docker's is 64 MB) used to be mapped anyway,
    and the first write past the room killed the ranks with SIGBUS. Now its pages are taken at
    init, and every rank raises saying what to change. Both ranks run under torchrun in one
    mount namespace whose /dev/shm is a 16 MB tmpfs; the segment needs 32 MiB."""
    with tempfile.TemporaryDirectory(prefix="smddp-shm-") as tmp:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                   str(harness.WORKER), "tests.errors_programs:init_only", "{}", tmp]
        env = harness._base_env({"SMDDP_TRANSPORT": "shm", "SMDDP_SHM_CHUNK_BYTES": str(8 << 20)})
        done = subprocess.run(["unshare", "--mount", "sh", "-c",
                               'mount -t tmpfs -o size=16m tmpfs /dev/shm && exec "$@"', "sh", *command],
                              env=env, cwd=harness.ROOT, capture_output=True, text=True, timeout=120)
        reports = [json.loads((Path(tmp) / f"rank{rank}.json").read_text()) for rank in range(2)]
    for rank, report in enumerate(reports):
        error = report.get("value")
        assert error and error["type"] == "OSError", (rank, report, done.stdout[-3000:], done.stderr[-3000:])
        assert "needs 32 MiB in /dev/shm" in error["message"] and "--shm-size" in error["message"], (rank, error)
        assert error["seconds"] < 30, (rank, error)


@tiers.FULL_ONLY
@pytest.mark.parametrize("transport", sorted(TRANSPORT_ENVS))
def test_stuck_peer_times_out_with_the_group_timeout(transport):
    results = harness.launch("tests.errors_programs:peer_stuck", 2, env=TRANSPORT_ENVS[transport])
    error = results[0].value
    assert error is not None, results[0].output[-3000:]
    assert error["backend_error"] and "all_reduce" in error["message"], error
    assert 2.5 < error["seconds"] < 11, error


def test_collectives_after_destroy_say_so():
    (report,) = harness.values(harness.launch("tests.errors_programs:after_destroy", 1))
    assert "not been initialized" in report["module_api"]["message"]
    assert "destroyed" in report["stale_handle"]["message"], report["stale_handle"]


def test_use_before_init_says_so():
    import smddp_lite  # noqa: F401  (registers the backend; no group is created)

    with pytest.raises((RuntimeError, ValueError), match="init_process_group|not been initialized"):
        dist.all_reduce(torch.ones(3))


def _work(timeout_s: float = 5.0):
    from datetime import timedelta

    from smddp_lite.backend.work import SMDDPWork

    return SMDDPWork("[smddp rank 0/2 host h] all_reduce:", [torch.ones(2)], timedelta(seconds=timeout_s))


def test_work_future_asked_for_after_the_call_ended_carries_its_outcome():
    # the future is made on request, so it may be asked for after the communication thread ended
    # the call: it must then hold the outputs, or raise the failure as an error of the future
    ok = _work()
    ok._finish(None)
    assert ok.is_completed() and ok.is_success() and ok.wait()
    (value,) = ok.get_future().wait()
    assert torch.equal(value, torch.ones(2))
    failed = _work()
    failed._finish(RuntimeError("peer 1 closed the connection"))
    assert failed.is_completed() and not failed.is_success()
    with pytest.raises(RuntimeError, match="SMDDPError: peer 1 closed the connection"):  # torch wraps it
        failed.get_future().wait()
    with pytest.raises(dist.DistBackendError, match="peer 1 closed the connection"):
        failed.wait()


def test_work_waiters_and_future_asked_for_before_the_end_all_see_it():
    import threading

    work = _work()
    future = work.get_future()
    assert not future.done() and not work.is_completed()
    waited = []
    # a waiter that wakes must find the future already complete (it may read it at once)
    waiters = [threading.Thread(target=lambda: waited.append(work.wait() and future.done())) for _ in range(3)]
    for t in waiters:
        t.start()
    threading.Timer(0.05, work._finish, [None]).start()
    for t in waiters:
        t.join(5)
    assert waited == [True, True, True] and future.done() and work.get_future() is future


def test_work_wait_gives_up_after_the_timeout_saying_so():
    from smddp_lite.backend.errors import PeerFailureError

    with pytest.raises(PeerFailureError, match=r"all_reduce: not complete after 0.1 s \(the process group timeout\)"):
        _work(timeout_s=0.1).wait()


def test_premul_sum_on_a_torch_that_hides_its_factor_says_to_upgrade(monkeypatch):
    """torch 2.11 (the GPU machine's) keeps a PREMUL_SUM's factor from backends written in Python;
    the conformance suite checks this refusal on every rank where such a torch runs it."""
    from smddp_lite.backend import numerics, ops

    monkeypatch.setattr(numerics, "FACTOR_READABLE", False)
    with pytest.raises(ValueError, match=r"PREMUL_SUM: torch \S+ does not let a backend written in Python read the "
                                         r"factor.*upgrade torch, or multiply the input by the factor"):
        numerics.reduction(dist._make_nccl_premul_sum(2.0))
    assert numerics.reduction(dist.ReduceOp.SUM) == (ops.RedOp.SUM, None)
