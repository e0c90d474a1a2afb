"""The flight recorder's dumps, read by torch's own analyzer (torch.distributed.flight_recorder).

Each drill cell runs a job where one rank (1) goes apart from the others at collective 3, lets
every rank that can write its dump without being asked, and runs torch's fr_trace on the folder:
its output must name rank 1 and the call.
"""

from __future__ import annotations

import contextlib
import gc
import io
import logging
import os
import pickle
import traceback
from pathlib import Path

import pytest
import torch

from . import harness, tiers
from .flight_recorder_programs import PREFIX

CELLS = {  # transport: (launch options, world size for each case); the recorder is on by default
    "shm": (dict(env={"SMDDP_TRANSPORT": "shm"}), 2),
    "gloo": (dict(env={"SMDDP_TRANSPORT": "gloo"}), 2),
    "hierarchical": (dict(env={"SMDDP_ALGORITHM": "hierarchical"}, hosts_of=2), 4),
    # mpiexec ends every rank when one dies unless told not to: the survivors must live to dump
    "mpi": (dict(env={"SMDDP_TRANSPORT": "mpi"}, launcher_flags=("-disable-auto-cleanup",)), 2),
}


def analyze(folder: Path, *flags: str) -> str:
    """What torch's fr_trace says of the folder: its output and log, or how it failed. Run in this
    process (a fresh Python would import torch again, 2 s each time).

    torch's analyzer compares every rank with the first dump it loads, in the order the folder
    lists them (ext4 lists by a hash of the name); if that is the culprit's, it names every other
    rank instead. Here the folder is listed in name order (rank 0 first), as tmpfs and most
    listings do, and the analyzer itself is left as torch ships it."""
    from torch.distributed.flight_recorder import fr_trace

    said = io.StringIO()
    handler = logging.StreamHandler(said)
    logger = logging.getLogger("Flight Recorder")
    walk, gc_was_on = os.walk, gc.isenabled()  # its loader turns the garbage collector off for good
    os.walk = lambda *a, **k: ((root, sorted(dirs), sorted(files)) for root, dirs, files in walk(*a, **k))
    logger.addHandler(handler)
    try:
        with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
            fr_trace.main([str(folder), *flags])
    except BaseException:  # what a fresh process would have printed as it exited
        said.write(traceback.format_exc())
    finally:
        logger.removeHandler(handler)
        os.walk = walk
        if gc_was_on:
            gc.enable()
    return said.getvalue()


@pytest.mark.parametrize("case", ["skip", "op", "size", "stop", "die"])
@pytest.mark.parametrize("transport", [pytest.param(t, marks=[pytest.mark.mpi] if t == "mpi" else [])
                                       for t in sorted(CELLS)])
def test_the_analyzer_names_the_rank_and_the_call(transport, case, tmp_path):
    options, world = CELLS[transport]
    if case in ("op", "size"):
        world = max(world, 3)  # with two ranks, either one is as much the odd one out
    if transport == "mpi":
        harness.skip_without_mpiexec()
        results = harness.launch_mpi("tests.flight_recorder_programs:drill", world, case=case, culprit=1,
                                     dump_dir=str(tmp_path), timeout=90, **options)
    else:
        results = harness.launch("tests.flight_recorder_programs:drill", world, case=case, culprit=1,
                                 dump_dir=str(tmp_path), timeout=90, **options)
    # every rank still alive dumped, and nothing else is in the folder: no file half written
    dumped = sorted(p.name for p in tmp_path.iterdir())
    alive = [r for r in range(world) if case != "die" or r != 1]
    assert dumped == [f"{PREFIX}{r}" for r in alive], (dumped, [(r.rank, r.value, r.output[-2000:]) for r in results])
    if case == "die":
        said = analyze(tmp_path, "--allow-incomplete-ranks")
        assert "missed FR dumps from ranks ({1})" in said, said
        # the call it left the others in: their last entry, collective 3, started and never completed
        for r in alive:
            last = pickle.loads((tmp_path / f"{PREFIX}{r}").read_bytes())["entries"][-1]
            assert (last["profiling_name"], last["collective_seq_id"], last["state"]) == \
                   ("gloo:all_reduce", 3, "started"), (r, last)
        return
    said = analyze(tmp_path)
    if case in ("skip", "stop"):
        expected = ["Not all ranks joining collective, sequence number: 3", "collective: gloo:all_reduce",
                    "missing ranks: {1}"]
    elif case == "op":
        expected = ["Collective sequence number: 3 has errors", "Culprit rank 1; Error type: COLLECTIVE_TYPE_MISMATCH",
                    "found collective type: 'broadcast'"]
    else:
        expected = ["Collective sequence number: 3 has errors", "Culprit rank 1; Error type: SIZE_OR_SYNTAX_MISMATCH",
                    "found input sizes: '[[9]]'"]
    assert all(words in said for words in expected), said
    assert "Culprit rank 0" not in said and "Culprit rank 2" not in said, said


