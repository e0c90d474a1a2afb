"""docker/entrypoint.py, the image's PID 1, run as a real process without Docker: exit status,
signal forwarding and the grace period, reaping as PID 1 of a PID namespace of its own
(``unshare``), and the MPI worker watch (unit tests on a fake clock, and one run of ``train``).

Every process a test starts is ended when the test ends, passed or not; the deadlines catch
hangs and time nothing, so a loaded machine only makes the tests slower.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ENTRYPOINT = ROOT / "docker" / "entrypoint.py"
DEADLINE_S = 60.0  # for anything a test waits on: to catch a hang, not to time anything

# A process of the tree under the entry point: handles SIGTERM (writes a marker, exits 0) or
# ignores it, writes its pid once ready, and ends by itself after 120 s should all else fail.
_GRANDCHILD = """
import os, signal, sys, time
marker, pid_file, mode = sys.argv[1:4]
if "own-session" in mode:  # as the ranks that sshd starts on a worker host
    os.setsid()
def on_term(signum, frame):
    with open(marker, "w") as f:
        f.write("SIGTERM")
    os._exit(0)
signal.signal(signal.SIGTERM, signal.SIG_IGN if "ignore" in mode else on_term)
with open(pid_file + ".part", "w") as f:
    f.write(str(os.getpid()))
os.replace(pid_file + ".part", pid_file)
end = time.monotonic() + 120
while time.monotonic() < end:
    time.sleep(0.1)
"""

# Run as the command under a namespace's PID 1: leaves an orphan that exits at once, waits for
# it to be reaped, and reports what it saw, with every zombie of the namespace.
_REAP_CHECK = """
import json, os, subprocess, time
def state(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return fields[0], int(fields[1])
orphan = int(subprocess.run(["sh", "-c", "sleep 0.2 & echo $!"], capture_output=True, text=True).stdout)
first_seen = state(orphan)
end = time.monotonic() + 20
while state(orphan) is not None and time.monotonic() < end:
    time.sleep(0.05)
zombies = [pid for pid in os.listdir("/proc") if pid.isdigit() and (state(pid) or ("",))[0] == "Z"]
print(json.dumps({"orphan": orphan, "first_seen": first_seen, "left": state(orphan), "zombies": zombies}))
"""


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, session) of a process; None when there is none."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return fields[0], int(fields[1]), int(fields[4])


def _alive(pid: int) -> bool:
    """Running, not a zombie waiting for whichever parent it has now."""
    stat = _stat(pid)
    return stat is not None and stat[0] not in "ZX"


def _cmdline(pid: int) -> bytes | None:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return None


def _children(pid: int) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            stat = _stat(int(name))
            if stat is not None and stat[1] == pid:
                found.append(int(name))
    return found


def _wait_for(condition, what: str, timeout: float = DEADLINE_S) -> None:
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            pytest.fail(f"no {what} within {timeout:g} s")
        time.sleep(0.05)


def _read_pid(path: Path) -> int:
    _wait_for(path.exists, f"pid file {path.name}")
    return int(path.read_text())


class _Started:
    """The processes a test started, ended at its end, passed or not: each entry point (SIGTERM
    first, which it passes on; then SIGKILL), the sessions it and its command lead, and the pids
    noted along the way, each only while it is still the process that was noted."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []
        self.pids: list[tuple[int, bytes]] = []

    def popen(self, args: list[str], env: dict[str, str]) -> subprocess.Popen:
        proc = subprocess.Popen(args, env=env, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        self.procs.append(proc)
        return proc

    def note(self, pid: int) -> None:
        cmdline = _cmdline(pid)
        if cmdline is not None:
            self.pids.append((pid, cmdline))

    def end_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                # its own session, and its command's (outside PID 1 the command leads one)
                sessions = {proc.pid, *_children(proc.pid)}
                for name in os.listdir("/proc"):
                    stat = _stat(int(name)) if name.isdigit() else None
                    if stat is not None and stat[2] in sessions and int(name) != proc.pid:
                        self.note(int(name))
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=20)
        for pid, cmdline in self.pids:
            if _alive(pid) and _cmdline(pid) == cmdline:
                os.kill(pid, signal.SIGKILL)
        for proc in self.procs:  # the tree may hold these open: no reading to their end here
            proc.stdout.close()
            proc.stderr.close()


@pytest.fixture
def started():
    tracker = _Started()
    try:
        yield tracker
    finally:
        tracker.end_all()


@pytest.fixture
def env(tmp_path):
    """The environment of an entry point: none of the caller's SMDDP_/SageMaker settings, a short
    grace period, and the done files and /opt/ml of this test's own."""
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("SMDDP_", "SAGEMAKER_")) and k != "ENTRYPOINT_DONE_FILE_PREFIX"}
    clean.update(SMDDP_STOP_GRACE_S="5", SAGEMAKER_BASE_DIR=str(tmp_path / "opt_ml"),
                 ENTRYPOINT_DONE_FILE_PREFIX=str(tmp_path / "tmp" / "done."))
    return clean


