"""``smddp_lite.init()``: one call that starts the default process group under any launcher."""

from __future__ import annotations

import ipaddress
import os
import socket
import threading
from datetime import timedelta

import torch.distributed as dist

from .._registration import BACKEND_NAME
from ..backend.errors import where


def _launched_by_mpi() -> bool:
    from smddp_lite.backend.transports.select import launched_by_mpi

    return launched_by_mpi()


def init(backend: str = BACKEND_NAME, init_method: str | None = None, rank: int | None = None,
         world_size: int | None = None, timeout: timedelta | None = None) -> dist.ProcessGroup:
    """Initialise the default process group, whichever way the job was started.

    * ``init_method`` (``tcp://host:port``, ``file:///path``) with ``rank`` and ``world_size``: used as given.
    * torchrun (``RANK`` and ``WORLD_SIZE`` set): ``env://``.
    * mpirun/mpiexec with no ``RANK``/``WORLD_SIZE``: rank and world size come from MPI, rank 0
      hosts the rendezvous store on a port the OS picks, and MPI tells the others where it is.
      ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and
      ``MASTER_PORT`` are then set for the rest of the script.
    * none of these: a group of one process.
    * a replacement that ``python -m smddp_lite.launch`` started into a job training with
      ``SurvivingSync``: a group of one process, to make the model on; ``SurvivingSync`` then
      joins the running job.

    Args:
        backend: torch.distributed backend name; "smddp" unless comparing against another.
        timeout: how long any collective may wait for peers before raising.

    Returns:
        The default process group. Calling ``init`` again returns it unchanged.

    Example::

        import smddp_lite
        smddp_lite.init()           # torchrun, mpirun or plain python
    """
    if dist.is_initialized():
        return dist.group.WORLD
    kwargs = {"timeout": timeout} if timeout is not None else {}
    if init_method is not None or rank is not None or world_size is not None:
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size, **kwargs)
    elif _replacing_a_rank_of_a_running_job():
        # a group of one to make the model (and a DDP of it) on: SurvivingSync then joins the job
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kwargs)
    elif "RANK" in os.environ and "WORLD_SIZE" in os.environ and not _set_by_mpi_rendezvous():
        dist.init_process_group(backend, init_method="env://", **kwargs)
    elif _launched_by_mpi():
        store, rank, world_size = _mpi_rendezvous(timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, **kwargs)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kwargs)
    return dist.group.WORLD


_STANDBY: list[dist.Store] = []
"""The running job's store, where init() made this replacement a group of one to wait in."""


def _replacing_a_rank_of_a_running_job() -> bool:
    """Asked only where the launcher says this process replaces a rank (``SMDDP_REPLACEMENT``): a
    job's first ranks must not dial a store to look for a job, since under launchers of others
    nothing may be listening yet."""
    if os.environ.get("SMDDP_REPLACEMENT") != "1":
        return False
    from ..membership.job_store import running_job_store

    store = running_job_store()
    if store is None:
        return False
    _STANDBY.append(store)
    return True


def standing_by() -> dist.Store | None:
    """The store of the job this process replaces a rank of, where ``init()`` made it a group of
    one (once: SurvivingSync takes it); None otherwise."""
    return _STANDBY.pop() if _STANDBY else None


def _mpi_rendezvous(timeout: timedelta | None):
    """Meet through MPI (``_meet_through_mpi``) within ``timeout`` (default 30 minutes), or raise.

    MPI's start-up waits for every rank with no timeout and no error: a rank that dies before it
    (or before the collectives that follow) leaves the others in MPI_Init for good, and under a
    launcher that lets the survivors live nothing ends them. So the meeting runs on a thread of
    its own (mpi4py asks for MPI_THREAD_MULTIPLE), and the caller raises once the timeout passes.
    Such a process cannot use MPI any more; it leaves the thread behind when it exits."""
    wait = timeout or timedelta(minutes=30)
    outcome: dict = {}

    def meet() -> None:
        try:
            outcome["met"] = _meet_through_mpi(wait)
        except BaseException as exc:  # raised again on the caller's thread
            outcome["error"] = exc

    thread = threading.Thread(target=meet, name="smddp-mpi-rendezvous", daemon=True)
    thread.start()
    thread.join(wait.total_seconds())
    if "error" in outcome:
        raise outcome["error"]
    if "met" not in outcome:
        rank = os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "?"))
        size = os.environ.get("PMI_SIZE", os.environ.get("OMPI_COMM_WORLD_SIZE", "?"))
        raise RuntimeError(
            f"{where(rank, size, 'init')} the ranks did not all meet through MPI within the timeout "
            f"({wait.total_seconds():g} s): a rank may have died or be stuck before or during MPI's start-up, "
            "where MPI itself reports nothing and waits forever. Look at the other ranks' output; to wait "
            "longer, pass smddp_lite.init(timeout=...).")
    return outcome["met"]


