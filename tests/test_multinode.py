"""The multi-node simulation harness and the topology logic behind hierarchical collectives."""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys

import pytest

from . import tiers
import torch

from smddp_lite.backend.transports.hierarchical import Topology

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_topology_groups_ranks_by_host_in_rank_order():
    topo = Topology(["b", "a", "b", "a"])
    assert topo.local == [[0, 2], [1, 3]] and topo.uniform
    assert topo.node_of == {0: 0, 2: 0, 1: 1, 3: 1}
    assert not Topology(["a", "a", "b"]).uniform
    assert "2 hosts x 2 ranks" in topo.describe()


@pytest.mark.skipif(os.geteuid() != 0, reason="the simulated cluster needs root (network namespaces, tc)")
@pytest.mark.parametrize("launcher", ["torchrun", "mpiexec"])
def test_quick_scaling_run_on_two_simulated_hosts(launcher):
    if launcher == "mpiexec" and shutil.which("mpiexec") is None:
        pytest.skip("mpiexec not installed (from the checkout: pip install -e '.[mpi]')")
    run = subprocess.Popen([sys.executable, "-m", "benchmarks.scaling", "--quick", "--launcher", launcher], cwd=ROOT,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = run.communicate(timeout=600)
    finally:
        run.kill()
    assert run.returncode == 0, stdout[-3000:] + stderr[-3000:]
    report = json.loads(stdout.strip().splitlines()[-1])
    assert report["world"] == 2 and report["samples_per_s"] > 0
    assert report["rank_hosts"] == ["sim-host-0", "sim-host-1"], "each rank should run on its own simulated host"
    # its own namespaces only: another test's lab may run beside it (pytest -n), or one a killed
    # run left behind
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    ours = [line for line in listed.splitlines() if any(line.startswith(f"smddp{tag}h") for tag in _tags_of(run.pid))]
    assert not ours, f"namespaces left behind: {ours}"


def _tags_of(pid: int) -> set[int]:
    """The tags of the clusters process ``pid`` made (benchmarks/multinode/cluster.py names its
    namespaces smddp<tag>h<host>, the tag from its pid and a count of its clusters)."""
    return {(pid * 10 + made) % 100000 for made in range(1, 10)}


@pytest.mark.skipif(os.geteuid() != 0, reason="the simulated cluster needs root (network namespaces, tc)")
def test_cluster_limits_both_directions_of_each_host_link_as_asked():
    from benchmarks.multinode.cluster import SimCluster

    with SimCluster(2, rate="500mbit", burst="1mb") as cluster:
        shown = [subprocess.run([*prefix, "tc", "-j", "qdisc", "show", "dev", dev], capture_output=True, text=True,
                                check=True).stdout
                 for prefix, dev in ((["ip", "netns", "exec", cluster.ns[1]], "eth0"), ([], f"{cluster.bridge}p1"))]
    for text in shown:  # host egress, then the bridge port's egress (the host's ingress)
        (qdisc,) = json.loads(text)
        assert qdisc["kind"] == "tbf" and qdisc["options"]["rate"] == 500_000_000 // 8, text
        assert qdisc["options"]["burst"] == pytest.approx(1 << 20, rel=0.01), text  # tc rounds to its ticks


def test_proc_net_counters_are_read_table_by_table():
    from benchmarks.multinode.cluster import parse_proc_net

    text = ("Ip: Forwarding DefaultTTL\nIp: 1 64\n"
            "Tcp: RtoAlgorithm MaxConn OutSegs RetransSegs\nTcp: 1 -1 7120 3\n"
            "TcpExt: SyncookiesSent TCPDSACKRecvSegs\nTcpExt: 0 3\n")
    assert parse_proc_net(text) == {"Forwarding": 1, "DefaultTTL": 64, "RtoAlgorithm": 1, "MaxConn": -1,
                                    "OutSegs": 7120, "RetransSegs": 3, "SyncookiesSent": 0, "TCPDSACKRecvSegs": 3}
    with pytest.raises(ValueError, match="Tcp: then TcpExt:"):
        parse_proc_net("Tcp: OutSegs\nTcpExt: 3\n")
    with pytest.raises(ValueError, match="TcpExt: has names but no values"):
        parse_proc_net("Tcp: OutSegs\nTcp: 3\nTcpExt: TCPTimeouts\n")


@pytest.mark.skipif(os.geteuid() != 0, reason="the simulated cluster needs root (network namespaces, tc)")
def test_cluster_counts_its_own_hosts_tcp_traffic():
    from benchmarks.multinode.cluster import TCP_COUNTERS, SimCluster

    sink = ("import socket; s = socket.create_server(('0.0.0.0', 29600)); c, _ = s.accept(); n = 0\n"
            "while (b := c.recv(1 << 16)): n += len(b)\nprint(n)")
    source = ("import socket, time\nfor _ in range(100):\n    try: c = socket.create_connection(('sim-host-0', 29600)); break\n"
              "    except OSError: time.sleep(0.1)\nc.sendall(bytes(8 << 20)); c.close()")
    with SimCluster(2, rate="500mbit") as cluster:
        fresh = cluster.tcp_counters()
        out = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        got = cluster.wait_all([cluster.spawn(0, [sys.executable, "-c", sink], **out),
                                cluster.spawn(1, [sys.executable, "-c", source], **out)], timeout=120)
        after = cluster.tcp_counters()
    assert set(fresh) == {*TCP_COUNTERS, "qdisc_drops"}
    assert fresh["OutSegs"] == 0, "a new cluster's hosts have sent nothing: these are not the machine's own counters"
    assert int(got[0]) == 8 << 20
    # a segment carries at most 1448 bytes on these 1500-byte links (the counter counts each MSS of a GSO packet)
    assert after["OutSegs"] >= (8 << 20) / 1448


def test_cluster_refuses_without_root(monkeypatch):
    from benchmarks.multinode.cluster import SimCluster

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(PermissionError, match="needs root"):
        SimCluster(2)


@pytest.mark.skipif(os.geteuid() != 0, reason="the simulated cluster needs root (network namespaces, tc)")
def test_closing_the_cluster_ends_processes_that_left_their_session():
    """torchrun starts each worker in a session of its own: killing the session the cluster
    started (torchrun's) left the ranks running. A process that leaves its session the same way
    (setsid) must end with the cluster."""
    import time

    from benchmarks.multinode.cluster import SimCluster

    with SimCluster(2) as cluster:
        proc = cluster.spawn(1, ["sh", "-c", "setsid sleep 600 & echo $!; wait"], stdout=subprocess.PIPE, text=True)
        escaped = int(proc.stdout.readline())
        deadline = time.monotonic() + 10
        while os.getsid(escaped) == os.getsid(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.01)  # setsid has not run yet
        assert os.getsid(escaped) != os.getsid(proc.pid)
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{escaped}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{escaped}"), "a process that left its session outlived the cluster"


@pytest.mark.skipif(os.geteuid() != 0, reason="the simulated cluster needs root (network namespaces, tc)")
def test_one_failing_host_ends_the_job_with_its_output():
    # host 1 fails at once while host 0 would wait 10 minutes, as torchrun waits for a host that
    # never joins its rendezvous: the job must end within the grace period, naming both hosts
    import time

    from benchmarks.multinode.cluster import SimCluster

    with SimCluster(2) as cluster:
        out = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        procs = [cluster.spawn(0, ["sleep", "600"], **out),
                 cluster.spawn(1, ["sh", "-c", "echo rendezvous refused on $(hostname); exit 3"], **out)]
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="host 1: 3") as err:
            cluster.wait_all(procs, timeout=300, grace=1.0)
    assert time.monotonic() - start < 30
    assert "rendezvous refused on sim-host-1" in str(err.value) and "host 0: -9" in str(err.value)


