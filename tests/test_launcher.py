"""``python -m smddp_lite.launch``: the survivors of a lost rank keep training, the launcher
starts a replacement in its place (and only there), and the job ends with the job's status.
The jobs train one epoch with an ElasticSampler: across a loss and a replacement, every sample
is trained on exactly once."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from . import harness, tiers

# from the replacement's start to its first sync done: a bound that catches a wait for a timeout.
# Here torch's import alone takes 3-5 s (two cores, three ranks training); the 5 s goal is
# measured by the lab drill (benchmarks/survival_drill.py), one rank per core
REPLACEMENT_TRAINS_WITHIN_S = 10.0


def _launch(tmp_path: Path, *args: str, steps: int = 40, fault: str = "", timeout: float = 120,
            nproc: int = 3) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "smddp_lite.launch", "--nproc-per-node", str(nproc), *args,
               "-m", "tests.launcher_programs", str(tmp_path), str(steps)] + ([fault] if fault else [])
    return subprocess.run(command, cwd=harness.ROOT, env=harness._base_env(None), capture_output=True, text=True,
                          timeout=timeout)


def _reports(tmp_path: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(tmp_path.glob("*.json"))]


def _ranks_of(tmp_path: Path) -> list[str]:
    found = subprocess.run(["pgrep", "-f", f"tests.launcher_programs {tmp_path}"], capture_output=True, text=True)
    return found.stdout.split()


def _no_rank_left(tmp_path: Path) -> None:
    assert _ranks_of(tmp_path) == [], "ranks outlived their launcher"


def _segments_left(tmp_path: Path) -> list[str]:
    """The /dev/shm segments that this job's ranks made and left. A segment's name holds the pid
    of the rank that made it, and every rank names a samples file after its pid; other jobs on the
    machine (another test beside this one) may hold segments of their own meanwhile."""
    pids = {p.stem for p in tmp_path.glob("*.samples")}
    return [p.name for p in Path("/dev/shm").glob("smddp-*") if p.name.split("-")[2] in pids]


@pytest.mark.parametrize("kind", ["sigkill", pytest.param("exit", marks=tiers.FULL_ONLY),
                                  pytest.param("sigkill:ddp", marks=tiers.FULL_ONLY)])
def test_a_failed_rank_is_replaced_and_the_job_ends_well(kind, tmp_path):
    done = _launch(tmp_path, fault=f"1:5:{kind}")
    assert done.returncode == 0, done.stderr[-4000:]
    assert "starting a replacement" in done.stderr, done.stderr[-4000:]
    reports = _reports(tmp_path)
    assert sorted(r["id"] for r in reports) == [0, 2, 3], reports  # rank 1 lost, id 3 in its place
    checksums = {r["id"]: r["checksums"] for r in reports}
    for r in reports:  # every member's parameters, step by step, from the step it joined on
        assert r["checksums"] == checksums[0][r["first_step"]:], "ranks applied different parameters"
    replacement = next(r for r in reports if r["id"] == 3)
    assert replacement["worlds"] == [3] * len(replacement["worlds"]), replacement
    assert 2 in next(r for r in reports if r["id"] == 0)["worlds"], "the survivors never trained as two"
    trained_after = replacement["first_sync_at"] - replacement["started_at"]
    assert trained_after < REPLACEMENT_TRAINS_WITHIN_S, f"the replacement trained {trained_after:.2f} s after it started"
    trained = [i for p in tmp_path.glob("*.samples") for line in p.read_text().splitlines() for i in json.loads(line)]
    assert sorted(trained) == list(range(40 * 4 * 3)), "the epoch's samples were not each trained on once"
    _no_rank_left(tmp_path)
    assert len(list(tmp_path.glob("*.samples"))) == 4, "a rank made no samples file"
    assert _segments_left(tmp_path) == [], "a segment was left in /dev/shm"


@tiers.FULL_ONLY
def test_without_restarts_the_survivors_finish_and_the_job_succeeds(tmp_path):
    done = _launch(tmp_path, "--max-restarts", "0", fault="1:5:exit", steps=15)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "not replaced (no restart left)" in done.stderr
    assert sorted(r["id"] for r in _reports(tmp_path)) == [0, 2]


def test_a_job_whose_every_rank_fails_ends_with_their_status(tmp_path):
    done = _launch(tmp_path, "--max-restarts", "0", fault="all:start:exit", nproc=2)
    assert done.returncode == 3, done.stderr[-4000:]
    _no_rank_left(tmp_path)


@tiers.FULL_ONLY
def test_below_the_minimum_world_size_the_launcher_ends_the_job(tmp_path):
    done = _launch(tmp_path, "--max-restarts", "0", "--min-world-size", "3", fault="1:5:sigkill", steps=200)
    assert done.returncode == 128 + signal.SIGKILL, done.stderr[-4000:]
    assert "fewer than --min-world-size=3" in done.stderr
    assert _reports(tmp_path) == []  # the survivors were ended, not left to finish
    _no_rank_left(tmp_path)


@tiers.FULL_ONLY
def test_sigterm_to_the_launcher_ends_every_rank(tmp_path):
    command = [sys.executable, "-m", "smddp_lite.launch", "--nproc-per-node", "2", "-m", "tests.launcher_programs",
               str(tmp_path), "1000"]
    launcher = subprocess.Popen(command, cwd=harness.ROOT, env=harness._base_env(None), stderr=subprocess.PIPE,
                                text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(_ranks_of(tmp_path)) < 2:
        time.sleep(0.2)
    time.sleep(3)  # importing torch, and into training
    launcher.send_signal(signal.SIGTERM)
    _, stderr = launcher.communicate(timeout=60)
    assert launcher.returncode == 128 + signal.SIGTERM, stderr[-4000:]
    _no_rank_left(tmp_path)


def test_bad_flags_are_refused_with_what_was_expected():
    done = subprocess.run([sys.executable, "-m", "smddp_lite.launch", "--nproc-per-node", "0", "x.py"],
                          cwd=harness.ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "expected --nproc-per-node >= 1" in done.stderr and "found 0" in done.stderr
