#!/usr/bin/env python3
"""The image's entry point: runs its command (SageMaker's ``train``, or the default job) as PID 1
of the container would, and ends everything the job started when the container is stopped.

A process that is PID 1 gets no default action for SIGTERM: without a handler, StopTrainingJob's
SIGTERM (and ``docker stop``'s) would be ignored until the SIGKILL that follows. And the job's
processes are not all in one tree: with the "smdistributed dataparallel" distribution, the
ranks on the other hosts are children of sshd sessions, in sessions of their own. So on SIGTERM
or SIGINT this passes SIGTERM to every process of the container (``kill(-1)``, which spares
PID 1 itself), gives them ``SMDDP_STOP_GRACE_S`` seconds (default 15) to end, then SIGKILLs
what is left. As PID 1 it also reaps the orphans the container's other processes leave.

Exit status: the command's own, or 128 + the signal that ended it (143 after SIGTERM), as a shell
reports it. Outside a container's PID 1 the command gets a session of its own, and only that
session is signalled.

One more end it sees to, for ``train``: on the other hosts of an "smdistributed dataparallel"
job, the toolkit runs no rank itself. Open MPI's daemon (orted) runs them for the first host's
mpirun, and the toolkit waits until the first host writes ``/tmp/done.<host>`` after a
successful run. When that run failed or was stopped, the file never comes, and the toolkit waits
on (it asks again only every few minutes), for SageMaker to stop the instance. The first host
writes those files one host at a time, over ssh, retrying each, so the wait for one grows with
the job: once the daemon has come and gone here, and no such file has come within 10 s plus 5 s
for each host after the first (the hosts of SageMaker's ``resourceconfig.json``; 15 s for 2
hosts, 325 s for 64), or within ``SMDDP_MPI_DONE_WAIT_S`` seconds where that is set, the job has
ended without success: this writes why to ``/opt/ml/output/failure`` and ends the container
with status 1.

And one start: before ``train`` runs as the container's PID 1 where ``resourceconfig.json`` exists,
this makes the container's ssh trust for the job (``smddp_ssh_trust.py`` beside this file,
docker/ssh_trust.py in the source): a fresh host key, and root's key accepted only from the job's
hosts. Where that cannot be made, the container ends with status 1 and says why before ``train``
starts. Outside PID 1 (this file run on a machine of its own) the machine's ssh is left alone.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

DEFAULT_GRACE_S = 15.0
# The wait for the first host's done file, counted from this host's daemon exiting. The base
# covers mpirun ending on the first host once every daemon has reported, and its toolkit turning
# to the first ssh: 10 s sufficed for 2 hosts in docker/sagemaker_local.py. The toolkit then runs
# ``ssh HOST touch FILE`` for every other host in turn (resourceconfig's order), retrying a failed
# one up to 5 times 1 s apart: one ssh takes well under a second on the job's network, so 5 s per
# host leaves room for a slow handshake, or a failed try and its pause. Counting every host, not
# this host's place in that order, keeps the rule independent of it. A longer wait only delays a
# failed job's report (without the watch none comes), and 2 hosts' 15 s still ends every
# container within sagemaker_local.py's 30 s of a stop of the first host.
MPI_DONE_BASE_WAIT_S = 10.0
MPI_DONE_WAIT_PER_HOST_S = 5.0
MPI_DAEMONS = ("orted", "prted")  # Open MPI 4's and 5's
# the toolkit's MPI_FINISHED_STATUS_FILE, then the first host's name; tests move it out of /tmp
DONE_FILE_PREFIX = os.environ.get("ENTRYPOINT_DONE_FILE_PREFIX", "/tmp/done.")


def _base_dir() -> str:
    return os.environ.get("SAGEMAKER_BASE_DIR", "/opt/ml")


def job_hosts() -> int:
    """How many hosts SageMaker's resourceconfig.json lists; 0 where it cannot be read."""
    try:
        with open(os.path.join(_base_dir(), "input", "config", "resourceconfig.json")) as f:
            hosts = json.load(f)["hosts"]
    except (OSError, ValueError, KeyError, TypeError):
        return 0
    return len(hosts) if isinstance(hosts, list) else 0


class SettingError(ValueError):
    """A setting of the environment this entry point cannot use."""


def seconds_setting(name: str) -> float | None:
    """The variable ``name`` as seconds (a number >= 0), None where it is unset or empty."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise SettingError(f"{name}={raw!r} is not a number of seconds; expected a number >= 0 (such as 15): "
                           f"fix it, or unset it for the default")
    return value


def mpi_done_wait_s(hosts: int) -> float:
    """Seconds to wait for the done file on a job of ``hosts`` hosts (0: unknown, counted as 2)."""
    given = seconds_setting("SMDDP_MPI_DONE_WAIT_S")
    if given is not None:
        return given
    return MPI_DONE_BASE_WAIT_S + MPI_DONE_WAIT_PER_HOST_S * max(hosts - 1, 1)


class MpiWorkerWatch:
    """Says when this host's part of an mpirun job ended without the first host's note of success."""

    def __init__(self, wait_s: float, hosts: int = 0) -> None:
        self.wait_s, self.hosts, self.seen, self.gone_at = wait_s, hosts, False, None

    @staticmethod
    def _daemon_runs() -> bool:
        for pid in os.listdir("/proc"):
            try:
                with open(f"/proc/{pid}/comm") as f:
                    if f.read().strip() in MPI_DAEMONS:
                        return True
            except OSError:  # not a process, or one that just ended
                continue
        return False

    @staticmethod
    def _done_noted() -> bool:
        folder, prefix = os.path.split(DONE_FILE_PREFIX)
        try:
            return any(name.startswith(prefix) for name in os.listdir(folder))
        except OSError:  # no folder yet: no note either
            return False

    def failure(self, now: float) -> str | None:
        if self._daemon_runs():
            self.seen, self.gone_at = True, None
        elif self.seen and self.gone_at is None:
            self.gone_at = now
        if self.gone_at is not None and now - self.gone_at > self.wait_s and not self._done_noted():
            hosts = f"the job's {self.hosts} hosts" if self.hosts else "each host (resourceconfig.json unread)"
            return (f"the MPI job this host ran ranks for ended without success: expected the first host's "
                    f"{DONE_FILE_PREFIX}<host> within {self.wait_s:g} s of Open MPI's daemon exiting here (after a "
                    f"successful mpirun it writes one to {hosts} in turn, over ssh; SMDDP_MPI_DONE_WAIT_S sets "
                    f"the wait), found none {now - self.gone_at:.0f} s after. The first host's log and its "
                    "/opt/ml/output/failure say what happened there.")
        return None


def _write_failure(reason: str) -> None:
    """SageMaker's FailureReason, unless the toolkit wrote one."""
    path = os.path.join(_base_dir(), "output", "failure")
    if not os.path.exists(path):
        with contextlib.suppress(OSError):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                f.write(reason)