@tiers.FULL_ONLY
@pytest.mark.parametrize("world, hosts_of", [(6, 2), (4, 1)])
def test_broadcast_between_more_than_two_hosts_chains_its_pieces_and_delivers_them(world, hosts_of):
    """Pieces of 4 KiB: 1 element and 1000 float32 are one piece (gloo's tree between hosts), 4097
    and 30000 are 5-30 pieces, parts of uneven size included (a chain); every root, every rank.
    Then, without the debug log's check of every call (whose all_gather would do the waiting),
    the root comes 1 s late: the chain's waits outlast a refusal poll (50 ms), which failed
    gloo's recv when they were waited in slices as collectives are."""
    from . import harness

    env = {"SMDDP_ALGORITHM": "hierarchical", "SMDDP_HIERARCHICAL_CHUNK_BYTES": "4096"}
    late = harness.launch("tests.multinode_programs:broadcasts_from_every_root", world, env=env, hosts_of=hosts_of,
                          numels=[30000], late_s=1.0)
    for rank, report in enumerate(harness.values(late)):
        assert report["wrong"] == [], (rank, report)
    results = harness.launch("tests.multinode_programs:broadcasts_from_every_root", world,
                             env={**env, "SMDDP_DEBUG": "1"},
                             hosts_of=hosts_of, numels=[1, 1000, 4097, 30000])
    for rank, report in enumerate(harness.values(results)):
        assert report["wrong"] == [], (rank, report)
    hosts = world // hosts_of
    # the debug log names each choice once, at its first call
    assert f"broadcast of 4 bytes in 1 piece crosses {hosts} hosts in gloo's tree" in results[0].output
    assert f"broadcast of 16388 bytes in 5 pieces crosses {hosts} hosts in a chain" in results[0].output


