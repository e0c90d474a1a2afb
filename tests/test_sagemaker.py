"""SageMaker's training contract, run by AWS's own toolkit on two simulated hosts.

Each host of the lab (benchmarks/multinode/cluster.py: its own network, hostname and /dev/shm)
is named as SageMaker names instances, algo-1 and algo-2, and runs the toolkit's ``train``
against an /opt/ml of its own (``SAGEMAKER_BASE_DIR``) laid out as SageMaker lays a job out
(docker/sagemaker_local.py, which runs the same job in the image). The toolkit reads the job,
picks the "torch_distributed" runner from the hyperparameters and starts torchrun on each host;
the script is the one written for AWS's library (smddp_lite/examples/sagemaker_train.py).
The "smdistributed" runner needs sshd and Open MPI's mpirun, so it runs in the image only.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

from . import tiers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="the simulated hosts need root (network namespaces)")
needs_toolkit = pytest.mark.skipif(
    not os.path.exists(os.path.join(BIN, "train")),
    reason="SageMaker's toolkit is missing: pip install sagemaker-training sagemaker-pytorch-training")


@pytest.fixture
def job_config(tmp_path, monkeypatch):
    """Writes a resourceconfig.json where a SageMaker container has it (under SAGEMAKER_BASE_DIR)."""
    from smddp_lite.backend import sagemaker_host

    def write(content) -> None:
        folder = tmp_path / "input" / "config"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "resourceconfig.json").write_text(content if isinstance(content, str) else json.dumps(content))
        sagemaker_host.resource_config.cache_clear()

    monkeypatch.setenv("SAGEMAKER_BASE_DIR", str(tmp_path))
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "")  # recorded, so that what the test sets goes with it
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    sagemaker_host.resource_config.cache_clear()
    yield write
    sagemaker_host.resource_config.cache_clear()


def test_a_rank_takes_its_host_and_interface_from_sagemakers_resource_config(job_config):
    """A SageMaker container's own hostname need not tell hosts apart, nor resolve to the job's
    network: the host's name and interface come from resourceconfig.json."""
    from smddp_lite.backend import sagemaker_host
    from smddp_lite.backend.transports.select import host_name
    from smddp_lite.config import BackendConfig

    job_config({"current_host": "algo-2", "hosts": ["algo-1", "algo-2"], "network_interface_name": "lo"})
    assert host_name(BackendConfig()) == "algo-2"
    assert host_name(BackendConfig(hostname="sim-host-0")) == "sim-host-0", "SMDDP_HOSTNAME still decides"
    sagemaker_host.use_job_interface_for_gloo()
    assert os.environ["GLOO_SOCKET_IFNAME"] == "lo"


def test_a_missing_interface_or_a_broken_resource_config_falls_back_to_the_hostname(job_config, monkeypatch, caplog):
    import socket

    from smddp_lite.backend import sagemaker_host
    from smddp_lite.backend.transports.select import host_name
    from smddp_lite.config import BackendConfig

    job_config({"current_host": "algo-1", "hosts": ["algo-1"], "network_interface_name": "ethwe"})
    sagemaker_host.use_job_interface_for_gloo()
    assert "GLOO_SOCKET_IFNAME" not in os.environ, "an interface this machine lacks is not gloo's to look for"
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    job_config({"current_host": "algo-1", "hosts": ["algo-1"], "network_interface_name": "lo"})
    sagemaker_host.use_job_interface_for_gloo()
    assert os.environ["GLOO_SOCKET_IFNAME"] == "lo", "the user's choice stays"
    job_config("{not json")
    assert host_name(BackendConfig()) == socket.gethostname()
    assert "resourceconfig.json is not readable JSON" in caplog.text


