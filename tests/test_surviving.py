"""SurvivingSync: training goes on among the ranks left when one is lost, on every rank the same.

Each job trains a small model for STEPS steps with torch's default group timeout; one rank fails
at FAULT_STEP (SIGKILLed while it syncs, os._exit, or SIGSTOPped, which only its heartbeat
shows). The survivors must apply the same
parameters after every step (their checksums, bit for bit), equal to a reference computed here
in one process (the average over all ranks before the loss, over the survivors after it; the
interrupted step may be either, as a survivor may have received the full average before the
loss), shrink their world, say so through ``on_change``, resume within the bound after the
fault, and leave no segment in /dev/shm.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from . import harness, tiers
from .surviving_programs import LR, batch, model

# torch's default group timeout, as users keep it: no failure may wait for it
STEPS, FAULT_STEP, GROUP_TIMEOUT_S = 14, 5, 1800.0
# from the failure (a death or a stop) to the survivors' next step: stale_after (2 s) and a
# second, plus half a second for a loaded test machine
RESUME_BOUND_S = 3.5
TRANSPORTS = {  # transport: (ranks, environment, layout)
    "shm": (3, {"SMDDP_TRANSPORT": "shm"}, {}),
    # 4 ranks: a survivor's gloo call can then wait on another survivor that left it
    "gloo": (4, {"SMDDP_TRANSPORT": "gloo"}, {}),
    "hierarchical": (4, {"SMDDP_ALGORITHM": "hierarchical"}, {"hosts_of": 2}),
}
# the training paths SurvivingSync keeps going: the options of surviving_programs.train for each
PATHS = {"module": {}, "ddp": {"ddp": True}, "compiled": {"compiled": True}}
# how close to the float32 reference each comes: the compiled step's bfloat16 wire rounds each
# gradient to 8 bits of mantissa
REL = {"module": 1e-6, "ddp": 1e-6, "compiled": 1e-2}
# the rank each transport loses: on gloo rank 0, the case that once held the survivors in the old
# group's teardown for the group's timeout
VICTIM = {"shm": 1, "gloo": 0, "hierarchical": 1}


def _reference(world: int, lost: int | None, full_average_at_fault: bool = False, joined_at: int | None = None,
               joiner: int | None = None, steps: int = STEPS) -> list[float]:
    """The checksums after each step of a job of ``world`` ranks that loses ``lost`` (or none) at
    FAULT_STEP and, from step ``joined_at``, trains with ``joiner`` too."""
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    sums = []
    for step in range(steps):
        ranks = list(range(world)) if step < FAULT_STEP or (step == FAULT_STEP and full_average_at_fault) else [
            r for r in range(world) if r != lost]
        if joined_at is not None and step >= joined_at:
            ranks.append(joiner)
        grads = []
        for r in ranks:
            net.zero_grad()
            x, y = batch(r, step)
            torch.nn.functional.mse_loss(net(x), y).backward()
            grads.append([p.grad.clone() for p in net.parameters()])
        for i, p in enumerate(net.parameters()):
            total = grads[0][i].clone()
            for g in grads[1:]:
                total += g[i]
            p.grad = total / len(grads)
        optimizer.step()
        sums.append(sum(float(p.detach().double().sum()) for p in net.parameters()))
    return sums


def _run(transport: str, faults: dict, tmp_path: Path, steps: int = STEPS, **kwargs) -> list[harness.RankResult]:
    world, env, layout = TRANSPORTS[transport]
    return harness.launch("tests.surviving_programs:train", world, env=env, timeout=120, **layout, steps=steps,
                          faults=faults, marks=str(tmp_path), group_timeout_s=GROUP_TIMEOUT_S, **kwargs)


@pytest.mark.parametrize("transport", list(TRANSPORTS))
@pytest.mark.parametrize("kind", ["sigkill", "exit", "sigstop"])
def test_survivors_go_on_together_after_a_rank_is_lost(transport, kind, tmp_path):
    _lose_a_rank_and_check(transport, kind, tmp_path)


@pytest.mark.parametrize("transport", list(TRANSPORTS))
@pytest.mark.parametrize("kind", ["sigkill", "exit", "sigstop"])
def test_a_ddp_model_goes_on_after_a_rank_is_lost(transport, kind, tmp_path):
    _lose_a_rank_and_check(transport, kind, tmp_path, ddp=True)


def test_a_rank_that_makes_its_surviving_sync_late_is_waited_for_not_lost(tmp_path):
    """Rank 2 makes its SurvivingSync 2.5 s after the others (past stale_after, 2 s): the others
    watched a counter that had not started and declared it lost before its first step. On a loaded
    machine ranks start seconds apart (the flaky failure of the full tier under a busy process)."""
    results = _run("shm", {}, tmp_path, late={"2": 2.5})
    for r in results:
        assert r.error is None and r.value is not None and "error" not in r.value, (r.rank, r.error, r.value,
                                                                                 r.output[-3000:])
        assert r.value["worlds"] == [3] * STEPS and r.value["changes"] == [], (r.rank, r.value)
    assert results[0].value["checksums"] == results[1].value["checksums"] == results[2].value["checksums"]
    assert results[0].value["checksums"] == pytest.approx(_reference(3, None), rel=1e-6)


@pytest.mark.parametrize("transport", list(TRANSPORTS))
@pytest.mark.parametrize("kind", ["sigkill", "exit", "sigstop"])
def test_a_compiled_model_goes_on_after_a_rank_is_lost(transport, kind, tmp_path):
    """smddp_lite.compile's step with a bfloat16 wire: its reducer keeps each rank's gradients for a
    redo and is regrouped, not compiled again."""
    _lose_a_rank_and_check(transport, kind, tmp_path, compiled=True)


@tiers.FULL_ONLY
def test_a_ddp_model_with_gradients_as_bucket_views_goes_on(tmp_path):
    # the gradients are DDP's bucket, which the average overwrites: the hook keeps a copy for a redo
    _lose_a_rank_and_check("shm", "sigkill", tmp_path, ddp=True, bucket_view=True)


def _replacement_result(marks: Path, n: int, timeout_s: float = 60.0) -> dict:
    """What replacement ``n`` wrote once it ended, waiting up to ``timeout_s`` for it."""
    path, deadline = marks / f"replacement-{n}.json", time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"replacement {n} wrote no result within {timeout_s:g} s"
        time.sleep(0.1)
    return json.loads(path.read_text())


def _lose_a_rank_and_check(transport: str, kind: str, tmp_path: Path, **kwargs) -> None:
    victim = VICTIM[transport]
    world = TRANSPORTS[transport][0]
    results = _run(transport, {str(victim): [kind, FAULT_STEP]}, tmp_path, **kwargs)
    survivors = [r for r in results if r.rank != victim]
    for r in survivors:
        assert r.error is None and r.value is not None, (r.rank, r.error, r.output[-3000:])
        assert "error" not in r.value, (r.rank, r.value, r.output[-3000:])  # SurvivingSync gave this rank up
    values = [r.value for r in survivors]
    checksums = values[0]["checksums"]
    assert len(checksums) == STEPS
    for v in values[1:]:
        assert v["checksums"] == checksums, "survivors applied different parameters"
    references = [_reference(world, victim, full) for full in (True, False)]
    rel = REL["compiled" if kwargs.get("compiled") else "module"]
    assert any(checksums == pytest.approx(ref, rel=rel) for ref in references), (checksums, references)
    fault_at = float((tmp_path / f"fault-{victim}").read_text())
    members = [r for r in range(world) if r != victim]
    for v in values:
        assert v["worlds"] == [world] * FAULT_STEP + [world - 1] * (STEPS - FAULT_STEP)
        (change,) = v["changes"]
        assert (change["lost"], change["members"], change["world_size"]) == ([victim], members, world - 1)
        assert change["rank"] == members.index(v["first_rank"])
        assert change["at"] - fault_at < RESUME_BOUND_S, f"resumed {change['at'] - fault_at:.2f} s after the fault"
    assert harness.segments_left_by(results) == [], "a segment was left in /dev/shm"


@tiers.FULL_ONLY
@pytest.mark.parametrize("path", PATHS)
def test_a_rank_that_comes_back_after_being_declared_lost_is_refused(path, tmp_path):
    results = _run("shm", {"1": ["sigstop_resume", FAULT_STEP]}, tmp_path, **PATHS[path])
    back = results[1]
    assert back.value is not None, (back.error, back.output[-3000:])
    assert back.value["error"] == "RankDeclaredLostError", back.value
    assert "declared this rank lost" in back.value["message"] and "cannot rejoin" in back.value["message"]
    for r in (results[0], results[2]):
        assert r.value is not None and len(r.value["checksums"]) == STEPS, (r.rank, r.error, r.output[-3000:])
        assert r.value["checksums"] == results[0].value["checksums"]


@pytest.mark.parametrize("path", PATHS)
def test_a_rank_lost_after_its_average_arrived_never_applies_the_step(path, tmp_path):
    """Rank 1 receives its step's average, then stops before the step commits; the others redo
    the step without it. Let go on, it used to apply that step (an average no live rank applied)
    and run the user's code on it until its next sync() refused it. Now it never applies it."""
    results = _run("shm", {"1": ["sigstop_resume_before_commit", FAULT_STEP]}, tmp_path, **PATHS[path])
    back, survivors = results[1], (results[0], results[2])
    assert back.value is not None and back.value["error"] == "RankDeclaredLostError", (back.error, back.value)
    for r in survivors:
        assert r.value is not None and "error" not in r.value, (r.rank, r.error, r.output[-3000:])
        assert r.value["checksums"] == results[0].value["checksums"]
        assert r.value["worlds"] == [3] * FAULT_STEP + [2] * (STEPS - FAULT_STEP)
    assert results[0].value["checksums"] == pytest.approx(_reference(3, 1), rel=REL[path])
    assert back.value["checksums"] == results[0].value["checksums"][:FAULT_STEP], "it applied the step it lost"