# (op[-redop[-transport]], dtype, wire dtype, bytes a host sends per message byte), 2 hosts x 2 ranks
LINK_BYTES_CASES = [
    ("reduce_scatter", "bfloat16", None, 0.5),  # 16-bit blocks cross as they are (widened: 1.0)
    ("reduce_scatter-avg", "bfloat16", None, 0.5),  # FSDP2's bfloat16 gradients: AVG, 16-bit too
    ("reduce_scatter", "float32", None, 0.5),
    ("reduce_scatter", "float32", "bfloat16", 0.25),  # SMDDP_INTER_NODE_WIRE_DTYPE halves float32 sums
    ("all_gather", "bfloat16", None, 0.5),  # each host's inputs cross once (once per local rank: 1.0)
    ("all_gather", "float32", "bfloat16", 0.5),  # no sums, so no wire dtype: the bits as they are
    # the flat gloo transport (forced here; chosen where hosts hold different numbers of ranks):
    # each rank sends the other host's ranks their blocks unreduced, 16-bit as they are (widened: 2.0)
    ("reduce_scatter-sum-gloo", "bfloat16", None, 1.0),
    ("reduce_scatter-avg-gloo", "bfloat16", None, 1.0),
    # all_reduce: each host sends the other its half of the message, reduced inside the host, and
    # gets back the other half's sums: one message's bytes (a widened bfloat16 AVG sent 2.0)
    ("all_reduce", "bfloat16", None, 1.0),
    ("all_reduce-avg", "bfloat16", None, 1.0),
    # float16 AVG: each host's mean crosses in float16 (widened to float32 before: 2.0)
    ("all_reduce-avg", "float16", None, 1.0),
    ("reduce_scatter-avg", "float16", None, 0.5),
]


def _link_case(op: str, dtype: str, wire: str | None) -> tuple[tuple[str, str | None], dict]:
    """The job a case runs in (its transport and wire dtype) and what the job runs for it."""
    parts = op.split("-")  # op[-redop[-transport]]
    name, redop, transport = parts[0], (parts[1:2] or ["sum"])[0], (parts[2:3] or ["hierarchical"])[0]
    return (transport, wire), {"op": name, "dtype": dtype, "redop": redop}


@functools.lru_cache(maxsize=None)  # one job per configuration, per session
def _link_bytes_job(transport: str, wire: str | None) -> list[dict]:
    """Every case of LINK_BYTES_CASES that runs with this transport and wire dtype, in one job on
    one simulated cluster of 2 hosts x 2 ranks (a cluster and a torchrun per case cost 10 s each):
    rank by rank, what each case's host sent."""
    import tempfile
    from pathlib import Path

    from benchmarks.multinode.cluster import SimCluster

    from . import harness

    cases = []
    for op, dtype, case_wire, _ in LINK_BYTES_CASES:
        key, case = _link_case(op, dtype, case_wire)
        if key == (transport, wire):
            cases.append(case)
    placement = {"SMDDP_ALGORITHM": "hierarchical"} if transport == "hierarchical" else \
        {"SMDDP_ALGORITHM": "flat", "SMDDP_TRANSPORT": transport}
    env = {**harness._base_env({**placement, "GLOO_SOCKET_IFNAME": "eth0"}),
           **({"SMDDP_INTER_NODE_WIRE_DTYPE": wire} if wire else {})}
    with tempfile.TemporaryDirectory(prefix="smddp-test-") as tmp, SimCluster(2) as cluster:
        out = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        procs = [cluster.spawn(i, [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=2",
                                   f"--node-rank={i}", f"--master-addr={cluster.names[0]}", "--master-port=29500",
                                   str(harness.WORKER), "tests.multinode_programs:link_bytes",
                                   json.dumps({"cases": cases}), tmp], env=env, **out)
                 for i in range(2)]
        cluster.wait_all(procs, timeout=300)
        reports = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(4)]
    assert all("value" in r for r in reports), [r.get("error") for r in reports]
    return [r["value"] for r in reports]