def _local_mode():
    spec = importlib.util.spec_from_file_location("sagemaker_local", os.path.join(ROOT, "docker", "sagemaker_local.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run_job(tmp_path, **script) -> tuple[list[subprocess.CompletedProcess], float, list[str]]:
    """The job on algo-1 and algo-2, 2 processes each: every host's outcome, the seconds the
    job took, and the pids left in the hosts' namespaces once both ``train`` ended."""
    from benchmarks.multinode.cluster import SimCluster
    from smddp_lite.examples.sagemaker_train import make_data

    local = _local_mode()
    hosts = ["algo-1", "algo-2"]
    source = tmp_path / "source"
    source.mkdir()
    shutil.copy(local.SCRIPT, source)
    hyperparameters = local.job_hyperparameters("torch_distributed", "smddp-lab-job", 2, str(source), **script)
    make_data(str(tmp_path / "data"), rows=2048)
    for host in hosts:
        local.lay_out_instance(str(tmp_path / host), host, hosts, hyperparameters, str(tmp_path / "data"))
    env = {"PATH": f"{BIN}:{os.environ.get('PATH', '')}", "PYTHONPATH": ROOT,
           # what the image sets (docker/Dockerfile): `train` runs SageMaker's PyTorch toolkit
           "SAGEMAKER_TRAINING_MODULE": "sagemaker_pytorch_container.training:main"}
    with SimCluster(2, names=hosts) as cluster:
        start = time.monotonic()
        procs = [cluster.spawn(i, [os.path.join(BIN, "train")], env={**env, "SAGEMAKER_BASE_DIR": str(tmp_path / h)},
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for i, h in enumerate(hosts)]
        outputs = [p.communicate(timeout=300)[0] for p in procs]
        took = time.monotonic() - start
        left = [pid for ns in cluster.ns for pid in
                subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()]
    return [subprocess.CompletedProcess(p.args, p.returncode, out) for p, out in zip(procs, outputs)], took, left


@needs_root
@needs_toolkit
def test_a_torch_distributed_job_trains_on_two_hosts_as_sagemakers_toolkit_runs_it(tmp_path):
    done, _, left = _run_job(tmp_path, epochs=3)
    shown = "\n".join(f"--- algo-{i + 1} (exit {d.returncode}) ---\n{d.stdout[-4000:]}" for i, d in enumerate(done))
    assert [d.returncode for d in done] == [0, 0], shown
    # the ranks' lines share one pipe and can run together ("backend smddprank 1/4 on ...")
    ranks = {(int(r), host, backend) for r, w, host, backend in
             re.findall(r"rank (\d+)/(\d+) on (\S+): backend ([a-z]+?)(?=rank \d|\W|$)", shown) if w == "4"}
    assert ranks == {(0, "algo-1", "smddp"), (1, "algo-1", "smddp"), (2, "algo-2", "smddp"), (3, "algo-2", "smddp")}, shown
    assert re.search(r"uses transport hierarchical: 2 hosts x 2 ranks", shown), shown
    assert "went down" in shown, shown
    assert (tmp_path / "algo-1" / "model" / "model.pt").exists(), shown
    assert not (tmp_path / "algo-2" / "model" / "model.pt").exists(), "only rank 0 saves the model"
    assert not left, f"processes left on the hosts after train ended: {left}"


@tiers.FULL_ONLY
@needs_root
@needs_toolkit
def test_a_failing_script_leaves_its_error_for_sagemaker_and_ends_every_host(tmp_path):
    done, took, left = _run_job(tmp_path, epochs=3, **{"fail-on-rank": 3})
    shown = "\n".join(f"--- algo-{i + 1} (exit {d.returncode}) ---\n{d.stdout[-4000:]}" for i, d in enumerate(done))
    assert all(d.returncode != 0 for d in done), shown
    failure = tmp_path / "algo-2" / "output" / "failure"
    assert failure.exists() and "fails on purpose" in failure.read_text(), shown
    assert (tmp_path / "algo-1" / "output" / "failure").exists(), "rank 0's host names its own failure too"
    assert took < 90, f"the job took {took:.0f} s to end after a rank failed at its first step"
    assert not left, f"processes left on the hosts after train ended: {left}"
