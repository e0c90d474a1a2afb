"""The membership layer's decisions in one process: ranks as threads over one HashStore, each
with its own real heartbeat (a thread beats where the store is not a TCPStore).

What the multi-process tests of test_surviving.py cannot set up at will: a side that never
checks in but keeps beating (busy, or cut off from the others but not from the store), and a
replacement whose heartbeat never moves."""

from __future__ import annotations

import contextlib
import os
import threading
import time

import pytest
import torch.distributed as dist

from smddp_lite.membership import generations
from smddp_lite.membership.heartbeat import Heartbeat
from smddp_lite.membership.job_store import job_store

from . import tiers

STALE_S = 0.6


@pytest.fixture
def hearts():
    store = job_store(dist.HashStore(), "0")
    made = [Heartbeat(store, r, STALE_S) for r in range(4)]
    for heart in made:
        heart.watch(range(4))
    yield store, made
    for heart in made:
        heart.stop()


def test_only_a_majority_may_decide_without_the_others():
    old = (0, 1, 2, 3)
    assert generations.may_decide(old, [0, 1, 2])
    assert generations.may_decide(old, [0, 1])  # half, with the lowest id
    assert not generations.may_decide(old, [2, 3])  # half, without it
    assert not generations.may_decide(old, [3])
    assert generations.may_decide((4, 7), [4]) and not generations.may_decide((4, 7), [7])


def _agree_on_a_thread(store, heart, me, generation, deadline_s):
    out = {}
    thread = threading.Thread(target=lambda: out.setdefault("record", generations.agree(
        store, heart, me, (0, 1, 2, 3), generation, 0, 0, deadline_s)), daemon=True)
    thread.start()
    return thread, out


def test_half_with_the_lowest_id_decides_at_the_deadline_and_the_other_half_does_not(hearts):
    store, made = hearts
    # ranks 2 and 3 beat but never check in: past the deadline, 0 and 1 go on without them
    threads = [_agree_on_a_thread(store, made[r], r, 1, 0.3) for r in (0, 1)]
    for thread, out in threads:
        thread.join(10)
        assert out["record"] == ((0, 1), 0)
    # and the other way round, 2 and 3 wait, past their deadline, for a decision of the others
    threads = [_agree_on_a_thread(store, made[r], r, 2, 0.3) for r in (2, 3)]
    time.sleep(1.5)
    assert all(thread.is_alive() for thread, _ in threads), "half a job without the lowest id decided"
    generations.propose(store, 2, (0, 1), 0)
    for thread, out in threads:
        thread.join(10)
        assert out["record"] == ((0, 1), 0)


def test_a_rank_alone_never_decides_while_the_others_beat(hearts):
    store, made = hearts
    thread, out = _agree_on_a_thread(store, made[3], 3, 1, 0.2)
    time.sleep(1.5)
    assert thread.is_alive() and "record" not in out
    made[0].stop(), made[1].stop(), made[2].stop()  # the others stop beating: now it may
    thread.join(10)
    assert out["record"] == ((3,), 0)


def test_a_loss_and_an_admission_at_one_generation_make_one_record(hearts):
    store, made = hearts
    admitted = generations.propose(store, 1, (0, 1, 2, 3, 4), 1)
    assert generations.propose(store, 1, (0, 1, 2), 0) == admitted == ((0, 1, 2, 3, 4), 1)


def test_a_lease_admits_only_replacements_whose_heartbeat_moves(hearts):
    store, made = hearts
    newcomer = Heartbeat(store, 4, STALE_S)
    store.add("beat/5", 1)  # a replacement that beat once and died
    try:
        started = time.monotonic()
        assert generations.lease(store, made[0], [4, 5], wait_s=10) == [4]
        assert time.monotonic() - started < STALE_S + 1.0
    finally:
        newcomer.stop()


def test_a_barrier_ends_once_a_missing_member_stops_beating(hearts):
    store, made = hearts
    made[3].stop()
    with pytest.raises(generations.MembersMissing, match="rank 3 of generation 1 .* stopped beating"):
        generations.barrier(store, made[0], 0, 1, (0, 3), timeout_s=30)


def test_every_connection_to_the_store_gets_the_cut_off_bound():
    """A TCPStore request to a host the network no longer reaches never returns by itself (the
    lab's cut link: tests/test_survival_drill.py). The kernel's TCP_USER_TIMEOUT on each of this
    process's connections to the store ends it; the listening side and other sockets are left."""
    import socket

    from smddp_lite.membership.store_link import _TCP_USER_TIMEOUT, bound_unacknowledged_requests

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    clients = [dist.TCPStore("127.0.0.1", server.port, is_master=False) for _ in range(2)]
    unrelated = socket.create_server(("127.0.0.1", 0))
    try:
        assert bound_unacknowledged_requests(dist.HashStore(), 7.5) == 0  # no connection to bound
        # the server's own client, and both others, wrapped or not
        assert bound_unacknowledged_requests(dist.PrefixStore("job/", clients[0]), 7.5) == 3
        bounds = []
        for fd in map(int, os.listdir("/proc/self/fd")):
            with contextlib.suppress(OSError):
                held = socket.socket(fileno=fd)
                try:
                    if held.family in (socket.AF_INET, socket.AF_INET6) and held.type == socket.SOCK_STREAM:
                        peer = held.getpeername() if not held.getsockopt(socket.SOL_SOCKET,
                                                                         socket.SO_ACCEPTCONN) else None
                        bounds.append((peer and peer[1] == server.port,
                                       held.getsockopt(socket.IPPROTO_TCP, _TCP_USER_TIMEOUT)))
                finally:
                    held.detach()
        assert sorted(b for to_store, b in bounds if to_store) == [7500] * 3
        assert all(b == 0 for to_store, b in bounds if not to_store), bounds
        clients[1].add("still", 1)  # a bounded connection works as before
        assert clients[0].add("still", 0) == 1
    finally:
        unrelated.close()


@tiers.FULL_ONLY
def test_a_heartbeat_whose_store_stops_answering_stops_and_says_why():
    """A store host that acknowledges but never answers (its process stopped): no socket bound
    ends the request, so the heartbeat's watchdog does, after the cut-off time, and the rank
    hears why instead of waiting in the request for good."""
    import signal
    import subprocess
    import sys
    from datetime import timedelta

    from smddp_lite.membership.heartbeat import cut_off_after

    code = ("import sys, time, torch.distributed as d; s = d.TCPStore('127.0.0.1', 0, is_master=True, "
            "wait_for_workers=False); print(s.port, flush=True); time.sleep(300)")
    server = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    stopped, heart = [], None
    try:
        port = int(server.stdout.readline())
        client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
        heart = Heartbeat(job_store(client, "0"), 0, STALE_S, on_stopped=stopped.append)
        os.kill(server.pid, signal.SIGSTOP)
        began = time.monotonic()
        while not stopped and time.monotonic() - began < cut_off_after(STALE_S) + 10:
            time.sleep(0.1)
        took = time.monotonic() - began
        assert stopped and "answered none of this rank's requests" in stopped[0], stopped
        # (counted from the thread's last answered round, which may precede the SIGSTOP by a look)
        assert cut_off_after(STALE_S) - 1 <= took < cut_off_after(STALE_S) + 3, took
        assert not heart.beating()
    finally:
        server.kill()
        server.wait()
        if heart is not None:
            heart.stop()