def _meet_through_mpi(store_timeout: timedelta):
    """Rank 0 opens a TCPStore on an OS-chosen port; an MPI broadcast tells every rank where."""
    from smddp_lite.backend.transports.mpi_environment import INSTALL_HINT, import_mpi

    try:
        MPI = import_mpi()
    except ImportError:
        raise ImportError(f"smddp-lite: launched by mpiexec but mpi4py is missing; {INSTALL_HINT}") from None
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    local = world.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    if rank == 0:
        try:
            host = store_address(os.environ.get("MASTER_ADDR"), one_host=local.Get_size() == size)
            store = open_store(host, size, store_timeout)
            address = (host, store.port)
        except (OSError, ValueError) as exc:  # every rank raises it, none waits for a store
            address = (None, f"{where(0, size, 'init')} {exc}")
    else:
        address = None
    host, port = world.bcast(address, root=0)
    if host is None:
        local.Free()
        raise RuntimeError(port if rank == 0 else f"{where(rank, size, 'init')} rank 0 opened no store: {port}")
    if rank != 0:
        store = dist.TCPStore(host, port, size, is_master=False, timeout=store_timeout)
    _MPI_ENV.clear()
    _MPI_ENV.update(RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(local.Get_rank()),
                    LOCAL_WORLD_SIZE=str(local.Get_size()), MASTER_ADDR=host, MASTER_PORT=str(port))
    os.environ.update(_MPI_ENV)
    local.Free()
    return store, rank, size


def store_address(master_addr: str | None, one_host: bool, setting: str = "MASTER_ADDR") -> str:
    """The one address the rendezvous store listens on and every rank dials.

    A job on one host uses loopback, reachable by no other machine; otherwise ``MASTER_ADDR`` or
    this host's name, resolved here so that the store listens on that address alone (torch's
    TCPStore listens on every interface; see docs/security.md). ``setting``: what the user sets
    to give the address (``MASTER_ADDR``, or the launcher's ``--master-addr``), named in errors."""
    if master_addr is None and one_host:
        return "127.0.0.1"
    name = master_addr or socket.gethostname()
    try:
        address = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)[0][4][0]
    except socket.gaierror as exc:
        raise OSError(f"cannot resolve the rendezvous host {name!r} ({exc.strerror}); set {setting} to "
                      "rank 0's address on the network the job uses") from None
    if not one_host and ipaddress.ip_address(address).is_loopback:
        raise ValueError(f"the job spans several hosts, and the rendezvous host {name!r} resolves to the loopback "
                         f"address {address}, which the other hosts cannot reach; set {setting} to rank 0's "
                         "address on the network the job uses")
    return address


def open_store(address: str, world_size: int | None, timeout: timedelta, port: int = 0) -> dist.TCPStore:
    """A TCPStore server listening on ``address`` only, on ``port`` (0: a port the OS picks).

    The socket is bound here and handed over (``master_listen_fd``), because TCPStore binds its
    own to every interface. ``SO_REUSEADDR`` as TCPStore sets it: a fixed port is free again as
    soon as the last store on it closed, not once its connections' TIME_WAIT ends."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((address, port))
        sock.listen(socket.SOMAXCONN)
        port = sock.getsockname()[1]
    except OSError:
        sock.close()
        raise
    return dist.TCPStore(address, port, world_size, is_master=True, timeout=timeout, wait_for_workers=False,
                         master_listen_fd=sock.detach())  # the store owns and closes the socket


_MPI_ENV: dict[str, str] = {}
"""The variables the last MPI rendezvous set for code that reads them (RANK, MASTER_PORT, ...)."""


def _set_by_mpi_rendezvous() -> bool:
    """Whether RANK and WORLD_SIZE are the ones an earlier MPI rendezvous of this process set. A
    new init (after destroy_process_group) must then meet again through MPI: taken as torchrun's,
    they sent every rank to the old store's port, where rank 0 had opened a new one, and ranks
    timed out or were reset now and then. Only these two are compared, so that every rank decides
    alike when code rewrites MASTER_ADDR or the like on some ranks."""
    return bool(_MPI_ENV) and all(os.environ.get(k) == _MPI_ENV[k] for k in ("RANK", "WORLD_SIZE"))


_HELD_STORE: list[dist.Store] = []
"""The store an MPI meeting for env:// opened: rank 0's process serves it for the whole job."""


def meet_for_env_rendezvous(timeout: timedelta | None = None) -> None:
    """Under an MPI launcher that set no ``RANK``/``WORLD_SIZE``, meet through MPI now, so that a
    later ``dist.init_process_group(backend="smddp")`` (env://, torch's default) finds them, and
    ``MASTER_ADDR``/``MASTER_PORT``, set.

    This is what scripts written for AWS's library need: SageMaker's "smdistributed dataparallel"
    distribution starts them with mpirun, and they call ``init_process_group`` with no
    ``init_method``. Rank 0's process already serves the store, so every rank, rank 0 too, dials
    it as a client, as torchrun's workers dial their agent's (``TORCHELASTIC_USE_AGENT_STORE``).
    Does nothing elsewhere, or once a group exists."""
    if dist.is_initialized() or not _launched_by_mpi() or _HELD_STORE:
        return
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return
    store, _, _ = _mpi_rendezvous(timeout)
    _HELD_STORE.append(store)
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = str(True)