@tiers.FULL_ONLY
def test_a_rank_whose_heartbeat_stopped_raises_and_the_others_go_on(tmp_path):
    """The process that beats rank 1's heartbeat is killed: the rank must not train on unheard
    (the others drop it once its counter stands still), so its sync() raises; the others declare
    it lost and go on together."""
    results = _run("shm", {"1": ["heartbeat_dies", FAULT_STEP]}, tmp_path)
    stopped = results[1]
    assert stopped.value is not None, (stopped.error, stopped.output[-3000:])
    assert stopped.value["error"] == "HeartbeatStoppedError", stopped.value
    assert "heartbeat stopped" in stopped.value["message"] and "cannot rejoin" in stopped.value["message"]
    assert len(stopped.value["checksums"]) == FAULT_STEP
    for r in (results[0], results[2]):
        assert r.value is not None and "error" not in r.value, (r.rank, r.error, r.output[-3000:])
        assert r.value["checksums"] == results[0].value["checksums"] and len(r.value["checksums"]) == STEPS
        assert r.value["worlds"] == [3] * FAULT_STEP + [2] * (STEPS - FAULT_STEP), r.value["worlds"]


@pytest.mark.parametrize("path", PATHS)
def test_a_rank_that_holds_the_gil_for_seconds_keeps_its_heartbeat(path, tmp_path):
    """Rank 1 spends 6 s (three times stale_after) in a C call that holds the GIL, so no thread
    of it runs: its heartbeat, beaten by a process of its own, goes on, and no rank is lost."""
    results = _run("shm", {"1": ["holds_gil", FAULT_STEP]}, tmp_path, **PATHS[path])
    for r in results:
        assert r.value is not None and "error" not in r.value, (r.rank, r.error, r.output[-3000:])
        assert r.value["changes"] == [] and r.value["worlds"] == [3] * STEPS, (r.rank, r.value)
        assert r.value["checksums"] == results[0].value["checksums"]
    reference = _reference(3, None)
    assert results[0].value["checksums"] == pytest.approx(reference, rel=max(REL[path], 1e-5))


