"""One rank of a test job: ``python tests/worker.py module:function '{"kwarg": 1}' RESULT_DIR``.

Writes ``RESULT_DIR/rank<R>.json`` with the function's return value or the exception it raised,
then exits without running interpreter teardown, so a broken process group cannot hang the exit.

``python tests/worker.py --serve`` is a pooled rank (rank_pool.py): it imports torch once and
runs one job per line of standard input, each with its own environment, store and output file.
It answers ``done`` where a one-shot worker would exit, then waits for ``clean`` (every rank is
done: clean up for the next job) or ``exit``, and answers ``reuse`` when the job left nothing
behind, or ``retire`` and exits when it may have left state a later job could see.

``python tests/worker.py --zygote FD`` imports torch and this project once and then only forks:
each request on the socket FD carries the new rank's standard input, output and error, and the
child becomes a pooled rank. A rank retired after a failed job is replaced in milliseconds
instead of the seconds a new interpreter takes to import torch.
"""

import contextlib
import ctypes
import importlib
import json
import os
import select
import socket
import sys
import threading
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests import warning_gate  # noqa: E402  (needs the path above)

warning_gate.install()


def _rank() -> int:
    for var in ("TEST_RANK", "RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK"):
        if var in os.environ:
            return int(os.environ[var])
    return 0


def _exit_after_mpi(rank: int) -> None:
    """Finalize MPI, then leave through C's ``exit``: it runs the C exit handlers, and MPICH tells
    its launcher there (not in MPI_Finalize) that this rank finished. A rank that leaves without
    saying so (``os._exit``) looks crashed to hydra, which SIGKILLs every rank still leaving: CI saw
    exit codes 0,9,0,9 after every rank had written its result. Python's own teardown is still
    skipped. Returns (for ``os._exit``) where MPI never started or cannot be finalized.

    For the test of this exit path, TEST_LINGER_RANK makes one rank leave TEST_LINGER_S late, after
    finalizing, and then create the file TEST_LINGER_MARK: proof that it was not killed."""
    from mpi4py import MPI

    if not MPI.Is_initialized():
        return
    if not MPI.Is_finalized():
        try:
            MPI.Finalize()
        except MPI.Exception:
            return
    if os.environ.get("TEST_LINGER_RANK") == str(rank):
        time.sleep(float(os.environ["TEST_LINGER_S"]))
        Path(os.environ["TEST_LINGER_MARK"]).touch()
    ctypes.CDLL(None).exit(0)


def run(target: str, kwargs: dict) -> dict:
    """``module:function(**kwargs)``: its return value, or the exception it raised, formatted."""
    module, function = target.split(":")
    try:
        return {"value": getattr(importlib.import_module(module), function)(**kwargs)}
    except BaseException:  # reported to the test, which decides
        return {"error": traceback.format_exc()}


def main() -> None:
    target, kwargs, result_dir = sys.argv[1], json.loads(sys.argv[2]), Path(sys.argv[3])
    rank = _rank()
    result = run(target, kwargs)
    (result_dir / f"rank{rank}.json").write_text(json.dumps(result))
    sys.stdout.flush()
    sys.stderr.flush()
    # a program whose peer died leaves without MPI_Finalize, which would wait for that peer
    if "mpi4py.MPI" in sys.modules and not os.environ.get("TEST_SKIP_MPI_FINALIZE"):
        _exit_after_mpi(rank)
    os._exit(0)


# torch packages that keep process groups in caches of their own across init and destroy: DTensor
# and DeviceMesh resolve a later job's groups by a stale name ("Could not resolve the process
# group registered under the name 4"); a job that imported any of them is not followed by another
_KEEP_STATE = ("torch.distributed.tensor", "torch.distributed.fsdp", "torch.distributed._composable",
               "torch.distributed.pipelining", "torch.distributed.checkpoint")


def _bindings() -> dict[str, dict[str, int]]:
    """What each loaded module of this project and of the tests names: a job that rebinds one
    (a program that patches ``select._shm_possible``, say) leaves the next job another library."""
    return {name: {k: id(v) for k, v in vars(module).items()}
            for name, module in list(sys.modules.items())
            if module is not None and name.startswith(("smddp_lite", "tests"))}


def _rebound(before: dict[str, dict[str, int]]) -> bool:
    after = _bindings()
    return any(after[name] != names for name, names in before.items() if name in after)


