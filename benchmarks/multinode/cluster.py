"""Simulated hosts on one machine: Linux network namespaces joined by rate-limited veth links.

Each simulated host is a host in every sense the library can see: its own network namespace
(address 10.77.<cluster>.<host+1> on eth0, reachable only through the bridge, whose ports are
rate-limited both ways with tc tbf), its own hostname (UTS namespace) resolvable through a
hosts file bind-mounted over /etc/hosts, and its own /dev/shm (mount namespace with a fresh
tmpfs), so no shared-memory shortcut crosses the simulated network. Needs root.

    with SimCluster(hosts=2, rate="1gbit") as cluster:
        procs = [cluster.spawn(i, ["python", "-c", "import socket; print(socket.gethostname())"])
                 for i in range(2)]
        job = cluster.mpiexec(2, ["python", "train.py"])  # 2 ranks on each host, from a host list

Commands enter a host through enter-host.sh, which mpiexec also uses in place of ssh.

Everything created is removed on exit, on an exception, and on SIGTERM/SIGINT.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import tempfile
import threading
import time

ENTER_HOST = os.path.join(os.path.dirname(os.path.abspath(__file__)), "enter-host.sh")

_clusters_made = 0

# What a run's TCP did, summed over its hosts (SimCluster.tcp_counters): segments sent and
# retransmitted, how many retransmitted segments the receiver reported as duplicates (D-SACK:
# the original had arrived, the retransmission was spurious), the retransmissions' triggers, and
# how often a receiver's buffer was full. On this lab's veth links, 8 ranks on 2 cores, every
# retransmission of a 4 x 2 run was spurious, after reordering (2026-11-23, cost-model write-up).
TCP_COUNTERS = ("OutSegs", "RetransSegs", "TCPDSACKRecvSegs", "TCPFastRetrans", "TCPLossProbes", "TCPSACKReorder",
                "TCPTimeouts", "TCPToZeroWindowAdv")


def parse_proc_net(text: str) -> dict[str, int]:
    """The counters of /proc/net/snmp or /proc/net/netstat text, which lists each table as two
    lines, names then values, both led by the table's name ("Tcp: RtoAlgorithm ..."). A name
    that several tables share (InErrors) keeps the last table's value; the TCP ones are unique."""
    counters = {}
    lines = [line.split() for line in text.splitlines() if line.strip()]
    if len(lines) % 2:
        raise ValueError(f"unexpected /proc/net layout: {lines[-1][0]} has names but no values")
    for names, values in zip(lines[::2], lines[1::2]):
        if names[0] != values[0]:
            raise ValueError(f"unexpected /proc/net layout: {names[0]} then {values[0]}")
        for name, value in zip(names[1:], values[1:]):
            if value.lstrip("-").isdigit():
                counters[name] = int(value)
    return counters


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


# The token bucket's depth. A shallow one distorts TCP at these rates: with 256kb (the default
# until 2026-11-23), a 1 MiB all_reduce on 4 hosts x 2 ranks took 33 ms against 15 ms of wire
# time and the 16-bit exchange of 4 MiB 54 ms against 25 ms; with 2mb, 19 and 28 ms
# (benchmarks/results/2026-11-23-token-bucket.md). A deep bucket banks up to 2 MB of an idle
# link's time, which a real link cannot: the collectives sweep warms up and times at least
# 64 MiB per size so that it is spent or spread thin.
DEFAULT_BURST = "2mb"