@tiers.FULL_ONLY
@pytest.mark.parametrize("path", PATHS)
def test_too_few_ranks_left_stops_every_survivor_with_a_clear_error(path, tmp_path):
    results = _run("shm", {"1": ["exit", FAULT_STEP]}, tmp_path, min_world_size=3, **PATHS[path])
    for r in (results[0], results[2]):
        assert r.value is not None, (r.rank, r.error, r.output[-3000:])
        assert r.value["error"] == "TooFewRanksError", r.value
        assert "fewer than min_world_size=3" in r.value["message"] and "rank 1" in r.value["message"]
        assert len(r.value["checksums"]) == FAULT_STEP


@tiers.FULL_ONLY
@pytest.mark.parametrize("path", PATHS)
def test_without_a_loss_it_averages_as_ddp_does(path, tmp_path):
    results = _run("shm", {}, tmp_path, **PATHS[path])
    reference = _reference(3, None)
    for r in results:
        assert r.value is not None, (r.rank, r.error, r.output[-3000:])
        assert r.value["changes"] == [] and r.value["worlds"] == [3] * STEPS
        assert r.value["checksums"] == pytest.approx(reference, rel=REL[path])


REPLACEMENT_BOUND_S = 10.0  # from the replacement's start to its first sync done
# the steps stand for compute (STEP_S each), so that the job still trains when the replacement,
# which starts a Python process and imports torch, asks to join
REPLACE_STEPS, STEP_S = 60, 0.25