def test_a_dump_on_demand_holds_what_torch_records(tmp_path):
    """What gloo's _dump_fr_trace holds for the same calls: four entries, sequence ids 1-4, sizes,
    dtypes and states, the group's name, description and ranks; and the analyzer reads it."""
    reports = harness.values(harness.launch("tests.flight_recorder_programs:on_demand", 2, dump_dir=str(tmp_path)))
    for report in reports:
        assert report["names"] == ["gloo:all_reduce"] * 3 + ["gloo:_all_gather_base"], report
        assert report["seq"] == [1, 2, 3, 4] and report["states"] == ["completed"] * 4, report
        assert report["pg_config"] == {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1]"}}, report
        for key in ("collective_seq_id", "p2p_seq_id", "profiling_name", "input_sizes", "output_dtypes", "state",
                    "time_created_ns", "time_discovered_completed_ns", "timeout_ms", "frames", "record_id"):
            assert key in report["keys"], (key, report["keys"])
    said = analyze(tmp_path)
    assert "error" not in said.lower() and "Traceback" not in said, said


def test_the_profiler_shows_each_collective_with_its_bytes():
    (report, _) = harness.values(harness.launch("tests.flight_recorder_programs:profiled_ranges", 2))
    assert report["names"] == ["smddp:all_reduce (in 1024 B, out 1024 B)", "smddp:broadcast (in 64 B, out 64 B)"], report


def test_settings_follow_torchs_variables():
    from smddp_lite.backend.flight_recorder import RecorderSettings

    # on by default, with torch's size
    assert RecorderSettings.from_env({}) == RecorderSettings(buffer_size=2000)
    assert RecorderSettings.from_env({"TORCH_FR_BUFFER_SIZE": "2000"}).buffer_size == 2000
    assert RecorderSettings.from_env({"TORCH_NCCL_TRACE_BUFFER_SIZE": "0"}).buffer_size == 0
    said = RecorderSettings.from_env({"TORCH_FR_BUFFER_SIZE": "5", "TORCH_NCCL_TRACE_BUFFER_SIZE": "7",
                                      "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/x/y_", "TORCH_INCLUDE_STACK_TRACE": "0",
                                      "TORCH_INCLUDE_ONLY_ACTIVE": "1"})
    assert said == RecorderSettings(5, "/x/y_", True, False, True)
    with pytest.raises(ValueError, match="TORCH_FR_BUFFER_SIZE"):
        RecorderSettings.from_env({"TORCH_FR_BUFFER_SIZE": "many"})


class _OneRank:
    """Enough of a process group for a GroupRecorder without a job (no store: no watcher)."""

    group_name, group_desc = "0", "default_pg"

    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return 1


def _recorder(monkeypatch, size: int, **settings):
    """A recorder of a ring of its own (the process's ring is left as it was)."""
    from smddp_lite.backend import flight_recorder

    monkeypatch.setattr(flight_recorder, "_PROCESS", flight_recorder._Process())
    settings = flight_recorder.RecorderSettings(buffer_size=size, dump_on_failure=False, **settings)
    return flight_recorder, flight_recorder.GroupRecorder(settings, None, _OneRank(), [0], 60.0)


def _entries(flight_recorder, **options) -> list[dict]:
    return pickle.loads(flight_recorder.dump(**options))["entries"]


def test_the_ring_keeps_the_last_calls_and_their_states(monkeypatch):
    """A ring of 3 after 5 calls: the last 3, oldest first; a call overwritten before it ran
    leaves the newer entry in its slot as it was."""
    flight_recorder, recorder = _recorder(monkeypatch, 3)
    t = torch.ones(2, 3)
    first = recorder.track(1, "all_reduce", [t], [t], lambda *a: None)  # run after 3 more calls
    for call in (2, 3):
        recorder.track(call, "all_reduce", [t], [t], lambda *a: None)()
    recorder.record_p2p("send", 0, 1, t)
    gathered = torch.ones(6)
    scheduled = recorder.track(4, "all_gather_into_tensor", [gathered, t], [gathered], lambda *a: None)
    first()
    entries = _entries(flight_recorder)
    assert [(e["record_id"], e["profiling_name"], e["collective_seq_id"], e["p2p_seq_id"], e["state"])
            for e in entries] == [(2, "gloo:all_reduce", 3, 0, "completed"), (3, "gloo:send 0->1", 3, 1, "started"),
                                  (4, "gloo:_all_gather_base", 4, 0, "scheduled")]
    assert (entries[2]["input_sizes"], entries[2]["output_sizes"], entries[2]["input_dtypes"]) == \
           ([[2, 3]], [[6]], ["Float"])
    assert entries[1]["time_discovered_started_ns"] == entries[1]["time_created_ns"]
    assert entries[2]["time_discovered_started_ns"] is None and entries[2]["time_discovered_completed_ns"] is None
    assert [e["record_id"] for e in _entries(flight_recorder, only_active=True)] == [3, 4]
    assert recorder.status() == {"last_enqueued_collective": 4, "last_started_collective": 1,
                                 "last_completed_collective": 1}
    scheduled()
    assert _entries(flight_recorder)[2]["state"] == "completed"