@pytest.mark.skipif(os.geteuid() != 0, reason="the simulated cluster needs root (network namespaces, tc)")
@pytest.mark.parametrize("op, dtype, wire, share", LINK_BYTES_CASES)
@tiers.FULL_ONLY
def test_hierarchical_collectives_send_each_byte_between_hosts_once(op, dtype, wire, share):
    # 2 hosts x 2 ranks. reduce_scatter: a host sends the half of the blocks the other host's
    # ranks own, reduced inside the host, in the wire dtype (float32 where none is set).
    # all_gather: a host sends its ranks' inputs, half the output, to the other host.
    # The cases of one transport and wire dtype share a job, each case counted between barriers.
    key, case = _link_case(op, dtype, wire)
    job = _link_bytes_job(*key)
    reports = [next(r for r in rank_reports if {k: r[k] for k in case} == case) for rank_reports in job]
    assert all(r["exact"] for r in reports), reports
    for r in reports:  # TCP/IP headers and acknowledgements add 0.2-0.5% here
        assert share <= r["sent_per_message_byte"] <= share * 1.05, reports


def test_timed_loop_moves_at_least_timed_bytes_per_size_within_the_cap():
    from benchmarks.collectives import Job
    job = Job(torch.float32, "float", torch.device("cpu"), 0, 2, 0, "sum", warmup=10, iters=20, check=True,
              timed_bytes=64 << 20, max_iters=100)
    assert [job.calls(size) for size in (64 << 10, 512 << 10, 1 << 20, 3 << 20, 16 << 20)] == [100, 100, 64, 22, 20]
    plain = Job(torch.float32, "float", torch.device("cpu"), 0, 2, 0, "sum", warmup=10, iters=20, check=True)
    assert plain.calls(1 << 10) == 20  # without --timed-bytes every size runs -n calls


def test_an_8_bit_wire_loosens_the_benchmarks_check_to_two_quantizations_and_nothing_else(monkeypatch):
    from benchmarks.collectives import Job, count_wrong, quantized_wire_bound
    job = Job(torch.float32, "float", torch.device("cpu"), 0, 4, 0, "sum", warmup=1, iters=1, check=True)
    ranks = [{"rank": r, "host": f"h{r // 2}"} for r in range(4)]  # 2 hosts x 2 ranks
    monkeypatch.setenv("SMDDP_INTER_NODE_WIRE_DTYPE", "int8")
    # inputs up to 7: host sums up to 14, the total up to 28; half a step of 127 each
    assert quantized_wire_bound(ranks, job) == pytest.approx((2 * 14 + 28) / 127 / 2)
    exact = torch.tensor([4.0, 28.0], dtype=torch.float64)
    assert count_wrong(torch.tensor([4.2, 27.8]), exact, job, quantized_wire_bound(ranks, job)) == 0
    assert count_wrong(torch.tensor([5.0, 28.0]), exact, job, quantized_wire_bound(ranks, job)) == 1  # off by one
    # a 16-bit wire, another op or dtype: exact, as before
    assert quantized_wire_bound(ranks, Job(torch.float32, "float", torch.device("cpu"), 0, 4, 0, "max", 1, 1, True)) is None
    monkeypatch.setenv("SMDDP_INTER_NODE_WIRE_DTYPE", "bfloat16")
    assert quantized_wire_bound(ranks, job) is None


