"""One rank of a test job: ``python tests/worker.py module:function '{"kwarg": 1}' RESULT_DIR``.

Writes ``RESULT_DIR/rank<R>.json`` with the function's return value or the exception it raised,
then exits without running interpreter teardown, so a broken process group cannot hang the exit.
"""

import ctypes
import importlib
import json
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


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


def main() -> None:
    target, kwargs, result_dir = sys.argv[1], json.loads(sys.argv[2]), Path(sys.argv[3])
    rank = _rank()
    module, function = target.split(":")
    try:
        value = getattr(importlib.import_module(module), function)(**kwargs)
        result = {"value": value}
    except BaseException:  # reported to the test, which decides
        result = {"error": traceback.format_exc()}
    (result_dir / f"rank{rank}.json").write_text(json.dumps(result))
    sys.stdout.flush()
    sys.stderr.flush()
    if "mpi4py.MPI" in sys.modules:
        _exit_after_mpi(rank)
    os._exit(0)


if __name__ == "__main__":
    main()
