"""Rank processes for test jobs that do not pay for starting Python and importing torch (about
2.4 s of CPU per rank on the 2-core CI machine), nor for what a flight-recorder dump imports
(2 to 5 s more in every rank that fails or hears a peer fail).

One process (``worker.py --zygote``) imports all of that once and then forks: every rank of every
job is a fresh fork of it, started in milliseconds. A rank runs its one job with the job's own
environment, store and output file, then exits as a one-shot worker does, so no job can see
state another left behind (process groups, DeviceMesh and DTensor caches, threads, patched
modules), and a rank that finishes early is gone for its peers as a one-shot worker would be.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORKER = Path(__file__).resolve().parent / "worker.py"

# Environment a job may set per run: read by smddp-lite or the programs when they run, never at
# import. A job that sets anything else (OMP_NUM_THREADS, LD_PRELOAD, TORCH_*, ...) gets fresh
# processes, as that may be read only at start-up.
PER_JOB_PREFIXES = ("SMDDP_", "TEST_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                    "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE")


class _Zygote:
    """The process every rank is forked from, and the only one that can reap them: it reports
    each rank's exit code."""

    def __init__(self, env: dict[str, str], cwd: Path) -> None:
        self._socket, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - closed in close
        self.proc = subprocess.Popen([sys.executable, str(WORKER), "--zygote", str(theirs.fileno())], env=env,
                                     cwd=cwd, stdin=subprocess.DEVNULL, stdout=self.log, stderr=self.log,
                                     pass_fds=[theirs.fileno()])
        theirs.close()
        self._exits: dict[int, int] = {}

    def fork(self, job: dict, output: Path) -> int:
        """A new rank that runs ``job``, its standard output and error going to ``output``; its pid."""
        stdin_r, stdin_w = os.pipe()
        out = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            socket.send_fds(self._socket, [b"spawn"], [stdin_r, out, out])
        finally:
            os.close(stdin_r)
            os.close(out)
        with os.fdopen(stdin_w, "w") as stdin:  # one line: the rank reads it and runs
            stdin.write(json.dumps(job) + "\n")
        while True:
            word, pid = self._receive(timeout=None)
            if word == "pid":
                return pid

    def _receive(self, timeout: float | None) -> tuple[str, int] | tuple[None, None]:
        """The next message, ``(word, pid)``, or (None, None) where none came within ``timeout``
        seconds (None: wait for one). Exits are recorded as they pass."""
        if timeout is not None and not select.select([self._socket], [], [], max(timeout, 0))[0]:
            return None, None
        message = self._socket.recv(64)
        if not message:
            raise RuntimeError(f"the test rank zygote ended; what it printed:\n{self.printed()}")
        word, pid, *code = message.decode().split()
        if word == "exit":
            self._exits[int(pid)] = int(code[0])
        return word, int(pid)

    def wait(self, pids: list[int], deadline: float | None) -> dict[int, int]:
        """The exit codes of those of ``pids`` that ended by ``deadline`` (time.monotonic; None:
        wait for all)."""
        while not all(pid in self._exits for pid in pids):
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                break
            self._receive(left)
        return {pid: self._exits.pop(pid) for pid in pids if pid in self._exits}

    def printed(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def close(self) -> None:
        self._socket.close()  # the zygote exits when it reads the end
        self.proc.wait()
        self.log.close()


class RankPool:
    def __init__(self) -> None:
        self._zygote: _Zygote | None = None
        self._spawn_env: dict[str, str] | None = None
        self._cwd: Path | None = None
        atexit.register(self.close)

    @staticmethod
    def takes(job_env: dict[str, str]) -> bool:
        """Whether a job with this environment (beyond the base one) can run on forked ranks."""
        return all(k.startswith(PER_JOB_PREFIXES) for k in job_env)

    def run(self, target: str, kwargs: dict, rank_envs: list[dict[str, str]], base_env: dict[str, str], cwd: Path,
            result_dir: Path, timeout: float) -> list[tuple[int | None, str, str | None]]:
        """Run one job on ``len(rank_envs)`` forked ranks. Returns per rank (returncode, output,
        note): its exit status (0 where it finished), or None where it was killed at ``timeout``;
        note says why it was killed."""
        if self._zygote is None or self._spawn_env != base_env or self._cwd != cwd:  # started for another base
            self.close()
            self._spawn_env, self._cwd = dict(base_env), cwd
            self._zygote = _Zygote(base_env, cwd)
        outputs = [result_dir / f"rank{index}.out" for index in range(len(rank_envs))]
        pids = [self._zygote.fork({"target": target, "kwargs": kwargs, "env": env, "result_dir": str(result_dir)},
                                  output)
                for env, output in zip(rank_envs, outputs)]
        codes = self._zygote.wait(pids, time.monotonic() + timeout)
        late = [pid for pid in pids if pid not in codes]
        for pid in late:  # no exit reported yet; one that is still on its way is already reaped
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self._zygote.wait(late, None)
        return [(None, output.read_text(errors="replace"), f"[harness] rank {index} killed after {timeout} s")
                if pid in late else (codes[pid], output.read_text(errors="replace"), None)
                for index, (pid, output) in enumerate(zip(pids, outputs))]

    def close(self) -> None:
        if self._zygote is not None:
            self._zygote.close()
            self._zygote = None


POOL = RankPool()
