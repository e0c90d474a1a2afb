"""One rank of a test job: ``python tests/worker.py module:function '{"kwarg": 1}' RESULT_DIR``.

Writes ``RESULT_DIR/rank<R>.json`` with the function's return value or the exception it raised,
then exits without running interpreter teardown, so a broken process group cannot hang the exit.

``python tests/worker.py --zygote FD`` imports once what every job's ranks would import (torch,
this project, and the modules the flight recorder's first dump loads) and then only forks: each
request on the socket FD carries a new rank's standard input, output and error (rank_pool.py).
The child reads one job from standard input (its target, arguments, environment and result
directory), runs it, and exits as a one-shot worker does. A job's ranks are fresh forks, so no
job sees another's state, and none pays the seconds a new interpreter takes to import torch.
"""

import ctypes
import gc
import importlib
import json
import os
import select
import socket
import sys
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


def _leave(rank: int, result: dict, result_dir: Path) -> None:
    """Write the result and exit, skipping interpreter teardown (see ``_exit_after_mpi``)."""
    (result_dir / f"rank{rank}.json").write_text(json.dumps(result))
    sys.stdout.flush()
    sys.stderr.flush()
    # a program whose peer died leaves without MPI_Finalize, which would wait for that peer
    if "mpi4py.MPI" in sys.modules and not os.environ.get("TEST_SKIP_MPI_FINALIZE"):
        _exit_after_mpi(rank)
    os._exit(0)


def _mark_pid(rank: int, result_dir: Path) -> None:
    """RESULT_DIR/rank<R>.pid, before the program runs: what a test knows of a rank that is then
    killed (the segments it made carry this pid in their names)."""
    (result_dir / f"rank{rank}.pid").write_text(str(os.getpid()))


def main() -> None:
    target, kwargs, result_dir, rank = sys.argv[1], json.loads(sys.argv[2]), Path(sys.argv[3]), _rank()
    _mark_pid(rank, result_dir)
    _leave(rank, run(target, kwargs), result_dir)


def _run_one_job() -> None:
    """In a rank forked from the zygote: the job on standard input, in its own environment."""
    job = json.loads(sys.stdin.readline())
    os.environ.update(job["env"])
    rank, result_dir = int(job["env"]["TEST_RANK"]), Path(job["result_dir"])
    _mark_pid(rank, result_dir)
    _leave(rank, run(job["target"], job["kwargs"]), result_dir)


def _import_what_ranks_share() -> None:
    """What a fresh rank would import anyway. The flight recorder (on by default) dumps in every
    rank that fails or hears a peer fail, and naming the dump's frames imports torch's dynamo and
    inductor, about 900 modules: 2 to 5 s of CPU per rank on the 2-core machine, paid here once."""
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401

    import smddp_lite  # noqa: F401
    from smddp_lite.backend import flight_recorder

    flight_recorder._frames([flight_recorder._gather_stack()])


def zygote(control_fd: int) -> None:
    """Fork ranks on request; report each one's end. Messages on the control socket
    (SOCK_SEQPACKET): in, ``spawn`` with three file descriptors (the rank's stdin, stdout and
    stderr); out, ``pid <pid>`` for each spawn and ``exit <pid> <code>`` when a rank ends, its
    code as subprocess gives it (negative: the signal that killed it)."""
    _import_what_ranks_share()
    # what the zygote holds stays out of the children's collections, which would otherwise touch
    # (and so copy) every page of it in each child
    gc.freeze()
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
                sys.argv = [str(Path(__file__).resolve())]
                _run_one_job()
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
    main()