def _entrypoint(*command: str) -> list[str]:
    return [sys.executable, str(ENTRYPOINT), *command]


def _finish(proc: subprocess.Popen) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=DEADLINE_S)
    return proc.returncode, out, err


# --- exit status -------------------------------------------------------------------------------

def test_exit_status_is_the_commands(started, env):
    code, out, err = _finish(started.popen(_entrypoint("sh", "-c", "echo hi; exit 3"), env))
    assert (code, out) == (3, "hi\n"), err


def test_a_command_ended_by_a_signal_gives_128_plus_it(started, env):
    code, _, err = _finish(started.popen(_entrypoint("sh", "-c", "kill -TERM $$"), env))
    assert code == 128 + signal.SIGTERM, err


def test_a_missing_command_gives_127_and_says_so(started, env):
    code, _, err = _finish(started.popen(_entrypoint("no-such-command-for-the-entrypoint"), env))
    assert code == 127
    assert "'no-such-command-for-the-entrypoint' not found on PATH" in err


def test_no_command_gives_2_and_says_so(started, env):
    code, _, err = _finish(started.popen(_entrypoint(), env))
    assert code == 2
    assert "no command given" in err


@pytest.mark.parametrize("name", ["SMDDP_STOP_GRACE_S", "SMDDP_MPI_DONE_WAIT_S"])
def test_a_setting_that_is_no_number_of_seconds_gives_2_and_says_so(started, env, tmp_path, name):
    marker = tmp_path / "ran"
    command = ["train"] if "MPI" in name else ["touch", str(marker)]  # the watch's setting is read for train
    code, _, err = _finish(started.popen(_entrypoint(*command), dict(env, **{name: "15s"})))
    assert code == 2, err
    assert f"{name}='15s' is not a number of seconds; expected a number >= 0" in err
    assert not marker.exists()  # refused before the command started


# --- signals -----------------------------------------------------------------------------------

def _tree(tmp_path: Path, mode: str, shell: str = '"$0" "$1" "$2" "$3" "$4" & wait') -> list[str]:
    """A command of two levels: sh, and under it a python grandchild (``_GRANDCHILD``)."""
    script = tmp_path / "grandchild.py"
    script.write_text(_GRANDCHILD)
    return ["sh", "-c", shell, sys.executable, str(script), str(tmp_path / "marker"), str(tmp_path / "pid"), mode]


def _start_tree(started: _Started, tmp_path: Path, env, mode: str, **shell) -> tuple[subprocess.Popen, int]:
    proc = started.popen(_entrypoint(*_tree(tmp_path, mode, **shell)), env)
    grandchild = _read_pid(tmp_path / "pid")
    started.note(grandchild)
    stat = _stat(grandchild)
    if stat is not None:
        started.note(stat[1])  # sh
    return proc, grandchild


def _stop_reaches_the_grandchild(started, env, tmp_path, signum):
    proc, grandchild = _start_tree(started, tmp_path, env, "handle")
    proc.send_signal(signum)
    code, _, err = _finish(proc)
    # the tree gets SIGTERM for either; sh ends by it, and the entry point reports that
    assert code == 128 + signal.SIGTERM, err
    _wait_for((tmp_path / "marker").exists, "marker from the grandchild's SIGTERM handler")
    assert (tmp_path / "marker").read_text() == "SIGTERM"
    _wait_for(lambda: not _alive(grandchild), "end of the grandchild")


def test_sigterm_reaches_the_commands_children(started, env, tmp_path):
    _stop_reaches_the_grandchild(started, env, tmp_path, signal.SIGTERM)


def test_sigint_reaches_the_commands_children_as_sigterm(started, env, tmp_path):
    _stop_reaches_the_grandchild(started, env, tmp_path, signal.SIGINT)


def test_what_ignores_sigterm_is_killed_after_the_grace_period(started, env, tmp_path):
    env["SMDDP_STOP_GRACE_S"] = "1"
    proc, grandchild = _start_tree(started, tmp_path, env, "ignore",
                                   shell='trap "" TERM; "$0" "$1" "$2" "$3" "$4" & wait')
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    code, _, err = _finish(proc)
    assert code == 128 + signal.SIGKILL, err
    assert time.monotonic() - sent >= 0.9, "killed before the grace period"
    _wait_for(lambda: not _alive(grandchild), "end of the grandchild that ignores SIGTERM")
    assert not (tmp_path / "marker").exists()


