"""Long-lived rank processes for test jobs, so that most jobs do not pay for starting Python and
importing torch on every rank (about 2.4 s of CPU per rank on the 2-core CI machine).

A pooled rank (``worker.py --serve``) runs one job at a time with the job's own environment,
store and output file, and is handed back only when the job left it as a fresh process would be
(process groups destroyed, no thread of the job's still running, MPI never started). Any other
outcome (an exception, a broken group, a kill, a timeout) retires it. New ranks are forked from
a zygote (``worker.py --zygote``) that imported torch once, so a retired rank's place is filled
in milliseconds. Ranks are interchangeable: a job of n ranks takes any n idle ones.
"""

from __future__ import annotations

import atexit
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORKER = Path(__file__).resolve().parent / "worker.py"
KEEP_IDLE = 8  # the most finished ranks kept for later jobs (the largest world size tests use)
_GRACE_S = 0.5  # how long a finished rank waits for its peers before it is let go (exits)
_CLEAN_S = 10.0  # how long clean-up (destroying the job's groups) may take

# Environment a job may set per run: read by smddp-lite or the programs when they run, never at
# import. A job that sets anything else (OMP_NUM_THREADS, LD_PRELOAD, TORCH_*, ...) gets fresh
# processes, as that may be read only at start-up.
PER_JOB_PREFIXES = ("SMDDP_", "TEST_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                    "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE")


class _Zygote:
    """The process every pooled rank is forked from, and the only one that can reap them: it
    reports each rank's exit code, which ``_ForkedProcess.wait`` returns."""

    def __init__(self, env: dict[str, str], cwd: Path) -> None:
        self._socket, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - closed in close
        self.proc = subprocess.Popen([sys.executable, str(WORKER), "--zygote", str(theirs.fileno())], env=env,
                                     cwd=cwd, stdin=subprocess.DEVNULL, stdout=self.log, stderr=self.log,
                                     pass_fds=[theirs.fileno()])
        theirs.close()
        self._exits: dict[int, int] = {}

    def fork(self, log) -> _ForkedProcess:
        stdin_r, stdin_w = os.pipe()
        stdout_r, stdout_w = os.pipe()
        try:
            socket.send_fds(self._socket, [b"spawn"], [stdin_r, stdout_w, log.fileno()])
        finally:
            os.close(stdin_r)
            os.close(stdout_w)
        while True:
            word, pid = self._receive(block=True)
            if word == "pid":
                return _ForkedProcess(self, pid, os.fdopen(stdin_w, "w"), os.fdopen(stdout_r, "r"))

    def _receive(self, block: bool) -> tuple[str, int] | tuple[None, None]:
        """The next message, ``(word, pid)``, or (None, None) where ``block`` is false and none is
        waiting. Exits are recorded as they pass."""
        try:
            message = self._socket.recv(64, 0 if block else socket.MSG_DONTWAIT)
        except BlockingIOError:
            return None, None
        if not message:
            raise RuntimeError(f"the test rank zygote ended; what it printed:\n{self.printed()}")
        word, pid, *code = message.decode().split()
        if word == "exit":
            self._exits[int(pid)] = int(code[0])
        return word, int(pid)

    def exit_code(self, pid: int, block: bool) -> int | None:
        """The rank's exit code, or None where it has not ended (and ``block`` is false)."""
        while pid not in self._exits:
            if self._receive(block) == (None, None):
                return None
        return self._exits[pid]

    def printed(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def close(self) -> None:
        self._socket.close()  # the zygote exits when it reads the end
        self.proc.wait()
        self.log.close()


class _ForkedProcess:
    """The part of ``subprocess.Popen`` the pool uses, for a rank the zygote forked."""

    def __init__(self, zygote: _Zygote, pid: int, stdin, stdout) -> None:
        self._zygote, self.pid, self.stdin, self.stdout = zygote, pid, stdin, stdout
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._zygote.exit_code(self.pid, block=False)
        return self.returncode

    def wait(self) -> int:
        if self.returncode is None:
            self.returncode = self._zygote.exit_code(self.pid, block=True)
        self.stdin.close()
        self.stdout.close()
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:  # not yet reaped, so the pid is still this rank's
            os.kill(self.pid, signal.SIGKILL)


class _Rank:
    def __init__(self, zygote: _Zygote) -> None:
        # what a rank prints outside jobs (an import that failed, say), shown if it dies there
        self.log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - closed in kill/close
        self.proc = zygote.fork(self.log)

    def printed(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def start(self, job: dict) -> None:
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()

    def tell(self, word: str) -> None:
        self.proc.stdin.write(word + "\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.log.close()


class RankPool:
    def __init__(self) -> None:
        self._idle: list[_Rank] = []
        self._zygote: _Zygote | None = None
        self._spawn_env: dict[str, str] | None = None
        self._cwd: Path | None = None
        atexit.register(self.close)

    @staticmethod
    def takes(job_env: dict[str, str]) -> bool:
        """Whether a job with this environment (beyond the base one) can run on pooled ranks."""
        return all(k.startswith(PER_JOB_PREFIXES) for k in job_env)

    def run(self, target: str, kwargs: dict, rank_envs: list[dict[str, str]], base_env: dict[str, str], cwd: Path,
            result_dir: Path, timeout: float) -> list[tuple[int | None, str, str | None]]:
        """Run one job on ``len(rank_envs)`` pooled ranks. Returns per rank (returncode, output,
        note): 0 where the rank finished, its exit status where it died, None where it was
        killed at ``timeout``; note says why it was killed."""
        if self._zygote is None or self._spawn_env != base_env or self._cwd != cwd:  # started for another base
            self.close()
            self._spawn_env, self._cwd = dict(base_env), cwd
            self._zygote = _Zygote(base_env, cwd)
        self._idle = [rank for rank in self._idle if rank.proc.poll() is None]
        ranks = [self._idle.pop(0) if self._idle else _Rank(self._zygote) for _ in rank_envs]
        for rank, env in zip(ranks, rank_envs):
            rank.start({"target": target, "kwargs": kwargs, "env": env, "result_dir": str(result_dir)})
        finished = self._finish(ranks, timeout)
        outcomes = []
        for index, (rank, state) in enumerate(zip(ranks, finished)):
            out = result_dir / f"rank{index}.out"
            output = out.read_text(errors="replace") if out.exists() else ""
            if state == "reuse":
                self._idle.insert(0, rank)
                outcomes.append((0, output, None))
                continue
            if state == "timeout":
                rank.kill()
                outcomes.append((None, output, f"[harness] rank {index} killed after {timeout} s"))
                continue
            status = rank.proc.wait()
            if state == "died" and not output:
                output = rank.printed()
            rank.log.close()
            # a rank that finished and was then let go (or stopped) ended as a one-shot worker does
            outcomes.append((0 if state in ("done", "retire") and status in (0, -9) else status, output, None))
        for rank in self._idle[KEEP_IDLE:]:
            rank.proc.stdin.close()  # its serve loop ends
            rank.kill()
        del self._idle[KEEP_IDLE:]
        return outcomes

    @staticmethod
    def _finish(ranks: list[_Rank], timeout: float) -> list[str]:
        """Wait for every rank's job. A rank that is done while a peer is not, after a short
        grace, is killed, as a one-shot worker would have exited there: peers that wait for it
        then see it gone, as they would in a job of fresh processes. Once all are done, each
        cleans up and answers. Returns per rank: ``reuse``, ``retire``, ``done`` (killed after
        finishing), ``died`` or ``timeout``."""
        states = ["running"] * len(ranks)
        selector = selectors.DefaultSelector()
        for index, rank in enumerate(ranks):
            selector.register(rank.proc.stdout, selectors.EVENT_READ, index)
        deadline = time.monotonic() + timeout
        first_done = None
        cleaning = False
        while any(state in ("running", "cleaning") for state in states):
            now = time.monotonic()
            wake = deadline if first_done is None or cleaning else min(deadline, first_done + _GRACE_S)
            events = selector.select(max(wake - now, 0))
            for key, _ in events:
                index, line = key.data, key.fileobj.readline().strip()
                if line == "done":
                    states[index] = "done"
                    first_done = first_done or time.monotonic()
                else:  # reuse, retire, or "" where the process ended
                    states[index] = line if line in ("reuse", "retire") else "died"
                    selector.unregister(key.fileobj)
            if not cleaning and all(state != "running" for state in states):
                cleaning = True
                deadline = time.monotonic() + _CLEAN_S
                for index, state in enumerate(states):
                    if state == "done":
                        states[index] = "cleaning"
                        ranks[index].tell("clean")
                continue
            if events or time.monotonic() < wake:
                continue
            if time.monotonic() >= deadline:  # the job's timeout, or a clean-up that hung
                for index, state in enumerate(states):
                    if state in ("running", "cleaning"):
                        ranks[index].proc.kill()
                        states[index] = "timeout" if state == "running" else "done"
                break
            for index, state in enumerate(states):  # the grace ran out: let the finished ranks go
                if state == "done":
                    ranks[index].proc.kill()
                    selector.unregister(ranks[index].proc.stdout)
                    states[index] = "let go"
            first_done = None
        selector.close()
        return ["done" if state == "let go" else state for state in states]

    def close(self) -> None:
        for rank in self._idle:
            rank.proc.stdin.close()
            rank.kill()
        self._idle.clear()
        if self._zygote is not None:
            self._zygote.close()
            self._zygote = None


POOL = RankPool()
