"""Starting MPI where the machine forbids what MPICH would otherwise use: cross-memory attach.

MPICH copies large messages between ranks of one host with one ``process_vm_readv`` (CMA). Docker's
default seccomp profile, and Kubernetes' RuntimeDefault, forbid that call to processes without
CAP_SYS_PTRACE, and MPICH does not fall back: the first large message fails with "Other MPI error"
on the reading rank. Measured in this project's image (docker/Dockerfile) under ``mpiexec -n 2``:
the example job failed at its first broadcast of the model. So before MPI starts, this module
asks the kernel whether this process may use the call at all and, where it may not and the user
has not chosen, tells MPICH to copy through its shared-memory queues instead, as it already
moves small messages. Large ones cost more that way (1.2-4x as long from 1 MiB up in the image,
benchmarks/results/2026-11-23-docker-image.md), so a group whose ranks share one host takes the
shm transport there instead of MPI (select.py).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import logging
import os
import sys

log = logging.getLogger("smddp_lite")

INSTALL_HINT = "pip install mpi4py mpich (smddp-lite's [mpi] extra: pip install -e '.[mpi]' in its checkout)"
"""What to install where mpi4py is missing: smddp-lite is not on PyPI, so its extra works only
from a checkout."""
CMA_SETTINGS = ("MPIR_CVAR_CH4_CMA_ENABLE", "MPICH_CH4_CMA_ENABLE")
"""MPICH's two names for the switch; a user who set either has chosen."""
OPEN_MPI_CMA_SETTING = "OMPI_MCA_btl_vader_single_copy_mechanism"
"""Open MPI's switch (4.x's shared-memory BTL, vader; 5.x reads the same name as an alias)."""
_warned = False


class _IOVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("length", ctypes.c_size_t)]


@functools.lru_cache(maxsize=None)
def cross_memory_attach_permitted() -> bool:
    """Whether ``process_vm_readv`` may run in this process: it reads 8 bytes of the process's own
    memory, which ptrace rules always allow, so the only refusal left is a seccomp filter's (EPERM,
    or ENOSYS where the filter says so). True on systems where the call cannot be looked up.
    Asked once per process (import, MPI start, transport choice, error text ask again): a seccomp
    filter, once installed, cannot be removed."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        call = libc.process_vm_readv
    except (OSError, AttributeError):
        return True
    source, target = ctypes.create_string_buffer(8), ctypes.create_string_buffer(8)
    local, remote = _IOVec(ctypes.addressof(target), 8), _IOVec(ctypes.addressof(source), 8)
    if call(os.getpid(), ctypes.byref(local), 1, ctypes.byref(remote), 1, 0) == 8:
        return True
    return ctypes.get_errno() not in (errno.EPERM, errno.ENOSYS)


def cma_requested_where_blocked() -> bool:
    """True when the user turned MPICH's cross-memory attach on and this process may not use it:
    what an MPI error's message should point at."""
    return any(os.environ.get(name) not in (None, "", "0") for name in CMA_SETTINGS) \
        and not cross_memory_attach_permitted()


def _launched_by_open_mpi() -> bool:
    return "OMPI_COMM_WORLD_SIZE" in os.environ


def prepare() -> None:
    """Tell MPI to do without cross-memory attach where it is forbidden and the user has not
    chosen: MPICH through ``MPIR_CVAR_CH4_CMA_ENABLE=0``, Open MPI (whose shared-memory BTL fails
    the same way) through ``OMPI_MCA_btl_vader_single_copy_mechanism=none``, as SageMaker's
    toolkit passes to its mpirun. It must run before MPI starts (importing ``mpi4py.MPI`` starts
    it): ``import smddp_lite`` runs it in jobs an MPI launcher started, and ``import_mpi`` again.
    If MPI started first, the choice is logged (once) instead of made."""
    global _warned
    name, value = (OPEN_MPI_CMA_SETTING, "none") if _launched_by_open_mpi() else (CMA_SETTINGS[0], "0")
    chosen = (OPEN_MPI_CMA_SETTING,) if _launched_by_open_mpi() else CMA_SETTINGS
    if any(setting in os.environ for setting in chosen) or cross_memory_attach_permitted():
        return
    if "mpi4py.MPI" in sys.modules:
        if not _warned:
            _warned = True
            log.warning("smddp: process_vm_readv is forbidden here, and MPI was started before smddp_lite could "
                        "tell it; its large messages between ranks of a host will fail. Set %s=%s in the "
                        "job's environment, or import smddp_lite before mpi4py.MPI.", name, value)
        return
    os.environ[name] = value
    if os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")) == "0":  # one line per job
        log.info("smddp: process_vm_readv is forbidden here (a container without CAP_SYS_PTRACE?); "
                 "MPI copies large messages through shared memory instead (%s=%s)", name, value)


def import_mpi():
    """``mpi4py.MPI``, started after ``prepare``."""
    prepare()
    from mpi4py import MPI

    return MPI
