"""Start real multi-process jobs from pytest and collect what each rank reports.

``launch`` starts ``world_size`` Python processes that rendezvous through a TCPStore this process
hosts on a port the OS picks (``TORCHELASTIC_USE_AGENT_STORE`` makes every rank a client of it, as
under torchrun's agent), so tests never race for a fixed port. ``launch_mpi`` starts the same
worker under ``mpiexec`` with no RANK/WORLD_SIZE, the way MPI users launch. Each rank runs
``tests/worker.py``, which calls ``module.function(**kwargs)`` and writes its JSON-able return value.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any

from smddp_lite.backend.transports import shm_segment
from smddp_lite.launch import open_store

from .rank_pool import POOL

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "worker.py"


@dataclasses.dataclass
class RankResult:
    rank: int
    returncode: int
    value: Any  # what the function returned, or None
    error: str | None  # the exception the function raised, formatted
    output: str  # stdout + stderr, for failure messages
    pid: int | None = None  # the rank's process, where it started (tests/worker.py marks it)


def _outcome(result_dir: Path, rank: int) -> tuple[dict, int | None]:
    """What rank ``rank`` wrote: its result (empty where it wrote none) and its pid."""
    result, marked = result_dir / f"rank{rank}.json", result_dir / f"rank{rank}.pid"
    pid = marked.read_text().strip() if marked.exists() else ""
    return json.loads(result.read_text()) if result.exists() else {}, int(pid) if pid.isdigit() else None


def segments_left_by(results: list[RankResult]) -> list[str]:
    """The shared-memory segments in /dev/shm that these ranks made and that are still there. A
    segment's name holds the pid of the rank that made it; other jobs on the machine (a test
    running beside this one) hold segments of their own meanwhile, which a count would take for
    a leak. A rank with no pid never reached its program, so made none."""
    pids = {r.pid for r in results if r.pid is not None}
    return [p.name for p in Path("/dev/shm").glob("smddp-*")
            if (named := shm_segment.SEGMENT_NAME.fullmatch(p.name)) and int(named.group(2)) in pids]


def _base_env(extra: dict[str, str] | None) -> dict[str, str]:
    # PYTEST_CURRENT_TEST changes with every test, and ranks have no use for it
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SMDDP_", "TORCHELASTIC_")) and k != "PYTEST_CURRENT_TEST"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}")
    env.update(extra or {})
    return env


def _collect(procs, result_dir: Path, timeout: float) -> list[RankResult]:
    results = []
    for rank, proc in enumerate(procs):
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            out, _ = proc.communicate()
            out = (out or "") + f"\n[harness] rank {rank} killed after {timeout} s"
        data, pid = _outcome(result_dir, rank)
        results.append(RankResult(rank, proc.returncode, data.get("value"), data.get("error"), out or "", pid))
    return results


def launch(target: str, world_size: int, *, env: dict[str, str] | None = None, timeout: float = 180,
           rendezvous: bool = True, hosts_of: int = 0, interleaved_hosts: int = 0, pooled: bool = True,
           **kwargs: Any) -> list[RankResult]:
    """Run ``target`` ("module:function") on ``world_size`` local ranks; returns one result per rank.

    With ``rendezvous=False`` the ranks get no torchrun variables (only TEST_RANK and
    TEST_WORLD_SIZE), for tests of explicit init methods. ``hosts_of=k`` simulates hosts of k
    ranks each (SMDDP_HOSTNAME=sim-host-<rank // k>); ``interleaved_hosts=n`` deals ranks to n
    hosts in turn (sim-host-<rank % n>), so ranks are not numbered host by host.
    ``pooled=False`` starts fresh processes, for tests of start-up or exit; otherwise ranks come
    from rank_pool.POOL where the environment allows it (see ``RankPool.takes``).
    """
    store = open_store("127.0.0.1", world_size, timedelta(minutes=5))  # listens on loopback only
    rank_envs = []
    for rank in range(world_size):
        rank_env = dict(env or {}, TEST_RANK=str(rank), TEST_WORLD_SIZE=str(world_size))
        if hosts_of:
            rank_env["SMDDP_HOSTNAME"] = f"sim-host-{rank // hosts_of}"
        if interleaved_hosts:
            rank_env["SMDDP_HOSTNAME"] = f"sim-host-{rank % interleaved_hosts}"
        if rendezvous:
            rank_env.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                            LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                            MASTER_PORT=str(store.port), TORCHELASTIC_USE_AGENT_STORE="True")
        rank_envs.append(rank_env)
    with tempfile.TemporaryDirectory(prefix="smddp-test-") as tmp:
        if pooled and POOL.takes(env or {}):
            outcomes = POOL.run(target, kwargs, rank_envs, _base_env(None), ROOT, Path(tmp), timeout)
            results = []
            for rank, (returncode, output, note) in enumerate(outcomes):
                data, pid = _outcome(Path(tmp), rank)
                data = data if note is None else {}
                output = output + ("\n" + note if note else "")
                results.append(RankResult(rank, -9 if returncode is None else returncode, data.get("value"),
                                          data.get("error"), output, pid))
        else:
            procs = [subprocess.Popen([sys.executable, str(WORKER), target, json.dumps(kwargs), tmp],
                                      env=_base_env(rank_env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, cwd=ROOT)
                     for rank_env in rank_envs]
            results = _collect(procs, Path(tmp), timeout)
    del store
    return results


def torchrun(args: list[str], *, cwd, nproc: int = 2, timeout: float = 300,
             python_flags: tuple[str, ...] = (), env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python -m torch.distributed.run --standalone --nproc-per-node N ARGS`` as a user runs it:
    the installed smddp_lite, no variables of this test session but ``env``. On timeout the
    launcher and its ranks are killed together (killing the launcher alone leaves its ranks running)."""
    return run_as_user([sys.executable, *python_flags, "-m", "torch.distributed.run", "--standalone",
                        "--nproc-per-node", str(nproc), *args], cwd=cwd, timeout=timeout, env=env)


def mpiexec_python(args: list[str], *, cwd, nproc: int = 2, timeout: float = 300,
                   env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``mpiexec -n N python ARGS`` as a user runs it, as ``torchrun`` above (call
    ``skip_without_mpiexec`` first)."""
    return run_as_user([mpiexec(), "-n", str(nproc), sys.executable, *args], cwd=cwd, timeout=timeout, env=env)


def run_as_user(command: list[str], *, cwd, timeout: float, env: dict[str, str] | None = None
                ) -> subprocess.CompletedProcess:
    """``command`` as a user runs it: no variables of this test session but ``env``, one OpenMP
    thread a process. On timeout its whole session is killed (a launcher's ranks with it)."""
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("SMDDP_", "TORCHELASTIC_", "PYTEST_")) and k not in ("RANK", "WORLD_SIZE", "PYTHONPATH")}
    proc = subprocess.Popen(command, cwd=cwd, env=dict(clean, OMP_NUM_THREADS="1", **(env or {})),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # a launcher may start its ranks in sessions of their own: kill its whole tree first, or a
        # hung rank would hold the pipes open and the communicate() below would wait for good
        for pid in _descendants(proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"{' '.join(command)} did not finish in {timeout} s:\n{out}\n{err}") from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _descendants(pid: int) -> list[int]:
    """Every process under ``pid`` (from /proc), children first found first."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def mpiexec() -> str | None:
    """Path of an MPI launcher whose mpi4py is importable here, else None."""
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return None
    return shutil.which("mpiexec") or shutil.which("mpirun")


def skip_without_mpiexec() -> None:
    """Skip the calling test, saying what to install, where mpi4py or an MPI launcher is missing
    (CI installs both: they come with ``.[test]``)."""
    if mpiexec() is None:
        import pytest

        pytest.skip("mpi4py or mpiexec not installed (from the checkout: pip install -e '.[mpi]')")


def launch_mpi(target: str, world_size: int, *, env: dict[str, str] | None = None, timeout: float = 180,
               prefix: list[str] | None = None, launcher_flags: tuple[str, ...] = (),
               **kwargs: Any) -> list[RankResult]:
    """Run ``target`` under ``mpiexec -n world_size`` (no RANK/WORLD_SIZE: the MPI way).
    ``prefix``: a command that runs mpiexec (forbid_process_vm_readv.py, say); ``launcher_flags``:
    mpiexec's own options (``-disable-auto-cleanup``, say)."""
    mpich_segments = set(Path("/dev/shm").glob("mpich_shm_*"))
    try:
        return _run_mpi(target, world_size, env, timeout, prefix, launcher_flags, kwargs)
    finally:
        # MPICH removes its shared-memory segment in MPI_Finalize; a job whose ranks died or were
        # killed (the failure tests) leaves it behind, 2-3 MB each time. A new one that a live
        # process maps belongs to another job running beside this one
        mapped = _mapped_shm_files()
        for left in set(Path("/dev/shm").glob("mpich_shm_*")) - mpich_segments:
            if str(left) not in mapped:
                left.unlink(missing_ok=True)


def _mapped_shm_files() -> set[str]:
    """The files in /dev/shm that some live process maps (from every /proc/<pid>/maps)."""
    mapped = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            lines = maps.read_text().splitlines()
        except OSError:  # the process ended meanwhile
            continue
        mapped.update(line.split(None, 5)[5].removesuffix(" (deleted)") for line in lines if " /dev/shm/" in line)
    return mapped


def _run_mpi(target: str, world_size: int, env: dict[str, str] | None, timeout: float, prefix: list[str] | None,
             launcher_flags: tuple[str, ...], kwargs: dict[str, Any]) -> list[RankResult]:
    with tempfile.TemporaryDirectory(prefix="smddp-mpi-") as tmp:
        # -print-all-exitcodes: every rank's wait status in the output, so a failure names the rank
        # that died first (hydra reports one, often a rank it killed in the clean-up)
        proc = subprocess.Popen(
            [*(prefix or []), mpiexec(), "-print-all-exitcodes", *launcher_flags, "-n", str(world_size), sys.executable,
             str(WORKER), target, json.dumps(kwargs), tmp],
            env=_base_env(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
        )
        (result,) = _collect([proc], Path(tmp), timeout)
        results = []
        for rank in range(world_size):
            data, pid = _outcome(Path(tmp), rank)
            results.append(RankResult(rank, result.returncode, data.get("value"), data.get("error"), result.output,
                                      pid))
    return results


def values(results: list[RankResult]) -> list[Any]:
    """Every rank's return value, or an AssertionError with every failing rank's output."""
    bad = [r for r in results if r.returncode != 0 or r.error is not None]
    if bad:
        raise AssertionError("\n\n".join(
            f"--- rank {r.rank} exit {r.returncode}\n{r.error or ''}\n{r.output[-4000:]}" for r in bad))
    return [r.value for r in results]
