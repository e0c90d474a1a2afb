"""smddp-lite: an open data-parallel communication library for PyTorch.

Importing it registers the torch.distributed backend "smddp"::

    import smddp_lite
    import torch.distributed as dist

    smddp_lite.init()   # or dist.init_process_group(backend="smddp") under torchrun

``smddp_lite.init()`` works under torchrun, with an explicit ``init_method`` and rank/world size,
and under mpirun/mpiexec (rank and world size from the MPI launcher).
"""

import logging as _logging

from ._registration import BACKEND_NAME, register as _register
from .hyperparams import scale_lr
from .launch import init
from .backend.flight_recorder import dump as dump_fr_trace, write as write_fr_trace

__version__ = "0.1.0"
__all__ = ["BACKEND_NAME", "ElasticSampler", "SurvivingSync", "compile", "dump_fr_trace", "init", "scale_lr", "write_fr_trace",
           "__version__"]

_register()


def __getattr__(name: str):
    # the compiler (and Triton behind it) is imported on first use: torch imports this package
    # at its own import (the "torch.backends" entry point), where only the backend is needed
    if name == "compile":
        from .compiler import compile

        globals()["compile"] = compile
        return compile
    if name == "ElasticSampler":
        from .sampling import ElasticSampler

        globals()["ElasticSampler"] = ElasticSampler
        return ElasticSampler
    if name == "SurvivingSync":
        from .surviving import SurvivingSync

        globals()["SurvivingSync"] = SurvivingSync
        return SurvivingSync
    raise AttributeError(f"module 'smddp_lite' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), "compile", "SurvivingSync"})

# One line on rank 0 says which transport runs (SMDDP users were bitten by silent fallbacks).
# Applications that configure logging themselves keep full control of this logger.
_log = _logging.getLogger("smddp_lite")
if not _log.handlers and not _logging.getLogger().handlers:
    _handler = _logging.StreamHandler()
    _handler.setFormatter(_logging.Formatter("%(message)s"))
    _log.addHandler(_handler)
    _log.setLevel(_logging.INFO)
    _log.propagate = False

# Under an MPI launcher, settle what MPICH must know before it starts, in case the script starts
# MPI itself (``from mpi4py import MPI``) before smddp_lite would (backend/transports/mpi_environment.py).
from .launch import _launched_by_mpi  # noqa: E402

if _launched_by_mpi():
    from smddp_lite.backend.transports.mpi_environment import prepare as _prepare_mpi

    _prepare_mpi()