@tiers.FULL_ONLY
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("transport", ["shm", "hierarchical"])
def test_a_replacement_joins_and_the_group_grows_back(transport, path, tmp_path):
    world = TRANSPORTS[transport][0]
    results = _run(transport, {"1": ["sigkill", FAULT_STEP]}, tmp_path, steps=REPLACE_STEPS, replace=True,
                   step_s=STEP_S, **PATHS[path])
    survivors = [r for r in results if r.rank != 1]
    for r in survivors:
        assert r.error is None and r.value is not None, (r.rank, r.error, r.output[-3000:])
    joiner_file = tmp_path / "replacement-0.json"
    assert joiner_file.exists(), [r.output[-3000:] for r in survivors]
    joiner = json.loads(joiner_file.read_text())
    assert joiner["id"] == world  # ids go on from the first world size
    checksums = survivors[0].value["checksums"]
    for r in survivors:
        assert r.value["checksums"] == checksums, "survivors applied different parameters"
        loss, join = r.value["changes"]
        assert loss["lost"] == [1] and join["joined"] == [world] and join["world_size"] == world
        assert r.value["worlds"][join["step"]:] == [world] * (REPLACE_STEPS - join["step"])
    joined_at = joiner["first_step"]
    assert joiner["checksums"] == checksums[joined_at:], "the replacement applied different parameters"
    assert joiner["worlds"] == [world] * (REPLACE_STEPS - joined_at)
    references = [_reference(world, 1, full, joined_at, world, REPLACE_STEPS) for full in (True, False)]
    assert any(checksums == pytest.approx(ref, rel=REL[path]) for ref in references), (checksums, references)
    started = float((tmp_path / "replacement-0-started").read_text())
    assert joiner["first_sync_at"] - started < REPLACEMENT_BOUND_S, joiner["first_sync_at"] - started
    assert harness.segments_left_by(results) == [], "a segment was left in /dev/shm"


