"""The store protocol behind refusals (backend/transports/refusals.py), on one in-memory store:
each rank's board is what that rank's transport holds. The multi-process behaviour is in
test_errors.py."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import torch.distributed as dist

from backend.process_group import _own_keys
from backend.transports.refusals import RefusalBoard

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
    from backend.transports import refusals

    board = _group(dist.HashStore(), 1)[0]
    clock = [100.0]
    monkeypatch.setattr(refusals.time, "monotonic", lambda: clock[0])
    looks = []

    class CountingStore:  # the store's answers do not matter here, only how often it is asked
        def check(self, keys):  # a look asks for its call's key and for the latest refused call
            if not looks or looks[-1] != clock[0]:
                looks.append(clock[0])
            return False

    board._store = CountingStore()
    for _ in range(200):  # 10 s of 50 ms polls in one call
        board.heard(7)
        clock[0] += 0.05
    # every poll for the first 5 s, then one a second
    early = [t for t in looks if t - 100 <= 5]
    late = [t for t in looks if t - 100 > 5]
    assert len(early) >= 100
    assert 4 <= len(late) <= 6 and all(b - a >= 0.99 for a, b in zip(late, late[1:])), late
