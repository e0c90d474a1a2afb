"""The store protocol behind refusals (backend/transports/refusals.py), on one in-memory store:
each rank's board is what that rank's transport holds. The multi-process behaviour is in
test_errors.py."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import torch
import torch.distributed as dist

from smddp_lite.backend.process_group import _own_keys
from smddp_lite.backend.signatures import signature
from smddp_lite.backend.transports.refusals import SIGNATURE_SLOTS, RefusalBoard

TIMEOUT = timedelta(seconds=10)


def _group(store, world: int) -> list[RefusalBoard]:
    """One incarnation of a group: every rank makes its board, as every rank makes its transport,
    on the part of the store the process group keeps for that incarnation."""
    return [RefusalBoard(_own_keys(store, world), rank, world, TIMEOUT) for rank in range(world)]


def _hear(board: RefusalBoard, call: int) -> str:
    deadline = time.monotonic() + 5
    while (said := board.heard(call)) is None:
        assert time.monotonic() < deadline, "the refusal was never heard"
        time.sleep(0.01)
    return said


def test_a_rank_left_inside_the_refused_call_stops_the_refusing_rank_too():
    boards = _group(dist.HashStore(), 2)
    assert boards[0].heard(2) is None  # rank 0 waits in call 2; nobody refused it yet
    with ThreadPoolExecutor(1) as pool:
        refusal = pool.submit(boards[1].post, 2, "dtype float8_e4m3fn is not supported")
        said = _hear(boards[0], 2)
        assert said == "rank 1 refused this call: dtype float8_e4m3fn is not supported"
        cannot_go_on = refusal.result(timeout=5)
    assert "rank(s) 0 were inside it" in cannot_go_on and "can no longer be used" in cannot_go_on
    assert boards[0].heard(3) is None  # other calls are not refused


def test_a_call_every_rank_refused_leaves_the_group_usable():
    boards = _group(dist.HashStore(), 3)
    with ThreadPoolExecutor(3) as pool:
        outcomes = list(pool.map(lambda b: b.post(5, f"bad input on rank {b.rank}"), boards))
    assert outcomes == [None, None, None]


def test_a_group_made_again_on_the_same_store_does_not_hear_old_refusals():
    # destroy_process_group and a new init on torchrun's agent store number calls from 1 again
    store = dist.HashStore()
    old = _group(store, 2)
    with ThreadPoolExecutor(2) as pool:
        assert list(pool.map(lambda b: b.post(2, "bad"), old)) == [None, None]
    new = _group(store, 2)
    assert new[0].heard(2) is None and new[1].heard(2) is None
    assert old[0].heard(2) is not None  # the old incarnation's keys are still there, apart


def test_a_long_wait_looks_less_often(monkeypatch):
    from smddp_lite.backend.transports import refusals

    board = _group(dist.HashStore(), 1)[0]
    clock = [100.0]
    monkeypatch.setattr(refusals.time, "monotonic", lambda: clock[0])
    looks = []

    class CountingStore:  # the store's answers do not matter here, only how often it is asked
        def add(self, key, amount):  # a look reads the group's count of refusals and failures
            looks.append(clock[0])
            return 0

    board._store = CountingStore()
    for _ in range(200):  # 10 s of 50 ms polls in one call
        board.heard(7)
        clock[0] += 0.05
    # every poll for the first 5 s, then one a second
    early = [t for t in looks if t - 100 <= 5]
    late = [t for t in looks if t - 100 > 5]
    assert len(early) >= 100
    assert 4 <= len(late) <= 6 and all(b - a >= 0.99 for a, b in zip(late, late[1:])), late


class _CountingStore(dist.Store):
    """A store that counts the requests made of it: each is a round trip to a TCPStore's host."""

    def __init__(self, inner) -> None:
        super().__init__()
        self.inner, self.requests = inner, 0

    def _count(self, name, *args):
        self.requests += 1
        return getattr(self.inner, name)(*args)

    def set(self, key, value):
        return self._count("set", key, value)

    def get(self, key):
        return self._count("get", key)

    def add(self, key, amount):
        return self._count("add", key, amount)

    def check(self, keys):
        return self._count("check", keys)

    def wait(self, keys, timeout=None):
        return self._count("wait", keys, *([timeout] if timeout is not None else []))

    def compare_set(self, key, expected, desired):
        return self._count("compare_set", key, expected, desired)


def _requests_per_look(store: _CountingStore, board: RefusalBoard, call: int, looks: int = 10) -> float:
    before = store.requests
    for _ in range(looks):
        board._looking_at = (0, 0.0, 0.0)  # a new wait each time: every look asks the store
        assert board.heard(call) is None
    return (store.requests - before) / looks


def test_a_look_is_one_store_request_before_and_after_refusals_that_were_settled():
    """A wait looks every 50 ms: hundreds of ranks waiting for a slow one each asked two keys a
    look, and four once any call of the group had been refused (every rank refused call 2 here)."""
    store = _CountingStore(dist.HashStore())
    boards = _group(store, 2)
    assert _requests_per_look(store, boards[0], 2) == 1
    with ThreadPoolExecutor(2) as pool:
        assert list(pool.map(lambda b: b.post(2, "bad"), boards)) == [None, None]
    boards[0].heard(3)  # the first look after it reads what changed
    assert _requests_per_look(store, boards[0], 3) == 1
    boards[1].announce_failure(3, "an MPI error")  # counted news, which a gloo rank does not hear
    assert boards[0].heard(4) is None
    assert _requests_per_look(store, boards[0], 4) == 1