def _make_ssh_trust(dns_wait_s: float | None) -> str | None:
    """The job's ssh trust, made by the module beside this file (its own wait for the job's names
    where ``dns_wait_s`` is None); None, or why it failed."""
    here = os.path.dirname(os.path.realpath(__file__))
    paths = [os.path.join(here, name) for name in ("smddp_ssh_trust.py", "ssh_trust.py")]
    path = next((p for p in paths if os.path.isfile(p)), None)
    if path is None:
        return (f"expected the ssh trust module at {paths[0]} (the image copies docker/ssh_trust.py there), "
                "found none: rebuild the image from docker/Dockerfile")
    import importlib.util  # here: only this start needs it
    spec = importlib.util.spec_from_file_location("smddp_ssh_trust", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    try:
        made = module.setup() if dns_wait_s is None else module.setup(dns_wait_s=dns_wait_s)
    except (module.TrustError, OSError) as exc:
        return f"cannot limit ssh to the job's hosts, so `train` does not start: {exc}"
    print(f"entrypoint: ssh: root's key accepted from the job's hosts only ({', '.join(made['addresses'])})",
          file=sys.stderr, flush=True)
    return None


def _status(raw: int) -> int:
    return os.waitstatus_to_exitcode(raw) if os.WIFEXITED(raw) else 128 + os.WTERMSIG(raw)


def main(argv: list[str]) -> int:
    if not argv:
        print("entrypoint: no command given (expected `train` or a command line)", file=sys.stderr)
        return 2
    try:  # before the command starts: a setting that cannot be used stops nothing half-way
        grace = seconds_setting("SMDDP_STOP_GRACE_S")
        grace = DEFAULT_GRACE_S if grace is None else grace
        done_wait = mpi_done_wait_s(job_hosts()) if argv == ["train"] else None
        dns_wait = seconds_setting("SSH_TRUST_DNS_WAIT_S")  # the ssh trust's wait for the job's names
    except SettingError as exc:
        print(f"entrypoint: {exc}", file=sys.stderr)
        return 2
    is_init = os.getpid() == 1
    if is_init and argv == ["train"] and os.path.exists(
            os.path.join(_base_dir(), "input", "config", "resourceconfig.json")):
        def stop_now(signum, frame) -> None:  # PID 1 ignores an unhandled SIGTERM: a stop while
            raise SystemExit(128 + signum)    # the job's names resolve ends the container at once

        signal.signal(signal.SIGTERM, stop_now)
        signal.signal(signal.SIGINT, stop_now)
        problem = _make_ssh_trust(dns_wait)
        if problem is not None:
            print(f"entrypoint: {problem}", file=sys.stderr, flush=True)
            _write_failure(problem)
            return 1
    try:
        child = subprocess.Popen(argv, start_new_session=not is_init)
    except FileNotFoundError:
        print(f"entrypoint: {argv[0]!r} not found on PATH ({os.environ.get('PATH', '')})", file=sys.stderr)
        return 127
    stop_at: list[float] = []

    def send(sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):  # nothing left to signal
            if is_init:
                os.kill(-1, sig)  # every process of the container but this one
            else:
                os.killpg(child.pid, sig)

    def on_stop(signum, frame) -> None:
        if not stop_at:
            stop_at.append(time.monotonic() + grace)
            send(signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_stop)
    signal.signal(signal.SIGINT, on_stop)
    watch = MpiWorkerWatch(done_wait, job_hosts()) if done_wait is not None else None
    failed_status, next_look = None, 0.0
    status = None
    while status is None:
        if stop_at and time.monotonic() > stop_at[0]:
            send(signal.SIGKILL)
        if watch is not None and not stop_at and time.monotonic() >= next_look:
            next_look = time.monotonic() + 0.5
            reason = watch.failure(time.monotonic())
            if reason is not None:
                print(f"entrypoint: {reason}", file=sys.stderr, flush=True)
                _write_failure(reason)
                failed_status = 1
                on_stop(signal.SIGTERM, None)
        try:
            # every child ends here, the command and the orphans PID 1 inherits
            pid, raw = os.waitpid(-1 if is_init else child.pid, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == child.pid:
            status = _status(raw)
            child.returncode = status
        elif pid == 0:
            time.sleep(0.05)
    if is_init:  # what the command left running (an sshd, a stray rank) ends with the container
        send(signal.SIGTERM)
        deadline = time.monotonic() + min(grace, 5.0)
        while time.monotonic() < deadline:
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    time.sleep(0.05)
            except ChildProcessError:
                break
        send(signal.SIGKILL)
    if failed_status is not None:
        return failed_status
    return status if status is not None else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