class SimCluster:
    def __init__(self, hosts: int, rate: str = "1gbit", burst: str = DEFAULT_BURST,
                 names: list[str] | None = None) -> None:
        if os.geteuid() != 0:
            raise PermissionError(
                "SimCluster needs root: it creates network namespaces, veth links and tc qdiscs. "
                "Run the benchmark as root (sudo), or skip the multi-node simulation."
            )
        self.hosts, self.rate, self.burst = hosts, rate, burst
        global _clusters_made
        _clusters_made += 1  # names unique per cluster: deleting the last one's links is asynchronous
        tag = (os.getpid() * 10 + _clusters_made) % 100000
        self.subnet = tag % 250 + 1  # 10.77.<subnet>.0/24, private to this cluster's namespaces
        self.bridge = f"smb{tag}"
        self.ns = [f"smddp{tag}h{i}" for i in range(hosts)]
        # hostnames as a job sees them: sim-host-<i>, or the caller's (SageMaker's algo-1, algo-2, ...)
        self.names = list(names) if names is not None else [f"sim-host-{i}" for i in range(hosts)]
        if len(self.names) != hosts:
            raise ValueError(f"SimCluster: {hosts} hosts but {len(self.names)} names: {self.names}")
        self.addresses = [f"10.77.{self.subnet}.{i + 1}" for i in range(hosts)]
        self.procs: list[subprocess.Popen] = []
        self._created: list[tuple[str, ...]] = []
        self._hosts_file = None

    # lifetime -----------------------------------------------------------------------------------
    def __enter__(self) -> "SimCluster":
        self._old_handlers = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _kill_left_in_hosts(self) -> None:
        """End every process still inside a host's network namespace: those that left the session
        they were started in survive the killpg, and torchrun starts each worker in a session of
        its own (a killed torchrun left all its ranks running, in namespaces about to go)."""
        for ns in self.ns:
            found = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
            for pid in found.stdout.split():  # nothing (and an error) where the namespace was never made
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)

    def _on_signal(self, signum, frame) -> None:
        self.close()
        raise SystemExit(128 + signum)

    def _create(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        self._created.append(("ip", "link", "del", self.bridge))
        _ip("link", "set", self.bridge, "up")
        self._let_bridge_forward()
        for i, ns in enumerate(self.ns):
            _ip("netns", "add", ns)
            self._created.append(("ip", "netns", "del", ns))
            port = f"{self.bridge}p{i}"
            _ip("link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
            self._created.append(("ip", "link", "del", port))
            _ip("link", "set", port, "master", self.bridge, "up")
            _ip("-n", ns, "addr", "add", f"{self.addresses[i]}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            if self.rate:  # each direction of each host's link: host egress and bridge-port egress
                tbf = ["root", "tbf", "rate", self.rate, "burst", self.burst, "latency", "50ms"]
                subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "eth0", *tbf], check=True)
                subprocess.run(["tc", "qdisc", "add", "dev", port, *tbf], check=True)
        fd, self._hosts_file = tempfile.mkstemp(prefix="smddp-hosts-")
        with os.fdopen(fd, "w") as f:
            f.write("127.0.0.1 localhost\n")
            f.writelines(f"{addr} {name}\n" for addr, name in zip(self.addresses, self.names))

    def _let_bridge_forward(self) -> None:
        """Let frames between the hosts' ports cross the bridge where iptables filters bridged
        traffic. A Docker engine loads br_netfilter (so bridged frames meet the FORWARD chain) and
        sets that chain's policy to DROP; the hosts then could not reach each other, and a job's
        rendezvous waited until its timeout. The rule accepts this bridge's own traffic only, and
        goes with the cluster."""
        try:
            with open("/proc/sys/net/bridge/bridge-nf-call-iptables") as f:
                filtered = f.read().strip() == "1"
        except OSError:  # no br_netfilter: bridged frames skip iptables
            return
        if not filtered or shutil.which("iptables") is None:
            return
        rule = ["FORWARD", "-i", self.bridge, "-o", self.bridge, "-j", "ACCEPT"]
        subprocess.run(["iptables", "-I", *rule], check=True, capture_output=True)
        self._created.append(("iptables", "-D", *rule))

    def close(self) -> None:
        for p in self.procs:  # each was started in its own session: end everything it started
            with contextlib.suppress(ProcessLookupError):  # it has ended already
                os.killpg(p.pid, signal.SIGKILL)
        self._kill_left_in_hosts()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:  # unkillable (D state): the namespaces go anyway
                continue
        self.procs.clear()
        for cmd in reversed(self._created):
            subprocess.run(list(cmd), capture_output=True)
        self._created.clear()
        if self._hosts_file and os.path.exists(self._hosts_file):
            os.unlink(self._hosts_file)
        for s, h in getattr(self, "_old_handlers", {}).items():
            signal.signal(s, h)
        self._old_handlers = {}

    def tcp_counters(self) -> dict[str, int]:
        """TCP_COUNTERS summed over every host since the cluster was made, and "qdisc_drops":
        packets the links' token buckets dropped, both directions. A fresh cluster starts at 0."""
        total = dict.fromkeys(TCP_COUNTERS, 0)
        total["qdisc_drops"] = 0
        for i, ns in enumerate(self.ns):
            inside = ["ip", "netns", "exec", ns]  # /proc/net shows the namespace of the reader
            text = subprocess.run([*inside, "cat", "/proc/net/snmp", "/proc/net/netstat"], capture_output=True,
                                  text=True, check=True).stdout
            counters = parse_proc_net(text)
            for name in TCP_COUNTERS:
                total[name] += counters.get(name, 0)  # older kernels lack some: 0
            for prefix, dev in ((inside, "eth0"), ([], f"{self.bridge}p{i}")):
                shown = subprocess.run([*prefix, "tc", "-j", "-s", "qdisc", "show", "dev", dev], capture_output=True,
                                       text=True, check=True).stdout
                total["qdisc_drops"] += sum(q.get("drops", 0) for q in json.loads(shown))
        return total

    # running things on a host --------------------------------------------------------------------
    def spawn(self, host: int, argv: list[str], env: dict[str, str] | None = None, **popen) -> subprocess.Popen:
        """Start ``argv`` on simulated host ``host`` (its network, hostname and /dev/shm)."""
        full_env = {**os.environ, **(env or {}), "SIM_HOSTS_FILE": self._hosts_file,
                    "SIM_NAMESPACES": " ".join(f"{name}={ns}" for name, ns in zip(self.names, self.ns))}
        proc = subprocess.Popen([ENTER_HOST, self.names[host], shlex.join(argv)], env=full_env,
                                start_new_session=True, **popen)
        self.procs.append(proc)
        return proc

    def wait_all(self, procs: list[subprocess.Popen], timeout: float, grace: float = 20.0) -> list[str]:
        """Wait for ``procs`` (started with stdout piped, text mode) and return their outputs.

        One host's job failing must not leave the others waiting in a rendezvous or a collective
        for many minutes (torchrun waits 10 minutes for a host that never joins): once one process
        exits non-zero, the rest get ``grace`` seconds to end on their own, then are killed, and
        RuntimeError carries every host's output. Also raised after ``timeout`` seconds."""
        outputs = [""] * len(procs)

        def drain(i: int) -> None:  # read each pipe on its own thread: a full pipe would block its writer
            outputs[i] = procs[i].stdout.read()

        readers = [threading.Thread(target=drain, args=(i,), daemon=True) for i in range(len(procs))]
        for t in readers:
            t.start()
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs):
            failed = any(p.poll() not in (None, 0) for p in procs)
            if failed:
                deadline = min(deadline, time.monotonic() + grace)
            if time.monotonic() > deadline:
                for p in procs:
                    if p.poll() is None:
                        os.killpg(p.pid, signal.SIGKILL)
                break
            time.sleep(0.1)
        for p in procs:
            p.wait()
        for t in readers:
            t.join(timeout=10)
        if any(p.returncode for p in procs):
            codes = ", ".join(f"host {i}: {p.returncode}" for i, p in enumerate(procs))
            raise RuntimeError(f"job failed ({codes}; -9: killed after another host failed or at the "
                               f"{timeout:.0f} s limit):\n" + "\n".join(
                                   f"--- host {i} ---\n{o[-3000:]}" for i, o in enumerate(outputs)))
        return outputs

    def mpiexec(self, per_host: int, argv: list[str], env: dict[str, str] | None = None, **popen) -> subprocess.Popen:
        """Start ``argv`` as an MPI job of ``per_host`` ranks on every host, launched as on a real
        cluster: mpiexec runs on the first host with the host list, and Hydra starts its proxy on
        each host through enter-host.sh where it would use ssh."""
        mpiexec = shutil.which("mpiexec")
        if mpiexec is None:
            raise FileNotFoundError("mpiexec not found: pip install mpi4py mpich "
                                    "(or pip install -e '.[mpi]' in the checkout)")
        cmd = [mpiexec, "-hosts", ",".join(self.names), "-ppn", str(per_host), "-n", str(per_host * self.hosts),
               "-launcher", "ssh", "-launcher-exec", ENTER_HOST, *argv]
        return self.spawn(0, cmd, env, **popen)