@tiers.FULL_ONLY
@pytest.mark.skipif(os.geteuid() != 0, reason="the simulated cluster needs root (network namespaces, tc)")
def test_collectives_sweep_on_chosen_configurations(tmp_path):
    out = tmp_path / "sweep"
    done = subprocess.run([sys.executable, "-m", "benchmarks.scaling", "--collectives", "--hosts", "2", "--per-host", "1",
                           "--min-bytes", "64K", "--max-bytes", "128K", "--env", "SMDDP_INTER_NODE_ACCUMULATE=wire",
                           "--burst", "1mb", "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    sweep = json.loads((tmp_path / "sweep.json").read_text())
    rows = sweep["rows"]
    assert sweep["burst"] == "1mb" and sweep["rate"] == "1gbit"
    # the cost model's three 2 x 1 configurations (flat; hierarchical with a bfloat16 and an int8
    # wire, whose results collectives.py checks within the quantization bound), two sizes each
    assert sorted((r["algorithm"], r["wire"], r["bytes"]) for r in rows) == [
        ("flat", "float32", 65536), ("flat", "float32", 131072), ("hierarchical", "bfloat16", 65536),
        ("hierarchical", "bfloat16", 131072), ("hierarchical", "int8", 65536), ("hierarchical", "int8", 131072)]
    assert all(r["hosts"] == 2 and r["per_host"] == 1 and r["time_s"] > 0 for r in rows)
    assert all(r["env"]["SMDDP_INTER_NODE_ACCUMULATE"] == "wire" for r in rows)
    assert all(r["tcp"]["OutSegs"] > 0 and r["tcp"]["RetransSegs"] >= 0 for r in rows)  # each run's own TCP counters
    assert "2 x 1" in done.stdout and "64 KiB" in done.stdout and "segments retransmitted" in done.stdout


@pytest.mark.parametrize("wire", [None, "bfloat16"])
def test_auto_is_hierarchical_but_for_small_rounded_sums_and_small_broadcasts(wire):
    """Under "auto" a small all_reduce or all_gather crosses hosts hierarchically (fewer steps
    between hosts); a small sum that would be rounded there (a 16-bit input, or any float sum with
    a wire dtype) goes flat, summed in float32 and rounded once, so a count stays exact; and a
    broadcast goes hierarchical from SMDDP_HIERARCHICAL_MIN_BYTES, with every byte arriving."""
    from . import harness

    env = {"SMDDP_DEBUG": "1", **({"SMDDP_INTER_NODE_WIRE_DTYPE": wire} if wire else {})}
    results = harness.values(harness.launch("tests.multinode_programs:routes_under_auto", 4, env=env, hosts_of=2))
    for report in results:
        assert report["count"] == 4 * 1000.0 + 6 + 2.0, report
        assert report["gathered"] == [float(r) for r in range(4) for _ in range(3)], report
        assert report["halves"] == [4.0], report
        assert report["broadcasts_arrived"] == [True, True], report
    routes = results[0]["routes"]  # logged once per op and route (SMDDP_DEBUG's own checks gather too)
    expected = ["all_reduce of 4 bytes runs flat"] if wire else [
        "all_reduce of 4 bytes runs hierarchical", "all_reduce of 128 bytes runs flat"]
    # a small broadcast waits on latency: flat; a large one crosses each host's link once
    expected += ["broadcast of 256 bytes runs flat", "broadcast of 262148 bytes runs hierarchical"]
    for words in expected + ["all_gather of"]:
        assert any(words in line for line in routes), (words, routes)
    assert not any("all_gather" in line and "runs flat" in line for line in routes), routes


@tiers.FULL_ONLY
@pytest.mark.skipif(os.geteuid() != 0, reason="the simulated cluster needs root (network namespaces, tc)")
@pytest.mark.parametrize("per_host", [1, 2])
def test_a_rank_dying_on_another_host_is_named_by_the_gloo_transport(per_host):
    """gloo shows a peer on another host only by its address. With one rank per host, that
    address names the rank (every rank published its host's); with two, the dead rank's
    host-mate sees which process ended and tells the other host's ranks through the store."""
    import tempfile
    import time
    from pathlib import Path

    from benchmarks.multinode.cluster import SimCluster

    from . import harness

    world = 2 * per_host
    with tempfile.TemporaryDirectory(prefix="smddp-test-") as tmp, SimCluster(2) as cluster:
        # the store outlives the ranks, as torchrun's agent store does (rank 0 is done and gone
        # before the other host's ranks finish)
        cluster.spawn(0, [sys.executable, "-c", "import datetime, time, torch.distributed as dist; "
                          "store = dist.TCPStore('0.0.0.0', 29500, is_master=True, wait_for_workers=False, "
                          "timeout=datetime.timedelta(seconds=60)); time.sleep(120)"])
        procs = []
        for rank in range(world):
            env = harness._base_env({"SMDDP_TRANSPORT": "gloo", "GLOO_SOCKET_IFNAME": "eth0", "RANK": str(rank),
                                     "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank % per_host),
                                     "MASTER_ADDR": cluster.names[0], "MASTER_PORT": "29500",
                                     "TORCHELASTIC_USE_AGENT_STORE": "True"})
            procs.append(cluster.spawn(rank // per_host, [sys.executable, str(harness.WORKER),
                                                          "tests.errors_programs:peer_dies",
                                                          "{}", tmp], env=env, stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True))
        deadline = time.monotonic() + 120
        outputs = [proc.communicate(timeout=max(1, deadline - time.monotonic()))[0] for proc in procs]
        reports = {rank: json.loads(path.read_text()) for rank in range(world)
                   if (path := Path(tmp) / f"rank{rank}.json").exists()}
    assert procs[1].returncode == 3, outputs[1][-2000:]
    for rank in set(range(world)) - {1}:
        error = reports.get(rank, {}).get("value")
        assert error is not None, outputs[rank][-3000:]
        assert error["backend_error"] and "rank 1" in error["message"], (rank, error["message"])
        assert error["seconds"] < 10, (rank, error)