@pytest.mark.parametrize("path", PATHS)
def test_a_replacement_that_dies_after_taking_its_ticket_is_never_admitted(path, tmp_path):
    """A replacement dies once it took its ticket and beat: its ticket counted until the members
    admitted a ghost and declared it lost seconds later. A ticket is now leased by the newcomer's
    own heartbeat: the ghost is refused, never a member, and the next replacement joins."""
    results = _run("shm", {}, tmp_path, steps=REPLACE_STEPS, step_s=STEP_S, **PATHS[path],
                   starts={"1": "ghost", "16": "replacement"})
    for r in results:
        assert r.error is None and r.value is not None and "error" not in r.value, (r.rank, r.error, r.output[-3000:])
    ghost = int((tmp_path / "replacement-0-ticket").read_text())
    assert ghost == 3
    joiner = json.loads((tmp_path / "replacement-1.json").read_text())
    assert joiner["id"] == 4
    checksums = results[0].value["checksums"]
    for r in results:
        assert r.value["checksums"] == checksums, "members applied different parameters"
        changes = r.value["changes"]
        assert all(ghost not in c["members"] and not c["lost"] for c in changes), changes
        assert [c["joined"] for c in changes if c["joined"]] == [[4]], changes
    assert "refused replacement 3" in results[0].output, results[0].output[-3000:]  # rank 0 decides admissions
    joined_at = joiner["first_step"]
    assert joiner["checksums"] == checksums[joined_at:], "the replacement applied different parameters"
    assert results[0].value["worlds"] == [3] * joined_at + [4] * (REPLACE_STEPS - joined_at)
    reference = _reference(3, None, joined_at=joined_at, joiner=4, steps=REPLACE_STEPS)
    assert checksums == pytest.approx(reference, rel=REL[path])


@pytest.mark.parametrize("path", PATHS)
def test_the_healer_killed_while_it_sends_the_state_ends_no_job(path, tmp_path):
    """Rank 0 dies half-way through sending a replacement the job's state. The others used to wait
    for it in the new group's rendezvous until they failed, and the replacement for good. Now
    the members left and the replacement agree on the next generation, and the new rank 0 sends
    the state again, to the replacement only."""
    results = _run("shm", {"0": ["dies_healing", 0]}, tmp_path, steps=REPLACE_STEPS, step_s=STEP_S, **PATHS[path],
                   starts={"1": "replacement"})
    survivors = results[1:]
    for r in survivors:
        assert r.error is None and r.value is not None and "error" not in r.value, (r.rank, r.error, r.output[-3000:])
    assert (tmp_path / "fault-0").exists(), "rank 0 never began to send the state"
    # its starter, rank 0, died: no one waits for it, so it may still be writing when the others end
    joiner = _replacement_result(tmp_path, 0)
    checksums = survivors[0].value["checksums"]
    joined_at = joiner["first_step"]
    for r in survivors:
        assert r.value["checksums"] == checksums, "members applied different parameters"
        # one change, or two where the members' part of the admission ended before rank 0 died
        assert [(c["lost"], c["joined"], c["members"]) for c in r.value["changes"]] in (
            [([0], [3], [1, 2, 3])], [([], [3], [0, 1, 2, 3]), ([0], [], [1, 2, 3])]), r.value["changes"]
        assert set(r.value["worlds"]) <= {3, 4} and r.value["worlds"][-1] == 3
    assert joiner["checksums"] == checksums[joined_at:], "the replacement applied different parameters"
    assert [(c["joined"], c["members"]) for c in joiner["changes"]] == [([3], [1, 2, 3])]


def test_a_replacement_compiled_otherwise_ends_saying_why_and_the_job_goes_on(tmp_path):
    """A replacement compiled with another wire than the job's: its collectives would not meet
    the members', and the mismatch would end every rank. It compares the job's bucket layout
    with its own once it received the state, ends saying why, and the others go on."""
    results = _run("shm", {}, tmp_path, steps=REPLACE_STEPS, step_s=STEP_S, compiled=True, starts={"1": "odd"})
    for r in results:
        assert r.error is None and r.value is not None and "error" not in r.value, (r.rank, r.error, r.output[-3000:])
        assert r.value["checksums"] == results[0].value["checksums"], "members applied different parameters"
        assert r.value["worlds"][-1] == 3, r.value["worlds"]
    said = _replacement_result(tmp_path, 0)["error"]
    assert "other buckets than the job's ranks" in said and "bfloat16 wire" in said and "float16 wire" in said, said


