"""Which transport a group uses, decided once per group by its rank 0 and followed by all."""

from __future__ import annotations

import logging
import os
import platform
import socket

from .. import agreement
from .. import sagemaker_host
from ..errors import where
from .base import Transport
from .hierarchical import Topology
from .mpi_environment import INSTALL_HINT as MPI_INSTALL_HINT, cross_memory_attach_permitted
from .refusals import RefusalBoard
from .shared_settings import disagreement, shared_values

log = logging.getLogger("smddp_lite")

MPI_LAUNCHER_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS", "HYDRA_CONTROL_FD")


def launched_by_mpi() -> bool:
    """True when an MPI launcher (Open MPI, MPICH/Hydra, PMIx) started this process."""
    return any(v in os.environ for v in MPI_LAUNCHER_VARS)


def host_name(config) -> str:
    """The host identity used to find ranks that can share memory: SMDDP_HOSTNAME, else the
    host's name in a SageMaker job (whose containers' own names may not tell hosts apart), else
    the hostname."""
    return config.hostname or sagemaker_host.current_host() or socket.gethostname()


def _shm_possible() -> bool:
    return platform.machine() in ("x86_64", "AMD64") and os.path.isdir("/dev/shm")


def _choose(store, rank: int, world_size: int, config) -> tuple[str, str, list[str]]:
    """(transport, reason, every rank's host); ranks publish their host name and the settings
    they must share, every rank checks those, rank 0 decides."""
    # one key per rank for both: a group's init reads them in one multi_get on every rank
    everyone = agreement.exchange_in_store(store, "host", rank, world_size,
                                           f"{host_name(config)}\n{shared_values(config)}")
    hosts, published = zip(*(value.split("\n", 1) for value in everyone))
    hosts = list(hosts)
    differ = disagreement(list(published))
    if differ is not None:  # every rank read the same keys: each raises this itself
        raise ValueError(f"{where(rank, world_size, 'init')} {differ}")
    if rank != 0:
        name, reason = store.get("transport").decode().split("|", 1)
        if name == "error":  # rank 0 refused the choice: every rank says why, not only rank 0
            raise ValueError(f"{where(rank, world_size, 'init')} {reason}")
        return name, reason, hosts
    forced = config.transport
    same_host = len(set(hosts)) == 1
    topo = Topology(hosts)
    # one rank per host still goes through the hierarchical transport: its inter-host step keeps
    # 16-bit inputs (and SMDDP_INTER_NODE_WIRE_DTYPE sums) 16-bit on the wire, where the flat gloo
    # path would widen them to float32
    layered = len(topo.local) > 1 and topo.uniform
    if config.algorithm == "hierarchical" or (config.algorithm == "auto" and forced == "auto"):
        if layered:
            # the parts the intra factory below builds: none for hosts of one rank
            inside = "" if len(topo.local[0]) == 1 else \
                f"{'shared memory' if _shm_possible() else 'gloo'} inside hosts, "
            name, reason = "hierarchical", f"{topo.describe()}: {inside}gloo between"
            store.set("transport", f"{name}|{reason}")
            return name, reason, hosts
        if config.algorithm == "hierarchical":
            log.info("smddp: SMDDP_ALGORITHM=hierarchical has no effect on %s; using a flat transport",
                     topo.describe())
    under_mpi = launched_by_mpi() and _has_mpi4py()
    if forced != "auto":
        name, reason = forced, "forced by SMDDP_TRANSPORT"
    elif under_mpi and _mpi_preferred(same_host):
        # measured on one 2-core host: MPICH's shared-memory path has half our shm transport's
        # small-message latency (35 vs 60 us) and the same bandwidth (benchmarks/results/)
        name, reason = "mpi", f"launched by mpiexec, ranks on {len(set(hosts))} host(s)"
    elif same_host and _shm_possible():
        name, reason = "shm", f"all {world_size} ranks on host {hosts[0]}"
        if under_mpi:
            reason += "; launched by mpiexec, but process_vm_readv is forbidden here, and MPICH is slower without it"
    else:
        name, reason = "gloo", f"ranks on {len(set(hosts))} hosts"
    if name == "shm" and not same_host:
        why = (f"SMDDP_TRANSPORT=shm needs every rank on one host; found hosts {sorted(set(hosts))}. Unset "
               "SMDDP_TRANSPORT or use gloo/mpi.")
        store.set("transport", f"error|{why}")
        raise ValueError(f"{where(rank, world_size, 'init')} {why}")
    store.set("transport", f"{name}|{reason}")
    return name, reason, hosts


def _mpi_preferred(same_host: bool) -> bool:
    """Whether a job that mpiexec started runs on MPI: yes, unless every rank shares a host where
    shared memory works and process_vm_readv is forbidden (a container without CAP_SYS_PTRACE).
    MPICH then copies large messages through its queues (mpi_environment.py), and in the
    project's image ran all_reduce, all_gather and broadcast 1.4-2.2x slower than shm from
    256 KiB to 4 MiB, tied all_reduce above, and took 87x as long for a 64 MiB broadcast
    (benchmarks/results/2026-11-23-docker-image.md)."""
    return not (same_host and _shm_possible()) or cross_memory_attach_permitted()


def _has_mpi4py() -> bool:
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return False
    return True


def create_transport(store, rank: int, world_size: int, global_ranks, timeout, config) -> tuple[Transport, str]:
    """Build this group's transport; returns it and the reason it was chosen (for the log)."""
    if world_size == 1:
        from .local import LocalTransport

        return LocalTransport(), "a group of one rank"
    name, reason, hosts = _choose(store, rank, world_size, config)
    if name == "shm":
        from .shm import ShmTransport

        return ShmTransport(store, rank, world_size, config.shm_chunk_bytes, timeout), reason
    if name == "hierarchical":
        from .hierarchical import HierarchicalTransport

        def intra(sub_store, sub_rank, sub_size, **shown):
            if sub_size == 1:
                from .local import LocalTransport

                return LocalTransport(**shown)
            if _shm_possible():
                from .shm import ShmTransport

                return ShmTransport(sub_store, sub_rank, sub_size, config.shm_chunk_bytes, timeout, **shown)
            from .gloo import GlooTransport

            return GlooTransport(sub_store, sub_rank, sub_size, timeout, config.scratch_max_bytes, **shown)

        return HierarchicalTransport(store, rank, world_size, Topology(hosts), intra, timeout, config), reason
    if name == "mpi":
        if not _has_mpi4py():
            raise ImportError(
                f"{where(rank, world_size, 'init')} the MPI transport needs mpi4py: {MPI_INSTALL_HINT}"
            )
        from .mpi import MPITransport

        # an MPI error can stay on the rank that had it: peers hear of it on the board
        return MPITransport(rank, world_size, global_ranks, timeout, store,
                            refusals=RefusalBoard(store, rank, world_size, timeout, hears_failures=True)), reason
    from .gloo import GlooTransport

    # gloo's and MPI's waits hear of a peer's refusal or different call only through the store
    # (shared memory has flags of its own; the hierarchical transport makes one for its parts),
    # and a rank on another host of a peer's death (gloo shows them only this host's address)
    return GlooTransport(store, rank, world_size, timeout, config.scratch_max_bytes,
                         refusals=RefusalBoard(store, rank, world_size, timeout, hears_failures=True)), reason
