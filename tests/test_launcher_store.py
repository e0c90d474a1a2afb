"""``python -m smddp_lite.launch``'s rendezvous store listens on one address: loopback for a job
on one host, else ``--master-addr``; never on every interface, as torch's own TCPStore does
(docs/security.md). The store holds the job's membership, so a stranger who reaches it could
add a member or rewrite them.

The jobs' ranks run a small program (no torch) that writes the MASTER_ADDR and MASTER_PORT the
launcher gave it, then waits until the test releases it; meanwhile the test dials the store."""

from __future__ import annotations

import contextlib
import gc
import ipaddress
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from smddp_lite.launch.launcher import _ALIVE, Launcher, _parser

from . import harness, tiers

WAIT_S = 120.0  # for a launcher to start its ranks: a bound, not a timing; torch's import alone takes seconds

RANK_PROGRAM = """\
import json, os, sys, time
from pathlib import Path

marks = Path(sys.argv[1])
seen = {k: os.environ[k] for k in ("RANK", "MASTER_ADDR", "MASTER_PORT")}
(marks / f"rank{seen['RANK']}.tmp").write_text(json.dumps(seen))
(marks / f"rank{seen['RANK']}.tmp").rename(marks / f"rank{seen['RANK']}.json")  # whole, or not there yet
deadline = time.monotonic() + 300  # ends by itself if the test never releases it
while not (marks / "release").exists() and time.monotonic() < deadline:
    time.sleep(0.1)
"""


# an address of this machine that is not loopback ------------------------------------------------------
def _addresses_of_this_host() -> list[str]:
    """This machine's IPv4 addresses outside 127.0.0.0/8: its interfaces' (``ip``), else its name's."""
    found = []
    with contextlib.suppress(FileNotFoundError):
        listed = subprocess.run(["ip", "-4", "-o", "addr", "show", "up"], capture_output=True, text=True, timeout=30)
        found += re.findall(r"\binet (\d+\.\d+\.\d+\.\d+)/", listed.stdout)
    with contextlib.suppress(OSError):
        found += [info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)]
    return list(dict.fromkeys(a for a in found if not ipaddress.ip_address(a).is_loopback))


@pytest.fixture(scope="module")
def outside_address():
    """An address of this machine, not loopback, that a socket can bind. Where it has none, one
    end of a veth pair made here for the module (root only) holds one; else the tests skip."""
    for address in _addresses_of_this_host():
        try:
            _free_port(address)
        except OSError:
            continue
        yield address
        return
    if os.geteuid() != 0:
        pytest.skip("this machine has no address outside loopback, and only root can add an interface for one")
    device, address = f"smddpst{os.getpid() % 100000}", f"198.18.{os.getpid() % 250 + 1}.{os.getpid() % 200 + 2}"
    made = subprocess.run(["ip", "link", "add", device, "type", "veth", "peer", "name", f"{device}p"],
                          capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"this machine has no address outside loopback, and no veth pair could be made for one: "
                    f"{made.stderr.strip()}")
    try:
        for step in (["addr", "add", f"{address}/32", "dev", device], ["link", "set", device, "up"],
                     ["link", "set", f"{device}p", "up"]):
            subprocess.run(["ip", *step], check=True, capture_output=True)
        yield address
    finally:
        subprocess.run(["ip", "link", "del", device], capture_output=True)  # its peer goes with it


# dialing --------------------------------------------------------------------------------------------
def _accepts(address: str, port: int) -> bool:
    """Whether something listens on address:port (a refused connection: nothing does)."""
    try:
        socket.create_connection((address, port), timeout=30).close()
        return True
    except ConnectionRefusedError:
        return False


def _alive_in_launchers_store(address: str, port: int, node: int = 0) -> bytes:
    """What the launcher of host ``node`` wrote in the store at address:port: it is the launcher's."""
    client = dist.TCPStore(address, port, is_master=False, timeout=timedelta(seconds=WAIT_S))
    return client.get(f"{_ALIVE}{node}")


def _free_port(address: str) -> int:
    with socket.socket() as s:
        s.bind((address, 0))
        return s.getsockname()[1]


# launchers ------------------------------------------------------------------------------------------
class _Job:
    """One launcher (one host of a job) whose ranks run RANK_PROGRAM in ``marks``."""

    def __init__(self, marks: Path, *flags: str, nproc: int = 1) -> None:
        marks.mkdir(parents=True, exist_ok=True)
        self.marks, self.nproc = marks, nproc
        (marks / "rank_program.py").write_text(RANK_PROGRAM)
        self.log = (marks / "launcher.log").open("w")
        command = [sys.executable, "-m", "smddp_lite.launch", "--nproc-per-node", str(nproc), "--max-restarts", "0",
                   *flags, str(marks / "rank_program.py"), str(marks)]
        self.proc = subprocess.Popen(command, cwd=harness.ROOT, env=harness._base_env(None), stdout=self.log,
                                     stderr=subprocess.STDOUT)

    def output(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return (self.marks / "launcher.log").read_text()[-4000:]

    def ranks_saw(self) -> list[dict]:
        """What each of its ranks was given, once all of them started (within WAIT_S)."""
        deadline = time.monotonic() + WAIT_S
        while len(list(self.marks.glob("rank*.json"))) < self.nproc:
            assert self.proc.poll() is None, f"the launcher ended with {self.proc.returncode}:\n{self.output()}"
            assert time.monotonic() < deadline, f"its ranks did not start within {WAIT_S} s:\n{self.output()}"
            time.sleep(0.1)
        return [json.loads(p.read_text()) for p in sorted(self.marks.glob("rank*.json"))]

    def finish(self) -> int:
        """Release the ranks; the launcher's status once it ended (ended by SIGTERM, then SIGKILL, if it
        does not within WAIT_S), and no rank of it left."""
        (self.marks / "release").touch()
        try:
            self.proc.wait(timeout=WAIT_S)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGTERM)  # the launcher ends its ranks with it
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=60)
        self.log.close()
        left = subprocess.run(["pgrep", "-f", f"rank_program.py {self.marks}"], capture_output=True, text=True)
        for pid in left.stdout.split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        assert not left.stdout.split(), "ranks outlived their launcher"
        return self.proc.returncode


