"""The lost-rank drill at a small size, in the multi-host lab: 2 simulated hosts x 2 ranks at
1 Gbit/s, one failure of each kind (a rank SIGKILLed, stopped, exiting; the second host's link
down, whose ranks must raise a clear error; two ranks killed at once; a stopped rank let go on,
which must be refused; a replacement dying while it joins; the member sending a replacement
the job's state killed as it sends), each followed by the replacements that each host's
``python -m smddp_lite.launch`` starts (benchmarks/survival_drill.py, whose full run makes 200);
for a plain module, a DistributedDataParallel model and a ``smddp_lite.compile`` model (bfloat16
wire)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from benchmarks.survival_drill import KINDS, RESUME_BOUND_S

from . import harness, tiers


@pytest.mark.skipif(os.geteuid() != 0, reason="the simulated cluster needs root (network namespaces, tc)")
@pytest.mark.parametrize("model", ["module", "ddp", "compiled"])
def test_the_lab_drill_trains_through_each_kind_of_failure(model, tmp_path):
    out = tmp_path / "drill"
    kinds = KINDS[:tiers.size(1, len(KINDS))]  # the quick tier: one rank SIGKILLed
    run = subprocess.run([sys.executable, "-m", "benchmarks.survival_drill", "--failures", str(len(kinds)), "--cycle",
                          "--gap", "5", "--out", str(out)] + [f"--{model}"] * (model != "module"), cwd=harness.ROOT,
                         capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    results = json.loads((tmp_path / "drill.json").read_text())
    summary = results["summary"]
    assert summary["by_kind"] == {kind: int(kind in kinds) for kind in KINDS}, summary
    # after every step, every rank that took it holds the same parameters
    assert results["steps_with_differing_parameters"] == [], results["steps_with_differing_parameters"]
    assert results["steps_with_differing_optimizer_state"] == [], results["steps_with_differing_optimizer_state"]
    assert summary["resumed_within_bound"] == len(kinds), results["failures"]
    # both ranks of a host, two at once, or a rank and the healer of its replacement
    replaced = len(kinds) + ("link" in kinds) + ("pair" in kinds) + ("healer" in kinds)
    # timed from the replacement's SurvivingSync: its imports and model before it are the script's
    assert summary["replacements"] == replaced and summary["joins_within_bound"] == replaced, results["failures"]
    # the host cut off (from the others and the store) ends on an error that says so, not a hang
    assert summary["cut_off_ranks"] == 2 * ("link" in kinds), results["failures"]
    assert summary["cut_off_errors"] == ["HeartbeatStoppedError"] * ("link" in kinds), results["failures"]
    assert results["unplanned_losses"] == [], results.get("outputs")
    assert results["ranks_done"] == 4 and len(results["held_out_loss"]) == 1, results
    assert summary["comebacks_refused"] == int("comeback" in kinds), results["failures"]
    # a replacement that died while it joined: refused (or lost, where admitted first), never a split
    assert len(summary["ghosts"]) == int("ghost" in kinds), results["failures"]
    assert set(summary["ghosts"]) <= {"refused", "lost after its admission", "died before its ticket"}
    # the healer killed as it sends the state: the members went on without it, and both joined
    assert len(summary["healers_resumed_s"]) == int("healer" in kinds), results["failures"]
    assert all(s <= RESUME_BOUND_S for s in summary["healers_resumed_s"]), summary["healers_resumed_s"]
    assert results["launchers_exit"] == [0, 0], results["launchers_exit"]  # the job's status: it ended well
    assert results["agents_hung"] == [] and all(not pids for pids in results["processes_left"].values()), results
    assert all(not names for names in results["shm_left"].values()), results["shm_left"]
