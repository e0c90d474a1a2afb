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
    results = harness.values(harness.launch("tests.programs:ddp_powersgd_parity", 2, timeout=120,
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
    results = harness.values(harness.launch("tests.programs:tensors_freed_after_calls", 2, **LAUNCHES[name]))
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
