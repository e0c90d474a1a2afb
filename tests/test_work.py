"""Work handles (backend/work.py, backend/p2p.py): what the futures and waits promise callers
beyond the values, on transports whose calls run on a communication thread (gloo, the
hierarchical transport) and on one that runs them inline (shm)."""

from __future__ import annotations

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