# --- as PID 1 ----------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _unshare_problem() -> str | None:
    unshare = shutil.which("unshare")
    if unshare is None:
        return "no unshare (util-linux) on PATH"
    try:
        done = subprocess.run([unshare, "--pid", "--fork", "--mount-proc", "--kill-child", "true"],
                              capture_output=True, text=True, timeout=DEADLINE_S)
    except subprocess.TimeoutExpired:
        return "unshare --pid --fork --mount-proc true did not end"
    if done.returncode != 0:
        return f"unshare --pid --fork --mount-proc fails here: {done.stderr.strip()}"
    return None


def _as_pid_1(*command: str) -> list[str]:
    """The entry point as PID 1 of a PID namespace of its own, with that namespace's /proc;
    --kill-child ends the namespace, and so everything in it, if unshare is killed."""
    problem = _unshare_problem()
    if problem is not None:
        pytest.skip(problem)
    return ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", *_entrypoint(*command)]


def test_as_pid_1_it_reaps_orphans(started, env, tmp_path):
    script = tmp_path / "reap_check.py"
    script.write_text(_REAP_CHECK)
    code, out, err = _finish(started.popen(_as_pid_1(sys.executable, str(script)), env))
    assert code == 0, err
    seen = json.loads(out)
    assert seen["first_seen"] is None or seen["first_seen"][1] == 1, f"the orphan was not PID 1's: {seen}"
    assert seen["left"] is None, f"the orphan was not reaped: {seen}"
    assert seen["zombies"] == [], seen


def test_as_pid_1_sigterm_reaches_other_sessions(started, env, tmp_path):
    proc = started.popen(_as_pid_1(*_tree(tmp_path, "handle own-session")), env)
    _read_pid(tmp_path / "pid")  # the namespace's own pid: nothing to note, the namespace ends with proc
    (pid_1,) = _children(proc.pid)
    proc_1 = _cmdline(pid_1)
    assert proc_1 is not None and str(ENTRYPOINT).encode() in proc_1
    os.kill(pid_1, signal.SIGTERM)
    code, _, err = _finish(proc)
    assert code == 128 + signal.SIGTERM, err
    _wait_for((tmp_path / "marker").exists, "marker from the grandchild's SIGTERM handler")


def test_as_pid_1_what_the_command_leaves_gets_sigterm(started, env, tmp_path):
    proc = started.popen(_as_pid_1(*_tree(tmp_path, "handle own-session",
                                          shell='"$0" "$1" "$2" "$3" "$4" & while [ ! -e "$3" ]; do sleep 0.05; done')),
                         env)
    code, _, err = _finish(proc)
    assert code == 0, err
    # a SIGKILL from the namespace's end would leave no marker
    assert (tmp_path / "marker").read_text() == "SIGTERM"


# --- the MPI worker watch ----------------------------------------------------------------------

@pytest.fixture
def entrypoint(monkeypatch, tmp_path):
    """docker/entrypoint.py as a module, its done files in tmp_path/tmp and Open MPI's daemon
    running as ``daemon["runs"]`` says."""
    spec = importlib.util.spec_from_file_location("smddp_entrypoint_under_test", ENTRYPOINT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "DONE_FILE_PREFIX", str(tmp_path / "tmp" / "done."))
    daemon = {"runs": False}
    monkeypatch.setattr(module.MpiWorkerWatch, "_daemon_runs", staticmethod(lambda: daemon["runs"]))
    module.daemon = daemon
    monkeypatch.delenv("SMDDP_MPI_DONE_WAIT_S", raising=False)
    monkeypatch.setenv("SAGEMAKER_BASE_DIR", str(tmp_path / "opt_ml"))
    return module


def _write_resourceconfig(base: Path, hosts: list[str], current: str) -> None:
    config = base / "input" / "config"
    config.mkdir(parents=True, exist_ok=True)
    (config / "resourceconfig.json").write_text(json.dumps({"current_host": current, "hosts": hosts}))


def test_watch_fails_only_after_the_wait(entrypoint, tmp_path):
    watch = entrypoint.MpiWorkerWatch(entrypoint.mpi_done_wait_s(2), 2)
    assert watch.wait_s == 15
    entrypoint.daemon["runs"] = True
    assert watch.failure(100.0) is None
    entrypoint.daemon["runs"] = False
    assert watch.failure(101.0) is None  # the daemon is gone from here on
    assert watch.failure(116.0) is None
    reason = watch.failure(116.5)
    assert reason is not None
    assert "ended without success" in reason
    assert f"{tmp_path / 'tmp' / 'done.'}<host> within 15 s" in reason
    assert "the job's 2 hosts" in reason and "found none 16 s after" in reason
    assert "SMDDP_MPI_DONE_WAIT_S" in reason and "/opt/ml/output/failure" in reason


