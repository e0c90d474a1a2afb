"""MPI jobs where process_vm_readv is forbidden, as in a Docker container without CAP_SYS_PTRACE.

MPICH copies large messages between ranks of a host with that call and does not fall back when it
fails. ``tests/forbid_process_vm_readv.py`` puts a job under the same seccomp rule Docker's default
profile applies, so these run without Docker.
"""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from smddp_lite.backend.transports.mpi_environment import cross_memory_attach_permitted

from . import harness, tiers

FORBID = [sys.executable, str(harness.ROOT / "tests" / "forbid_process_vm_readv.py")]
NUMEL = 1 << 20  # 4 MiB of float32: far above the size MPICH copies with one process_vm_readv

pytestmark = pytest.mark.skipif(platform.machine() != "x86_64", reason="the seccomp filter knows x86_64's syscalls")


def _needs_mpi() -> None:
    harness.skip_without_mpiexec()


def test_the_probe_sees_the_seccomp_rule():
    probe = "from smddp_lite.backend.transports.mpi_environment import cross_memory_attach_permitted as p; print(p())"
    forbidden = subprocess.run([*FORBID, sys.executable, "-c", probe], capture_output=True, text=True,
                               cwd=harness.ROOT, check=True)
    assert cross_memory_attach_permitted() is True
    assert forbidden.stdout.strip() == "False", forbidden.stderr


@pytest.mark.mpi
def test_mpi_job_runs_where_process_vm_readv_is_forbidden():
    """smddp_lite turns MPICH's cross-memory attach off before MPI starts; the MPI transport's
    large messages then go through MPICH's shared-memory queues and every result is exact."""
    _needs_mpi()
    results = harness.launch_mpi("tests.mpi_environment_programs:large_messages", 2, prefix=FORBID, numel=NUMEL,
                                 env={"SMDDP_TRANSPORT": "mpi"})
    for report in harness.values(results):
        assert report["error"]["type"] is None, report
        assert report["exact"] == {"broadcast": True, "all_reduce": True, "all_gather": True}, report
        assert report["cma"] == "0", report
    assert "uses transport mpi" in results[0].output, results[0].output


@tiers.FULL_ONLY
@pytest.mark.mpi
def test_one_host_job_of_mpiexec_takes_shared_memory_where_process_vm_readv_is_forbidden():
    """Without cross-memory attach MPICH is slower than the shm transport; left to choose, the
    group takes shm and says why."""
    _needs_mpi()
    results = harness.launch_mpi("tests.mpi_environment_programs:large_messages", 2, prefix=FORBID, numel=NUMEL)
    for report in harness.values(results):
        assert report["error"]["type"] is None, report
        assert report["exact"] == {"broadcast": True, "all_reduce": True, "all_gather": True}, report
    assert "uses transport shm" in results[0].output and "process_vm_readv is forbidden" in results[0].output, \
        results[0].output


@tiers.FULL_ONLY
@pytest.mark.mpi
def test_mpi_job_keeps_cross_memory_attach_where_it_is_allowed():
    _needs_mpi()
    results = harness.launch_mpi("tests.mpi_environment_programs:large_messages", 2, numel=NUMEL)
    reports = harness.values(results)
    assert [r["cma"] for r in reports] == [None, None], reports
    assert "uses transport mpi" in results[0].output, results[0].output
    assert all(r["exact"] == {"broadcast": True, "all_reduce": True, "all_gather": True} for r in reports), reports


@tiers.FULL_ONLY
@pytest.mark.mpi
def test_mpi_error_on_one_rank_fails_every_rank_at_once():
    """With cross-memory attach forced on where it is forbidden, MPICH fails on the rank that
    reads (rank 1, in the broadcast). It must say what to change, and rank 0, whose part of the
    broadcast can end without rank 1 and which then waits in the all_reduce, must hear of it at
    once rather than after the 120 s group timeout."""
    _needs_mpi()
    results = harness.launch_mpi("tests.mpi_environment_programs:large_messages", 2, prefix=FORBID, numel=NUMEL,
                                 env={"MPIR_CVAR_CH4_CMA_ENABLE": "1", "SMDDP_TRANSPORT": "mpi"}, timeout=100)
    reports = harness.values(results)
    failed, heard = reports[1]["error"], reports[0]["error"]
    assert failed["backend_error"] and "MPI failed" in failed["message"], failed
    assert "process_vm_readv" in failed["message"] and "--cap-add SYS_PTRACE" in failed["message"], failed
    assert heard["backend_error"] and "rank 1 failed in call" in heard["message"], heard
    assert heard["seconds"] < 30 and failed["seconds"] < 30, reports
