"""``python -m smddp_lite.launch``: start a host's ranks, and replace only the one that fails.

torchrun's agent ends every worker of its group when one fails, then starts them all again;
with ``SurvivingSync`` the others keep training, and only the lost rank needs a successor. So
each rank here runs in a process context of its own (torch.distributed.elastic's
``start_processes``, which ends all of a context's processes when one fails), and a rank whose
process ends with an error while the job still trains is started again as a replacement, which
``SurvivingSync`` admits at the next step.

The rendezvous store lives in the first host's launcher, not in a rank: the survivors meet
there after a loss. It listens on one address only (loopback for a job on one host, else
``--master-addr``), not on every interface as torch's TCPStore does (docs/security.md). Every
host's launcher writes how many of its ranks run, so that each can end its ranks once fewer
than ``--min-world-size`` are left in the whole job.

The launcher's exit status is the job's: 0 once a rank finished with 0 and no process failed
after it, else that of the last failure that was not replaced (128 + the signal's number for a
rank killed by a signal, as shells say it).
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes
from torch.distributed.elastic.multiprocessing.api import PContext, SignalException

from ..membership.job_store import finished, job_store
from . import open_store, store_address

_log = logging.getLogger("smddp_lite.launch")

_POLL_S = 0.1  # how often the launcher looks at its ranks
# what the ranks see as torchrun's restart count: this launcher replaces ranks, it never restarts
# the job, so the job's keys in the store (smddp_lite/membership/job_store.py) stay under one prefix
_RESTART_COUNT = "0"
_ALIVE = "smddp-launch/alive/"  # + host index: how many of that host's ranks run


@dataclass
class _Slot:
    """One local rank's place: the process that holds it now, and how many held it before."""

    local_rank: int
    rank: int
    context: PContext | None = None
    started: int = 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m smddp_lite.launch",
        description="Start this host's ranks of a SurvivingSync job and replace a rank that fails, leaving the others "
                    "training. Flags as torchrun's.")
    parser.add_argument("--nproc-per-node", "--nproc_per_node", type=int, default=1, help="ranks on this host")
    parser.add_argument("--nnodes", type=int, default=1, help="hosts in the job, one launcher on each")
    parser.add_argument("--node-rank", "--node_rank", type=int, default=0, help="this host's index (0 hosts the store)")
    parser.add_argument("--master-addr", "--master_addr", default=None,
                        help="the first host's address, where the store listens on that address alone and every "
                             "launcher and rank dials it (default: loopback on one host; on several, the first host "
                             "listens on its host name's address, and the others must be given it)")
    parser.add_argument("--master-port", "--master_port", type=int, default=None,
                        help="the store's port (default: a free port on one host, 29500 on several)")
    parser.add_argument("--max-restarts", "--max_restarts", type=int, default=3,
                        help="replacements this launcher may start over the job")
    parser.add_argument("--min-world-size", "--min_world_size", type=int, default=1,
                        help="end the job once fewer ranks than this run on all hosts together")
    parser.add_argument("--store-outside", action="store_true",
                        help="no launcher hosts the store: it runs at --master-addr:--master-port on its own")
    parser.add_argument("--store-timeout", type=float, default=300.0,
                        help="seconds a launcher waits for the first host's store")
    parser.add_argument("--log-dir", default=None, help="keep each process's error file here (default: a "
                        "temporary folder, removed at the end)")
    parser.add_argument("-m", "--module", action="store_true", help="run the script as a module (python -m)")
    parser.add_argument("--no-python", "--no_python", action="store_true",
                        help="run the script as a program, not through this Python")
    parser.add_argument("script", help="the training script (or module, or program)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER)
    return parser


def _store(args: argparse.Namespace) -> tuple[str, dist.TCPStore]:
    """The job's store, and the address its ranks dial. The first host's launcher hosts it (unless
    --store-outside), listening on one address only (docs/security.md): loopback for a job on one
    host, else --master-addr (or the host's name), resolved. Every other launcher dials it."""
    port = args.master_port if args.master_port is not None else (0 if args.nnodes == 1 else 29500)
    timeout = timedelta(seconds=args.store_timeout)
    if args.node_rank != 0 or args.store_outside:
        if args.master_addr is None and args.nnodes > 1:
            where = "--store-outside" if args.store_outside else f"--node-rank {args.node_rank}"
            raise SystemExit(f"smddp launch: {where} expected --master-addr, the address of the host whose store "
                             "this launcher dials; found none. Give every launcher the first host's address on the "
                             "network the job uses (the same --master-addr for all)")
        address = args.master_addr or "127.0.0.1"
        return address, dist.TCPStore(address, port, is_master=False, timeout=timeout)
    try:
        address = store_address(args.master_addr, one_host=args.nnodes == 1, setting="--master-addr")
    except (OSError, ValueError) as exc:
        raise SystemExit(f"smddp launch: {exc}") from None
    try:
        return address, open_store(address, None, timeout, port=port)
    except OSError as exc:
        given = "" if args.master_addr in (None, address) else f" (--master-addr {args.master_addr})"
        at = f"{address}:{port}" if port else f"{address} (on a free port)"
        if exc.errno == errno.EADDRINUSE:
            fix = ("another process listens there; give another --master-port, or on one host leave it out for a "
                   "free port")
        elif exc.errno == errno.EADDRNOTAVAIL:
            fix = ("that is no address of this host, and the first host (--node-rank 0) hosts the store: give it its "
                   "own address on the network the job uses, or --store-outside where the store runs elsewhere")
        else:
            fix = "give --master-addr and --master-port an address of this host and a port it may listen on"
        raise SystemExit(f"smddp launch: expected to open the job's store on {at}{given}; found the error "
                         f"\"{exc.strerror or exc}\": {fix}") from None


class Launcher:
    """This host's ranks of one job, each in a process context of its own."""

    def __init__(self, args: argparse.Namespace) -> None:
        if args.nproc_per_node < 1 or args.nnodes < 1 or not 0 <= args.node_rank < args.nnodes:
            raise SystemExit(f"smddp launch: expected --nproc-per-node >= 1, --nnodes >= 1 and 0 <= --node-rank < "
                             f"--nnodes; found {args.nproc_per_node}, {args.nnodes} and {args.node_rank}")
        if args.max_restarts < 0 or args.min_world_size < 1:
            raise SystemExit(f"smddp launch: expected --max-restarts >= 0 and --min-world-size >= 1; found "
                             f"{args.max_restarts} and {args.min_world_size}")
        if args.store_outside and args.master_port is None:
            raise SystemExit("smddp launch: --store-outside expected --master-port, the port of the store that runs on "
                             "its own; found none")
        self.args = args
        self.world_size = args.nnodes * args.nproc_per_node
        # the store outlives every rank: the survivors meet in it after a loss
        self.master_addr, self.store = _store(args)
        self.port = self.store.port
        self.run_id = f"smddp-{os.getpid()}-{socket.gethostname()}"
        self._log_dir = args.log_dir or tempfile.mkdtemp(prefix="smddp-launch-")
        first = args.node_rank * args.nproc_per_node
        self.slots = [_Slot(i, first + i) for i in range(args.nproc_per_node)]
        self.restarts_left = args.max_restarts
        self.succeeded_at: float | None = None
        self.last_failure: tuple[float, int] | None = None  # (when, status) of the last unreplaced failure
        self._alive_said: int | None = None

    # the processes ------------------------------------------------------------------------------
    def _env(self, slot: _Slot) -> dict[str, str]:
        a = self.args
        env = {
            "RANK": str(slot.rank), "WORLD_SIZE": str(self.world_size), "LOCAL_RANK": str(slot.local_rank),
            "LOCAL_WORLD_SIZE": str(a.nproc_per_node), "GROUP_RANK": str(a.node_rank),
            "ROLE_RANK": str(slot.rank), "ROLE_WORLD_SIZE": str(self.world_size), "ROLE_NAME": "default",
            "MASTER_ADDR": self.master_addr, "MASTER_PORT": str(self.port),
            # the store is the launcher's: a rank that starts after the job began joins it as a
            # replacement (SurvivingSync), and no rank's exit takes the store with it
            "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": _RESTART_COUNT,
            "TORCHELASTIC_MAX_RESTARTS": str(a.max_restarts), "TORCHELASTIC_RUN_ID": self.run_id,
        }
        if slot.started:  # smddp_lite.init() then waits in a group of one for SurvivingSync to join the job
            env["SMDDP_REPLACEMENT"] = "1"
        if a.nproc_per_node > 1 and "OMP_NUM_THREADS" not in os.environ:
            env["OMP_NUM_THREADS"] = "1"  # as torchrun: ranks sharing a host do not oversubscribe it
        return env

    def _command(self) -> tuple[str, tuple[str, ...]]:
        a = self.args
        if a.no_python:
            return a.script, tuple(a.script_args)
        if a.module:
            return sys.executable, ("-u", "-m", a.script, *a.script_args)
        return sys.executable, ("-u", a.script, *a.script_args)

    def _start(self, slot: _Slot) -> None:
        entrypoint, args = self._command()
        logs = DefaultLogsSpecs(log_dir=os.path.join(self._log_dir, f"rank{slot.rank}-{slot.started}"))
        slot.context = start_processes(name=f"rank{slot.rank}", entrypoint=entrypoint, args={0: args},
                                       envs={0: self._env(slot)}, logs_specs=logs)
        slot.started += 1

    # the job --------------------------------------------------------------------------------------
    def run(self) -> int:
        for slot in self.slots:
            self._start(slot)
        try:
            while any(slot.context is not None for slot in self.slots):
                for slot in self.slots:
                    if slot.context is not None:
                        self._look_at(slot)
                self._say_alive()
                if self._too_few():
                    return self._end_for_too_few()
                time.sleep(_POLL_S)
        except SignalException as exc:  # SIGTERM or SIGINT to the launcher: its ranks end with it
            _log.warning("smddp launch: %s; ending this host's ranks", exc)
            self._close_all(exc.sigval)
            return 128 + int(exc.sigval)
        finally:
            self._close_all(signal.SIGTERM)
            if self.args.log_dir is None:
                shutil.rmtree(self._log_dir, ignore_errors=True)
        return self._status()

    def _look_at(self, slot: _Slot) -> None:
        result = slot.context.wait(0)
        if result is None:
            return
        slot.context.close()
        slot.context = None
        failure = next(iter(result.failures.values()), None) if result.is_failed() else None
        now = time.monotonic()
        if failure is None:
            self.succeeded_at = self.succeeded_at or now
            return
        status = failure.exitcode if failure.exitcode >= 0 else 128 - failure.exitcode
        if slot.started > 1 and self._job_finished():
            # a replacement that found the job over (SurvivingSync's JobFinishedError): not a failure
            _log.warning("smddp launch: rank %d's replacement (pid %d) found the job finished and ended (status "
                         "%d); nothing to replace", slot.rank, failure.pid, status)
            return
        if self._job_still_trains() and self.restarts_left > 0:
            self.restarts_left -= 1
            _log.warning("smddp launch: rank %d (pid %d) failed with status %d; starting a replacement "
                         "(%d restarts left)", slot.rank, failure.pid, status, self.restarts_left)
            self._start(slot)
            return
        self.last_failure = (now, status)
        why = "no restart left" if self.restarts_left == 0 else "no rank of the job runs"
        _log.warning("smddp launch: rank %d (pid %d) failed with status %d; not replaced (%s)", slot.rank,
                     failure.pid, status, why)

    def _running_here(self) -> int:
        return sum(slot.context is not None for slot in self.slots)

    def _say_alive(self) -> None:
        alive = self._running_here()
        if alive != self._alive_said:
            self.store.set(f"{_ALIVE}{self.args.node_rank}", str(alive))
            self._alive_said = alive

    def _alive_in_job(self) -> int:
        if self.args.nnodes == 1:
            return self._running_here()
        keys = [f"{_ALIVE}{n}" for n in range(self.args.nnodes)]
        if not self.store.check(keys):  # a host whose launcher has not started counts as all alive
            return self.world_size
        return sum(int(v) for v in self.store.multi_get(keys))

    def _job_still_trains(self) -> bool:
        """A successor is started only into a job that trains: once a rank finished with 0, or a
        member on any host marked the job finished, the job is ending, and with no rank left
        there is no one to admit it."""
        return self.succeeded_at is None and self._alive_in_job() > 0 and not self._job_finished()

    def _job_finished(self) -> bool:
        """A member marked the job finished in the store (SurvivingSync.close, or its clean exit)."""
        return finished(job_store(self.store, _RESTART_COUNT)) is not None

    def _too_few(self) -> bool:
        return self.succeeded_at is None and self._alive_in_job() < self.args.min_world_size

    def _end_for_too_few(self) -> int:
        alive = self._alive_in_job()
        _log.error("smddp launch: %d ranks run in the job, fewer than --min-world-size=%d; ending this host's ranks",
                   alive, self.args.min_world_size)
        self._close_all(signal.SIGTERM)
        return self.last_failure[1] if self.last_failure else 1

    def _close_all(self, sig: signal.Signals) -> None:
        for slot in self.slots:
            if slot.context is not None:
                slot.context.close(death_sig=sig, timeout=10)
                slot.context = None

    def _status(self) -> int:
        if self.succeeded_at is not None and (self.last_failure is None or self.last_failure[0] < self.succeeded_at):
            return 0
        return self.last_failure[1] if self.last_failure else 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = _parser().parse_args(argv)
    return Launcher(args).run()
