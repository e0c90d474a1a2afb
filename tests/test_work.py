"""Work handles (backend/work.py, backend/p2p.py): what the futures and waits promise callers
beyond the values, on transports whose calls run on a communication thread (gloo, the
hierarchical transport) and on one that runs them inline (shm)."""

from __future__ import annotations

from datetime import timedelta

import pytest

from . import harness

LAUNCHES = {  # name: launch arguments (2 ranks)
    "shm": {"env": {"SMDDP_TRANSPORT": "shm"}},
    "gloo": {"env": {"SMDDP_TRANSPORT": "gloo"}},
    "hierarchical": {"env": {"SMDDP_ALGORITHM": "hierarchical"}, "hosts_of": 1},
}


@pytest.mark.parametrize("name", sorted(LAUNCHES))
def test_ddp_with_the_powersgd_hook_matches_gloo(name):
    """The hook waits for a second all_reduce inside the first one's future callback. That
    callback runs on the communication thread, which it then waited for: a hang past the group's
    timeout on gloo and the hierarchical transport."""
    results = harness.values(harness.launch("tests.work_programs:ddp_powersgd_parity", 2, timeout=120,
                                            **LAUNCHES[name]))
    for rank, result in enumerate(results):
        assert result["max_diff"] < 1e-6, (rank, result)
        losses = result["losses"]
        assert sum(losses[-3:]) < sum(losses[:3]), result


@pytest.mark.parametrize("name", sorted(LAUNCHES))
def test_tensors_are_freed_when_the_caller_drops_them(name):
    """Each Work's future held the Work through its callback, a reference cycle: every call's
    tensors lived until the garbage collector ran (RSS grew 32 MB per all_reduce of 32 MB in a
    loop), and a send's gloo link stayed open after destroy_process_group."""
    results = harness.values(harness.launch("tests.work_programs:tensors_freed_after_calls", 2, **LAUNCHES[name]))
    for rank, freed in enumerate(results):
        assert freed == {"all_reduce": True, "all_reduce_future": True, "send_recv": True}, (rank, freed)


def _ended_work(tensor):
    from datetime import timedelta

    from smddp_lite.backend.work import SMDDPWork

    work = SMDDPWork("[smddp rank 0/2 host h] all_reduce:", [tensor], timedelta(seconds=5))
    work._finish(None)
    return work


def test_works_python_drops_unasked_are_kept_for_cpp_but_not_without_bound():
    """DDP's Join hands a Work to its C++ reducer and drops it; a Work Python waited for, or
    whose future was asked for, is freed with its tensors at once. Kept ones are bounded."""
    import gc
    import weakref

    import torch

    from smddp_lite.backend import work as work_module

    gc.disable()  # freed by reference counts alone, as in a training loop
    try:
        tensor = torch.ones(3)
        ref, work = weakref.ref(tensor), _ended_work(tensor)
        work.wait()  # Python code's wait: nothing can ask about it later
        del tensor, work
        assert ref() is None

        tensor = torch.ones(3)
        ref, work = weakref.ref(tensor), _ended_work(tensor)
        del tensor, work  # unasked: C++ may still hold it, and calls reach its methods
        kept = [w for w in work_module._ORPHANS if w._outputs[0] is ref()]
        assert ref() is not None and len(kept) == 1
        kept[0].wait(timedelta(0))  # as the reducer: wait() with a timeout, then the future
        assert kept[0].get_future().value()[0] is ref()
        del kept
        assert ref() is None  # asked for its future: let go

        first = weakref.ref(_ended_work(torch.ones(3))._outputs[0])
        for _ in range(work_module._ORPHANS.maxlen):
            _ended_work(torch.ones(3))
        assert first() is None and len(work_module._ORPHANS) == work_module._ORPHANS.maxlen
    finally:
        gc.enable()
        work_module._ORPHANS.clear()


def _queued(runner, record: list, name: str, gate=None):
    """A Work submitted to ``runner`` whose call records (name, thread) after ``gate`` opens."""
    import threading

    from smddp_lite.backend.work import SMDDPWork

    def call() -> None:
        if gate is not None:
            assert gate.wait(10), "the test's gate never opened"
        record.append((name, threading.current_thread()))

    return runner.submit(call, SMDDPWork(name, [], timedelta(seconds=10)))


def test_a_caller_waiting_for_the_next_call_runs_it_itself_and_order_holds():
    """A plain wait() for a call the communication thread has not started, and that is next,
    runs it on the waiting thread (two thread wake-ups less per synchronous call); a call queued
    behind another waits its turn, a wait with a bound of its own and a call nobody waits for run
    on the communication thread, and every call runs once, in submission order."""
    import threading

    from smddp_lite.backend.work import CommThread

    runner = CommThread("test-comm", inline=False)
    me, record = threading.current_thread(), []
    try:
        # the communication thread is parked in a gated call, so nothing below starts early
        gate = threading.Event()
        first = _queued(runner, record, "first", gate)
        while not runner._owner:  # it has taken "first"
            threading.Event().wait(0.001)
        second = _queued(runner, record, "second")
        bounded = _queued(runner, record, "bounded")
        threading.Timer(0.2, gate.set).start()
        second.wait()  # not next while "first" runs: waits for the thread to run it
        bounded.wait(timedelta(seconds=10))  # a bound of its own: left to the thread
        assert [n for n, _ in record] == ["first", "second", "bounded"]
        assert all(t is runner._thread for _, t in record), record

        record.clear()
        mine = _queued(runner, record, "mine")
        mine.wait()
        assert record == [("mine", me)], record

        record.clear()
        unwaited = _queued(runner, record, "unwaited")
        for _ in range(10000):  # up to 10 s
            if unwaited.is_completed():
                break
            threading.Event().wait(0.001)
        assert record == [("unwaited", runner._thread)], record
        assert first.is_completed() and bounded.is_completed()
    finally:
        runner.stop()
    assert not runner._thread.is_alive()


def test_stop_runs_the_calls_still_queued():
    import threading

    from smddp_lite.backend.work import CommThread

    runner = CommThread("test-comm", inline=False)
    record, gate = [], threading.Event()
    works = [_queued(runner, record, "gated", gate)] + [_queued(runner, record, f"call {i}") for i in range(3)]
    threading.Timer(0.2, gate.set).start()
    runner.stop()
    assert [n for n, _ in record] == ["gated", "call 0", "call 1", "call 2"]
    assert all(w.is_completed() for w in works) and not runner._thread.is_alive()


@pytest.mark.parametrize("waits", [False, True], ids=["caller-runs-it", "caller-waits-for-it"])
def test_ctrl_c_in_a_call_raises_keyboard_interrupt(waits):
    """A synchronous call runs on the caller's thread, where SIGINT lands: Ctrl-C must raise
    KeyboardInterrupt within a gloo wait slice, as it did when the caller only waited, and the
    group must refuse later calls (its peers may still be inside the interrupted one). The same
    where the communication thread runs the call and the caller waits for its Work: the kernel
    may hand the signal to that thread, which does not wake the caller's wait (CI saw the caller
    wait for gloo's 30 s timeout once, on a loaded machine, where the thread took a plain call)."""
    results = harness.launch("tests.work_programs:interrupted_call", 2, env={"SMDDP_TRANSPORT": "gloo"}, timeout=60,
                             waits=waits)
    report = results[0].value
    assert report is not None, results[0].output[-3000:]
    assert report["raised"] == "KeyboardInterrupt" and report["seconds"] < 2, report
    refused = report["next_call"]
    assert refused["backend_error"] and "interrupted (KeyboardInterrupt)" in refused["message"], report
