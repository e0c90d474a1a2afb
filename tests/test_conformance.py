"""Runs the conformance suite (conformance.py) on every transport at world sizes 1, 2 and 3.

One job per (transport, world size) runs the suite; each test below checks one op group of it
on every rank. The arithmetic's every cell (dtype x op x size) runs on shm and on torch's gloo at
world size 2; every other job runs the cells that prove its transport moves bytes (see
conformance.FULL). torch's own gloo backend runs the same suite as the reference: there, an op it
does not implement is reported as unsupported rather than failed. On a machine with a GPU the
suite also runs on CUDA tensors: over NCCL at world size 1 (NCCL refuses two ranks on one GPU)
and staged through host memory at world sizes 1 to 3, all ranks sharing the one GPU.
"""

from __future__ import annotations

import functools
import importlib.util

import pytest
import torch

from . import conformance, harness, tiers

GROUPS = sorted({group for group, *_ in conformance.cases(2)})
HIER = {"SMDDP_ALGORITHM": "hierarchical"}
# (name, world sizes, backend, environment, launcher); "hier*" run 2 simulated hosts x 2 ranks
TRANSPORTS = [
    ("hier", (4,), "smddp", HIER, "env"),
    # small pieces: many pipelined inter-host steps in flight, and an odd-sized last piece
    ("hier-bf16-wire", (4,), "smddp", {**HIER, "SMDDP_INTER_NODE_WIRE_DTYPE": "bfloat16",
                                       "SMDDP_HIERARCHICAL_CHUNK_BYTES": "1048576"}, "env"),
    ("hier-interleaved", (4,), "smddp", HIER, "env"),  # ranks 0, 2 on one host: reordering paths
    ("hier-one-per-host", (2, 3), "smddp", {**HIER, "SMDDP_INTER_NODE_WIRE_DTYPE": "bfloat16",
                                            "SMDDP_HIERARCHICAL_CHUNK_BYTES": "1048576"}, "env"),
    # more than two hosts summing in the wire dtype on gloo's ring (SMDDP_INTER_NODE_ACCUMULATE)
    ("hier-one-per-host-wire-sums", (3,), "smddp", {**HIER, "SMDDP_INTER_NODE_WIRE_DTYPE": "bfloat16",
                                                    "SMDDP_INTER_NODE_ACCUMULATE": "wire"}, "env"),
    ("local", (1,), "smddp", {}, "env"),
    ("shm", (2, 3), "smddp", {"SMDDP_TRANSPORT": "shm"}, "env"),
    # the smallest chunk the configuration takes: every op in many steps, and small all_reduces
    # (one barrier, up to 16 KiB by default) that no longer fit one slot
    ("shm-4k-chunks", (2,), "smddp", {"SMDDP_TRANSPORT": "shm", "SMDDP_SHM_CHUNK_BYTES": "4096"}, "env"),
    ("gloo", (2, 3), "smddp", {"SMDDP_TRANSPORT": "gloo"}, "env"),
    ("mpi", (2, 3), "smddp", {"SMDDP_TRANSPORT": "mpi"}, "mpi"),
    ("torch-gloo-reference", (2, 3), "gloo", {}, "env"),
    ("nccl", (1,), "smddp", {"SMDDP_CUDA_TRANSPORT": "nccl"}, "env"),
    ("staged-cuda", (1, 2, 3), "smddp", {"SMDDP_CUDA_TRANSPORT": "staged"}, "env"),
]
ON_CUDA = {"nccl", "staged-cuda"}
NO_GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CI has none)")
NO_CUPY = pytest.mark.skipif(importlib.util.find_spec("cupy") is None,
                             reason="needs cupy with NCCL: pip install -e '.[cuda12]' (or cuda13)")


# cases torch's own gloo backend gets wrong, which smddp must not
REFERENCE_GETS_WRONG = {
    # gloo writes the root's own block into the output while it still sends the others from the input
    "scatter/output_in_another_block_of_the_input",
    # gloo writes received blocks over the input while later parts of it are still to be sent
    "all_to_all_uneven/output_is_the_input",
    "all_to_all/output_is_the_input-1",
    "all_to_all/output_is_the_input-3000",
}


# the quick tier's jobs (tests/tiers.py): each CPU transport of its own at 2 ranks
QUICK_JOBS = {("shm", 2), ("gloo", 2), ("mpi", 2)}
# the jobs that run every cell of the matrix (conformance.FULL): the arithmetic the CPU transports
# share, once on smddp and once on torch's gloo (the suite's own reference); and NCCL, whose
# arithmetic is its own. The others prove that they move bytes (conformance.BYTES).
FULL_MATRIX_JOBS = {("shm", 2), ("torch-gloo-reference", 2), ("nccl", 1), ("staged-cuda", 1)}


def _marks(name: str, world: int, launcher: str) -> list:
    tier = [tiers.QUICK] if (name, world) in QUICK_JOBS else [tiers.FULL_ONLY]
    if launcher == "mpi":
        return [pytest.mark.mpi, *tier]
    if name in ON_CUDA:
        return [pytest.mark.gpu, NO_GPU, *tier] + ([NO_CUPY] if name == "nccl" else [])
    return tier


PARAMS = [
    pytest.param(name, world, backend, env, launcher, group, id=f"{name}-w{world}-{group}",
                 marks=_marks(name, world, launcher))
    for name, worlds, backend, env, launcher in TRANSPORTS
    for world in worlds
    for group in GROUPS
]


@functools.lru_cache(maxsize=None)
def _job(name: str, world: int, backend: str, env_items: tuple, launcher: str):
    env = dict(env_items)
    profile = conformance.FULL if (name, world) in FULL_MATRIX_JOBS else conformance.BYTES
    if launcher == "mpi":
        results = harness.launch_mpi("tests.conformance:run", world, env=env, backend=backend, profile=profile,
                                     timeout=600)
    else:  # hierarchical runs see hosts of 2 ranks, all on this machine
        layouts = {"hier-interleaved": {"interleaved_hosts": 2}, "hier-one-per-host": {"hosts_of": 1},
                   "hier-one-per-host-wire-sums": {"hosts_of": 1}}
        layout = layouts.get(name, {"hosts_of": 2} if name.startswith("hier") else {})
        device = "cuda" if name in ON_CUDA else "cpu"
        results = harness.launch("tests.conformance:run", world, env=env, backend=backend, device=device,
                                 profile=profile, timeout=600, **layout)
    return harness.values(results)


@pytest.mark.parametrize("name, world, backend, env, launcher, group", PARAMS)
def test_conformance(name, world, backend, env, launcher, group):
    if launcher == "mpi":
        harness.skip_without_mpiexec()
    reports = _job(name, world, backend, tuple(sorted(env.items())), launcher)
    failures = []
    ran = 0
    for rank, report in enumerate(reports):
        for case, status in report.items():
            if not case.startswith(group + "/"):
                continue
            ran += 1
            if status == "ok" or (backend == "gloo" and (status.startswith("raised") or case in REFERENCE_GETS_WRONG)):
                continue
            failures.append(f"rank {rank} {case}: {status}")
    assert ran > 0, f"no cases ran for {group}"
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:40])
