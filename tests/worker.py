"""One rank of a test job: ``python tests/worker.py module:function '{"kwarg": 1}' RESULT_DIR``.

Writes ``RESULT_DIR/rank<R>.json`` with the function's return value or the exception it raised,
then exits without running interpreter teardown, so a broken process group cannot hang the exit.
"""

import importlib
import json
import os
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _rank() -> int:
    for var in ("TEST_RANK", "RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK"):
        if var in os.environ:
            return int(os.environ[var])
    return 0


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
        from mpi4py import MPI

        if MPI.Is_initialized() and not MPI.Is_finalized():
            MPI.Finalize()
    os._exit(0)


if __name__ == "__main__":
    main()