@tiers.FULL_ONLY
def test_ddp_with_it_trains_as_ddp_alone_buffers_included():
    # rank 0's BatchNorm statistics reach the others in the hooks' control call, not DDP's broadcast
    for r in harness.launch("tests.surviving_programs:ddp_beside_ddp", 3, env={"SMDDP_TRANSPORT": "shm"},
                            timeout=120, steps=8):
        assert r.value is not None, (r.rank, r.error, r.output[-3000:])
        assert r.value["params"] < 1e-5 and r.value["buffers"] < 1e-5, r.value


def test_a_replacement_receives_parameters_buffers_and_optimizer_state_as_held():
    """The state a healer sends (one flat per dtype, peer to peer): AdamW's moments and step
    counts, three dtypes of parameters and buffers; the next step is then the same on both."""
    sender, receiver = harness.launch("tests.surviving_programs:state_transfer", 2, env={"SMDDP_TRANSPORT": "shm"},
                                      timeout=120)
    for r in (sender, receiver):
        assert r.value is not None, (r.rank, r.error, r.output[-3000:])
    assert sender.value["dtypes"] == ["torch.float32", "torch.float64", "torch.int64"]
    assert receiver.value["extras"] == {"step": 3, "sampler": None}
    for part in ("params", "buffers", "optimizer"):
        assert receiver.value[part] == sender.value[part], part


def test_a_compiled_step_without_sync_is_refused_not_applied_to_local_gradients():
    """Under SurvivingSync the compiled model's averages reach .grad at sync(): a step without it
    would apply each rank's own gradients and the ranks would drift apart, with no error."""
    for r in harness.launch("tests.surviving_programs:step_without_sync", 2, env={"SMDDP_TRANSPORT": "shm"},
                            timeout=120):
        assert r.value is not None, (r.rank, r.error, r.output[-3000:])
        assert "without SurvivingSync's sync()" in r.value["said"] and "Call sync() after backward()" in r.value[
            "said"], r.value
        assert not r.value["moved"], "the step was applied to the rank's own gradients"


def test_what_cannot_survive_is_refused_with_the_reason():
    (said,) = {json.dumps(r.value, sort_keys=True) if r.value else r.error
               for r in harness.launch("tests.surviving_programs:refusals", 2, timeout=120)}
    said = json.loads(said)
    assert "find_unused_parameters=True" in said["unused"] and said["unused"].startswith("ValueError"), said
    assert "subgroup" in said["subgroup"], said
    assert "already has a comm hook (allreduce_hook)" in said["hook"], said
    assert "shard_optimizer_state=True" in said["sharded"] and said["sharded"].startswith("ValueError"), said
    assert "int8 wire" in said["8-bit"] and "wire_dtype=torch.bfloat16" in said["8-bit"], said
    assert "FSDP model" in said["fsdp"], said


@pytest.mark.parametrize("how", ["close", "exit"])
def test_a_replacement_started_after_the_job_finished_ends_at_once_saying_why(tmp_path, how):
    """A member's close(), or its process's end without an error, marks the job finished in the
    store; a replacement started then exits within seconds with JobFinishedError, instead of
    waiting the group's timeout to be admitted by ranks that no longer sync."""
    out = tmp_path / "replacement.json"
    run = harness.torchrun(["-m", "tests.surviving_after_the_end", str(out), *(["--close"] if how == "close" else [])],
                           cwd=harness.ROOT, timeout=180)
    assert run.returncode == 0, run.stdout + run.stderr
    seen = json.loads(out.read_text())
    assert seen["marked"] is not None and seen["marked"][0] == 1, seen  # rank 1 marked it, after 3 syncs
    assert seen["returncode"] != 0 and seen["seconds"] < 10, seen
    assert "JobFinishedError" in seen["said"] and "has finished" in seen["said"], seen["said"]
    assert "start a new job" in seen["said"], seen["said"]