def test_watch_waits_longer_for_more_hosts(entrypoint, tmp_path, monkeypatch):
    waits = [entrypoint.mpi_done_wait_s(n) for n in range(2, 65)]
    assert waits == sorted(set(waits)), "the wait does not grow with every host"
    assert (waits[0], entrypoint.mpi_done_wait_s(16), waits[-1]) == (15, 85, 325)
    assert entrypoint.mpi_done_wait_s(0) == 15  # hosts unknown: as for 2
    watch = entrypoint.MpiWorkerWatch(entrypoint.mpi_done_wait_s(16), 16)
    entrypoint.daemon["runs"] = True
    watch.failure(0.0)
    entrypoint.daemon["runs"] = False
    watch.failure(1.0)
    assert watch.failure(31.0) is None  # past 2 hosts' wait
    assert "the job's 16 hosts" in watch.failure(86.5)

    assert entrypoint.job_hosts() == 0  # no resourceconfig.json
    _write_resourceconfig(tmp_path / "opt_ml", [f"algo-{i}" for i in range(1, 17)], "algo-2")
    assert entrypoint.job_hosts() == 16
    (tmp_path / "opt_ml" / "input" / "config" / "resourceconfig.json").write_text("{not json")
    assert entrypoint.job_hosts() == 0

    monkeypatch.setenv("SMDDP_MPI_DONE_WAIT_S", "7")
    assert entrypoint.mpi_done_wait_s(2) == entrypoint.mpi_done_wait_s(64) == 7


def test_watch_accepts_a_done_file_that_comes_late_within_the_wait(entrypoint, tmp_path):
    watch = entrypoint.MpiWorkerWatch(15, 2)
    entrypoint.daemon["runs"] = True
    watch.failure(0.0)
    entrypoint.daemon["runs"] = False
    assert watch.failure(1.0) is None
    assert watch.failure(10.0) is None  # no file yet, and not even its folder
    (tmp_path / "tmp").mkdir()
    (tmp_path / "tmp" / "done.algo-1").touch()
    for now in (14.0, 16.5, 100.0, 10_000.0):
        assert watch.failure(now) is None


def test_watch_without_the_daemon_never_fails(entrypoint):
    watch = entrypoint.MpiWorkerWatch(1, 2)
    for now in range(0, 10_000, 7):
        assert watch.failure(float(now)) is None


def _fake_train(tmp_path: Path, script: str) -> Path:
    """A ``train`` on PATH, and beside it an ``orted``: sleep's binary under the daemon's name."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shutil.copy(shutil.which("sleep"), bin_dir / "orted")
    train = bin_dir / "train"
    train.write_text("#!/bin/sh\n" + script)
    train.chmod(0o755)
    return bin_dir


def test_train_on_a_worker_fails_when_no_done_file_comes(started, env, tmp_path):
    bin_dir = _fake_train(tmp_path, 'orted 3\nexec sleep 50\n')
    _write_resourceconfig(tmp_path / "opt_ml", ["algo-1", "algo-2", "algo-3"], "algo-2")
    env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", SMDDP_MPI_DONE_WAIT_S="1")
    code, _, err = _finish(started.popen(_entrypoint("train"), env))
    assert code == 1, err
    reason = (tmp_path / "opt_ml" / "output" / "failure").read_text()
    assert "ended without success" in reason and "within 1 s" in reason and "the job's 3 hosts" in reason
    assert reason in err


def test_train_on_a_worker_succeeds_when_the_done_file_comes(started, env, tmp_path):
    done = tmp_path / "tmp" / "done.algo-1"
    # the note is there before the daemon ends (the unit tests cover a late one), so that the run
    # does not hang on how soon sh writes it; without it the 1 s wait would fail the job
    bin_dir = _fake_train(tmp_path, f'mkdir -p "{done.parent}" && touch "{done}"\norted 2\nsleep 3\nexit 0\n')
    _write_resourceconfig(tmp_path / "opt_ml", ["algo-1", "algo-2"], "algo-2")
    env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", SMDDP_MPI_DONE_WAIT_S="1")
    code, _, err = _finish(started.popen(_entrypoint("train"), env))
    assert code == 0, err
    assert not (tmp_path / "opt_ml" / "output" / "failure").exists()
