"""``torch.compile`` around DistributedDataParallel on "smddp" trains as it does on gloo, on every
CPU transport, with torch's default DDPOptimizer and with compiled autograd. Accelerate and the
Hugging Face Trainer compile this way when their compile switch is on (test_frameworks.py runs
those)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from . import harness, tiers
from .compiled_ddp_programs import MODES

TRANSPORTS = ("shm", "gloo", "mpi")


# every case in the quick tier too: users meet this through their frameworks' compile switches
@pytest.mark.parametrize("mode", [pytest.param(m, marks=tiers.QUICK) for m in MODES])
@pytest.mark.parametrize("transport", [pytest.param(t, marks=tiers.QUICK) for t in TRANSPORTS])
def test_compiled_ddp_trains_as_on_gloo(transport, mode):
    env = {"SMDDP_TRANSPORT": transport}
    if transport == "mpi":
        harness.skip_without_mpiexec()
        results = harness.launch_mpi("tests.compiled_ddp_programs:compiled_ddp_beside_gloo", 2, env=env,
                                     timeout=300, mode=mode)
    else:
        results = harness.launch("tests.compiled_ddp_programs:compiled_ddp_beside_gloo", 2, env=env,
                                 timeout=300, pooled=False, mode=mode)
    for rank, result in enumerate(harness.values(results)):
        assert result["transport"] == transport, (rank, result["transport"])
        ours, gloo = result["losses"]["smddp"], result["losses"]["gloo"]
        # two ranks: each sum has two terms, the same float in either order
        assert ours == pytest.approx(gloo, rel=1e-6), (rank, ours, gloo)
        assert result["parameter_sums"]["smddp"] == pytest.approx(result["parameter_sums"]["gloo"], rel=1e-6, abs=1e-9)
        assert ours[-1] < ours[0], ours


@pytest.mark.skipif(os.geteuid() != 0, reason="the simulated cluster needs root (network namespaces, tc)")
def test_compiled_ddp_on_two_simulated_hosts_trains_as_on_gloo(tmp_path):
    """2 hosts x 2 ranks of the lab: hierarchical collectives under DDPOptimizer's graph pieces."""
    from benchmarks.multinode.cluster import SimCluster

    env = harness._base_env({"SMDDP_ALGORITHM": "hierarchical", "GLOO_SOCKET_IFNAME": "eth0"})
    with SimCluster(2) as cluster:
        out = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        procs = [cluster.spawn(i, [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=2",
                                   f"--node-rank={i}", f"--master-addr={cluster.names[0]}", "--master-port=29500",
                                   str(harness.WORKER), "tests.compiled_ddp_programs:compiled_ddp_beside_gloo",
                                   json.dumps({"mode": "ddp_optimizer"}), str(tmp_path)], env=env, **out)
                 for i in range(2)]
        cluster.wait_all(procs, timeout=400)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert all("value" in r for r in reports), [r.get("error") for r in reports]
    for rank, report in enumerate(reports):
        result = report["value"]
        assert result["transport"] == "hierarchical", (rank, result["transport"])
        # four addends, summed inside each host first here and around a ring by gloo: float32 ulps apart
        assert result["losses"]["smddp"] == pytest.approx(result["losses"]["gloo"], rel=1e-5), (rank, result["losses"])
        assert result["parameter_sums"]["smddp"] == pytest.approx(result["parameter_sums"]["gloo"], rel=1e-5, abs=1e-7)
