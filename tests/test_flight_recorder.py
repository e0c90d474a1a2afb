"""The flight recorder's dumps, read by torch's own analyzer (torch.distributed.flight_recorder).

Each drill cell runs a job where one rank (1) goes apart from the others at collective 3, lets
every rank that can write its dump without being asked, and runs torch's fr_trace on the folder:
its output must name rank 1 and the call.
"""

from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from . import harness
from .flight_recorder_programs import PREFIX

# torch's analyzer compares every rank with the first dump it loads, in the order the folder
# lists them (ext4 lists by a hash of the name); if that is the culprit's, it names every other
# rank instead. The drill lists the folder in name order (rank 0 first), as tmpfs and most
# listings do, and leaves the analyzer itself as torch ships it.
_ANALYZE = """
import os, sys
walk = os.walk
os.walk = lambda *a, **k: ((root, sorted(dirs), sorted(files)) for root, dirs, files in walk(*a, **k))
from torch.distributed.flight_recorder.fr_trace import main
main(sys.argv[1:])
"""

ON = {"TORCH_FR_BUFFER_SIZE": "2000"}  # torch's default size; smddp's recorder is off unless set
CELLS = {  # transport: (launch options, world size for each case)
    "shm": (dict(env={"SMDDP_TRANSPORT": "shm", **ON}), 2),
    "gloo": (dict(env={"SMDDP_TRANSPORT": "gloo", **ON}), 2),
    "hierarchical": (dict(env={"SMDDP_ALGORITHM": "hierarchical", **ON}, hosts_of=2), 4),
    # mpiexec ends every rank when one dies unless told not to: the survivors must live to dump
    "mpi": (dict(env={"SMDDP_TRANSPORT": "mpi", **ON}, launcher_flags=("-disable-auto-cleanup",)), 2),
}


def analyze(folder: Path, *flags: str) -> str:
    done = subprocess.run([sys.executable, "-c", _ANALYZE, str(folder), *flags], capture_output=True, text=True,
                          timeout=120, cwd=harness.ROOT)
    return done.stdout + done.stderr


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
    dumped = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(PREFIX) and "." not in p.name)
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
    reports = harness.values(harness.launch("tests.flight_recorder_programs:on_demand", 2, dump_dir=str(tmp_path),
                                            env=ON))
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

    # off unless asked: recording costs about 10 us a call in Python (docs/errors.md)
    assert RecorderSettings.from_env({}) == RecorderSettings(buffer_size=0)
    assert RecorderSettings.from_env({"TORCH_FR_BUFFER_SIZE": "2000"}).buffer_size == 2000
    assert RecorderSettings.from_env({"TORCH_NCCL_TRACE_BUFFER_SIZE": "0"}).buffer_size == 0
    said = RecorderSettings.from_env({"TORCH_FR_BUFFER_SIZE": "5", "TORCH_NCCL_TRACE_BUFFER_SIZE": "7",
                                      "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/x/y_", "TORCH_INCLUDE_STACK_TRACE": "0",
                                      "TORCH_INCLUDE_ONLY_ACTIVE": "1"})
    assert said == RecorderSettings(5, "/x/y_", True, False, True)
    with pytest.raises(ValueError, match="TORCH_FR_BUFFER_SIZE"):
        RecorderSettings.from_env({"TORCH_FR_BUFFER_SIZE": "many"})