def _left_clean(threads_before: set) -> bool:
    """Whether a finished job left this process as a fresh one would be for the next: its
    process groups destroyed, torch's group numbering back at 0, no thread of the job's still
    running, MPI never started, no package that caches groups imported."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    if dist.is_initialized():
        destroyed = []

        def destroy():
            with contextlib.suppress(BaseException):  # a broken group: this process is not reused
                dist.destroy_process_group()
                destroyed.append(True)

        # a broken group's destroy can wait on peers that are gone; a fresh process would not
        # have waited at all, so a slow destroy retires this one instead
        cleaner = threading.Thread(target=destroy, daemon=True)
        cleaner.start()
        cleaner.join(1.0)
        if not destroyed:
            return False
        threads_before = threads_before | {cleaner}
    if distributed_c10d._world.group_count != 0 or "mpi4py.MPI" in sys.modules:  # a failed init counts groups
        return False
    if any(name in sys.modules for name in _KEEP_STATE):
        return False
    deadline = time.monotonic() + 1.0  # threads a destroyed group stopped may take a moment to end
    while any(t.is_alive() for t in threading.enumerate() if t not in threads_before):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def serve() -> None:
    """Run jobs from standard input until it closes; see the module docstring."""
    import torch  # noqa: F401 - what pooling saves: every job after the first finds it imported
    import torch.distributed  # noqa: F401

    control = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # between jobs nothing but the control lines reaches the pool
    base_env = dict(os.environ)
    for line in sys.stdin:
        job = json.loads(line)
        os.environ.clear()
        os.environ.update(base_env)
        os.environ.update(job["env"])
        result_dir = Path(job["result_dir"])
        rank = int(job["env"]["TEST_RANK"])
        sys.stdout.flush()
        sys.stderr.flush()
        out = os.open(result_dir / f"rank{rank}.out", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        saved = os.dup(1), os.dup(2)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(out)
        threads_before, bindings = set(threading.enumerate()), _bindings()
        result = run(job["target"], job["kwargs"])
        (result_dir / f"rank{rank}.json").write_text(json.dumps(result))
        sys.stdout.flush()
        sys.stderr.flush()
        # where a one-shot worker would exit; the pool says whether to clean up (every rank is
        # done) or to exit as that worker would (peers still wait, and a live rank holds them)
        control.write("done\n")
        control.flush()
        clean = (sys.stdin.readline().strip() == "clean" and "value" in result and _left_clean(threads_before)
                 and not _rebound(bindings))
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, old in zip((1, 2), saved):
            os.dup2(old, fd)
            os.close(old)
        control.write("reuse\n" if clean else "retire\n")
        control.flush()
        if not clean:
            os._exit(0)


def zygote(control_fd: int) -> None:
    """Fork pooled ranks on request; report each one's end. Messages on the control socket
    (SOCK_SEQPACKET): in, ``spawn`` with three file descriptors (the rank's stdin, stdout and
    stderr); out, ``pid <pid>`` for each spawn and ``exit <pid> <code>`` when a rank ends, its
    code as subprocess gives it (negative: the signal that killed it)."""
    import torch  # noqa: F401 - what every forked rank finds imported
    import torch.distributed  # noqa: F401

    import smddp_lite  # noqa: F401

    control = socket.socket(fileno=control_fd)
    while True:
        # only this thread runs here, so a fork copies no lock held by another
        readable, _, _ = select.select([control], [], [], 0.01)
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            control.send(f"exit {pid} {os.waitstatus_to_exitcode(status)}".encode())
        if not readable:
            continue
        message, fds, _, _ = socket.recv_fds(control, 64, 3)
        if not message:  # the pool closed its end: the test session is over
            os._exit(0)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            try:
                control.close()
                for target, fd in enumerate(fds):
                    os.dup2(fd, target)
                    os.close(fd)
                sys.argv = [str(Path(__file__).resolve()), "--serve"]
                serve()
            except BaseException:
                traceback.print_exc()
                sys.stderr.flush()
                os._exit(1)
            os._exit(0)
        for fd in fds:
            os.close(fd)
        control.send(f"pid {pid}".encode())


if __name__ == "__main__":
    if sys.argv[1:2] == ["--zygote"]:
        zygote(int(sys.argv[2]))
    serve() if sys.argv[1:] == ["--serve"] else main()