def test_a_refusal_of_a_call_whose_part_ended_here_is_heard_in_the_next_call():
    """A broadcast's root may finish before the refusing rank's refusal: its next wait hears it
    and records that it left, so the refusing rank's next call does not pair with its operations."""
    boards = _group(dist.HashStore(), 2)
    assert boards[0].heard(4) is None  # waiting in call 4 before anything was refused
    with ThreadPoolExecutor(1) as pool:
        refusal = pool.submit(boards[1].post, 3, "dtype float8_e4m3fn is not supported")
        said = _hear(boards[0], 4)
        assert said.startswith("rank 1 refused call #3, which this rank's part ended without it"), said
        assert "can no longer be used" in refusal.result(timeout=5)


def test_an_mpi_rank_hears_a_failure_announced_in_any_call():
    boards = _group(dist.HashStore(), 2)
    boards[0].hears_failures = True
    assert boards[0].heard(5) is None
    boards[1].announce_failure(4, "MPI_ERR_TRUNCATE")
    assert _hear(boards[0], 5) == "rank 1 failed in call #4: MPI_ERR_TRUNCATE"


ALL_REDUCE = signature("all_reduce", torch.float32, 10, 0)
BROADCAST = signature("broadcast", torch.float32, 10, 0)


def test_ranks_waiting_in_different_calls_find_it_and_every_rank_hears_it():
    boards = _group(dist.HashStore(), 3)
    boards[0].entering(5, ALL_REDUCE)
    assert boards[0].mismatch_in(5) is None  # the first to wait long in call 5: nothing to compare with
    boards[1].entering(5, BROADCAST)
    said = boards[1].mismatch_in(5)
    assert said == ("ranks called different collectives as call #5 of this group, and each waits for the others "
                    "in it: rank 0: all_reduce(numel=10, dtype=float32, op=SUM); "
                    "rank 1: broadcast(numel=10, dtype=float32, root=0). Every rank must call the same collectives in "
                    "the same order: look for a collective that only some ranks call (under `if rank == 0:`, or in a "
                    "loop that runs a different number of times on some ranks)."), said
    assert boards[1].mismatch_in(5) is None  # once per step of a call
    # announced to the group: the rank it compared with, and a rank waiting in another call
    assert _hear(boards[0], 5) == said
    assert _hear(boards[2], 4) == said


def test_ranks_waiting_in_the_same_call_agree_and_hear_nothing():
    boards = _group(dist.HashStore(), 3)
    for board in boards:
        board.entering(5, ALL_REDUCE)
        assert board.mismatch_in(5) is None
    assert all(board.heard(5) is None for board in boards)


def test_signatures_compare_step_by_step_and_slots_are_reused():
    boards = _group(dist.HashStore(), 2)
    # a call of two dtypes runs two steps: rank 0 waits in the second while rank 1 is still in
    # the first, which rank 0 finished: nothing to compare
    boards[0].entering(3, ALL_REDUCE)
    boards[0].entering(3, BROADCAST)
    assert boards[0].mismatch_in(3) is None
    boards[1].entering(3, ALL_REDUCE)
    assert boards[1].mismatch_in(3) is None
    # SIGNATURE_SLOTS calls later the slot of call 3 is taken over, and compared in again
    later = 3 + SIGNATURE_SLOTS
    boards[1].entering(later, BROADCAST)
    assert boards[1].mismatch_in(later) is None
    boards[0].entering(later, BROADCAST)
    assert boards[0].mismatch_in(later) is None
    boards[0].entering(later + SIGNATURE_SLOTS, BROADCAST)
    boards[1].entering(later + SIGNATURE_SLOTS, ALL_REDUCE)
    assert boards[0].mismatch_in(later + SIGNATURE_SLOTS) is None
    assert f"as call #{later + SIGNATURE_SLOTS} " in boards[1].mismatch_in(later + SIGNATURE_SLOTS)


def test_a_wait_compares_signatures_once_after_a_second(monkeypatch):
    """One store request per call that waits over a second (MISMATCH_LOOK_AFTER_S), none sooner:
    a rank slow to arrive makes its peers wait without anything being wrong."""
    from smddp_lite.backend.transports import refusals

    store = _CountingStore(dist.HashStore())
    board = _group(store, 2)[0]
    clock = [100.0]
    monkeypatch.setattr(refusals.time, "monotonic", lambda: clock[0])
    compares = []
    compare_set = store.compare_set
    store.compare_set = lambda *args: (compares.append(clock[0]), compare_set(*args))[1]
    board.entering(7, ALL_REDUCE)
    for _ in range(200):  # 10 s of 50 ms polls in one call
        assert board.heard(7) is None
        clock[0] += 0.05
    assert len(compares) == 1 and 101.0 <= compares[0] < 101.1, compares