def test_a_ring_made_larger_keeps_what_it_held(monkeypatch):
    flight_recorder, recorder = _recorder(monkeypatch, 2)
    t = torch.ones(1)
    for call in (1, 2, 3):
        recorder.track(call, "broadcast", [t], [t], lambda *a: None)()
    flight_recorder._PROCESS.resize(4)
    recorder.track(4, "broadcast", [t], [t], lambda *a: None)
    assert [(e["collective_seq_id"], e["state"]) for e in _entries(flight_recorder)] == \
           [(2, "completed"), (3, "completed"), (4, "scheduled")]


def test_entries_are_nothing_for_the_garbage_collector(monkeypatch):
    """The ring's live entries are tuples the cyclic GC untracks: they cost its full collections
    nothing (objects or dicts per entry were half the recorder's cost per call)."""
    import gc

    flight_recorder, recorder = _recorder(monkeypatch, 8)
    t = torch.ones(4, dtype=torch.bfloat16)
    recorder.track(1, "all_reduce", [t], [t], lambda *a: None)()
    for _ in range(4):  # what every call of these sizes on this thread shares, made once
        gc.collect()
    recorder.track(2, "all_reduce", [t], [t], lambda *a: None)()
    recorder.record_p2p("recv", 0, 1, t)
    gc.collect(0)  # the youngest generation's collection, which comes every 700 new objects
    entries = flight_recorder._PROCESS.ring.entries[1:3]
    assert [e[4] for e in entries] == ["gloo:all_reduce", "gloo:recv 0<-1"], entries
    assert not any(gc.is_tracked(e) for e in entries), [gc.is_tracked(e) for e in entries]


def _caller_of_the_group(recorder, t):
    recorder.track(1, "all_reduce", [t], [t], lambda *a: None)()


def test_stacks_start_at_the_groups_caller_and_follow_torchs_variable(monkeypatch):
    flight_recorder, recorder = _recorder(monkeypatch, 4)
    _caller_of_the_group(recorder, torch.ones(1))
    frames = _entries(flight_recorder)[0]["frames"]
    assert frames[0]["name"] == "_caller_of_the_group" and frames[0]["filename"] == __file__, frames[:2]
    assert frames[1]["name"] == "test_stacks_start_at_the_groups_caller_and_follow_torchs_variable", frames[:2]
    assert _entries(flight_recorder, include_stack_traces=False)[0]["frames"] == []
    flight_recorder, recorder = _recorder(monkeypatch, 4, include_stack_traces=False)  # TORCH_INCLUDE_STACK_TRACE=0
    _caller_of_the_group(recorder, torch.ones(1))
    assert _entries(flight_recorder)[0]["frames"] == []


# A user's job under torchrun where rank 1 skips a call: rank 0's call times out, dumps and
# raises, and torchrun ends rank 1 while its watcher may still be writing its own dump.
_SKIPPING_JOB = """
import os, sys, time
from datetime import timedelta
import torch, torch.distributed as dist
import smddp_lite
os.environ["TORCH_FR_DUMP_TEMP_FILE"] = sys.argv[1]
dist.init_process_group("smddp", timeout=timedelta(seconds=2))
t = torch.ones(8)
dist.all_reduce(t)
dist.all_reduce(t)
if dist.get_rank() == 1:
    time.sleep(60)
dist.all_reduce(t)
"""


@tiers.FULL_ONLY
def test_a_job_ended_by_its_launcher_mid_dump_leaves_only_whole_dumps(tmp_path):
    """Whatever moment torchrun ends rank 1 at, the folder holds whole dumps and nothing else,
    and the analyzer reads it and names the rank that skipped the call."""
    script, folder = tmp_path / "job.py", tmp_path / "dumps"
    script.write_text(_SKIPPING_JOB)
    folder.mkdir()
    run = harness.torchrun([str(script), f"{folder}/trace_"], cwd=tmp_path, timeout=120)
    assert run.returncode != 0, run.stdout + run.stderr
    left = sorted(p.name for p in folder.iterdir())
    assert left in (["trace_0"], ["trace_0", "trace_1"]), (left, run.stderr[-3000:])
    for name in left:
        pickle.loads((folder / name).read_bytes())  # whole
    said = analyze(folder, *(["--allow-incomplete-ranks"] if left == ["trace_0"] else []))
    assert "Traceback" not in said, said
    assert "missing ranks: {1}" in said or "missed FR dumps from ranks ({1})" in said, said