@contextlib.contextmanager
def _job(marks: Path, *flags: str, nproc: int = 1):
    job = _Job(marks, *flags, nproc=nproc)
    try:
        yield job
    finally:
        if job.proc.returncode is None:
            job.finish()


# the tests ------------------------------------------------------------------------------------------
def test_the_store_of_a_job_on_one_host_listens_on_loopback_only(tmp_path, outside_address):
    with _job(tmp_path, nproc=2) as job:
        ranks = job.ranks_saw()
        assert {r["MASTER_ADDR"] for r in ranks} == {"127.0.0.1"}, ranks
        port = int(ranks[0]["MASTER_PORT"])
        assert {r["MASTER_PORT"] for r in ranks} == {str(port)}, ranks
        assert _alive_in_launchers_store("127.0.0.1", port) == b"2"  # the launcher's store, on loopback
        assert not _accepts(outside_address, port), \
            f"the launcher's store of a job on one host accepts connections on {outside_address}:{port}"
        assert job.finish() == 0, job.output()


def test_with_master_addr_the_store_listens_on_that_address_only(tmp_path, outside_address):
    with _job(tmp_path, "--master-addr", outside_address) as job:
        (seen,) = job.ranks_saw()
        assert seen["MASTER_ADDR"] == outside_address, seen
        port = int(seen["MASTER_PORT"])
        assert _alive_in_launchers_store(outside_address, port) == b"1"
        assert not _accepts("127.0.0.1", port), f"the store asked to listen on {outside_address} accepts on loopback"
        assert job.finish() == 0, job.output()


@tiers.FULL_ONLY
def test_a_job_across_hosts_meets_in_the_store_at_master_addr_and_port(tmp_path, outside_address):
    # two launchers of one job, both on this machine: the second dials the first's store as a client
    port = _free_port(outside_address)
    flags = ("--nnodes", "2", "--master-addr", outside_address, "--master-port", str(port), "--store-timeout", "120")
    with _job(tmp_path / "host0", *flags, "--node-rank", "0") as first, \
            _job(tmp_path / "host1", *flags, "--node-rank", "1") as second:
        seen = first.ranks_saw() + second.ranks_saw()
        assert [(r["RANK"], r["MASTER_ADDR"], r["MASTER_PORT"]) for r in seen] == \
            [("0", outside_address, str(port)), ("1", outside_address, str(port))]
        assert _alive_in_launchers_store(outside_address, port, node=1) == b"1"  # the second host's launcher's
        assert not _accepts("127.0.0.1", port)
        # the second host's launcher ends first: its last word goes to the first host's store
        assert second.finish() == 0, second.output()
        assert first.finish() == 0, first.output()


def _launcher(tmp_path: Path, *flags: str) -> Launcher:
    """A launcher made in this process, which opens (or dials) its store and starts no rank."""
    return Launcher(_parser().parse_args(["--log-dir", str(tmp_path), *flags, "train.py"]))


def test_an_explicit_master_port_is_the_stores_port_on_loopback_only(tmp_path, outside_address):
    port = _free_port("127.0.0.1")
    launcher = _launcher(tmp_path, "--master-port", str(port))
    try:
        assert (launcher.master_addr, launcher.port) == ("127.0.0.1", port)
        assert not _accepts(outside_address, port)
        with socket.socket() as holder:  # a port taken is refused, with what to do
            holder.bind(("127.0.0.1", 0))
            holder.listen()
            with pytest.raises(SystemExit, match=r"127\.0\.0\.1:\d+; found the error .*in use.*another --master-port"):
                _launcher(tmp_path, "--master-port", str(holder.getsockname()[1]))
    finally:
        del launcher
        gc.collect()  # closes the store


def _nonlocal_bind() -> bool:
    with contextlib.suppress(OSError):
        return Path("/proc/sys/net/ipv4/ip_nonlocal_bind").read_text().strip() != "0"
    return False


@pytest.mark.parametrize("flags, expected", [
    pytest.param(("--nnodes", "2", "--master-addr", "127.0.0.1"),
                 r"spans several hosts.*resolves to the loopback address 127\.0\.0\.1.*set --master-addr",
                 id="loopback-across-hosts"),
    pytest.param(("--nnodes", "2", "--node-rank", "1"), r"--node-rank 1 expected --master-addr.*found none",
                 marks=tiers.QUICK, id="no-master-addr-on-host-1"),
    pytest.param(("--master-addr", "203.0.113.7"),  # TEST-NET-3: no address of this machine
                 r"open the job's store on 203\.0\.113\.7.*Cannot assign requested address.*no address of this host",
                 marks=tiers.QUICK, id="not-an-address-of-this-host"),
])
def test_a_store_address_the_launcher_cannot_use_is_refused_with_what_to_do(tmp_path, flags, expected):
    if "203.0.113.7" in flags and (_nonlocal_bind() or "203.0.113.7" in _addresses_of_this_host()):
        pytest.skip("this machine may listen on 203.0.113.7 (ip_nonlocal_bind, or its own address)")
    with pytest.raises(SystemExit, match=expected):
        _launcher(tmp_path, *flags)
