"""Calls that torch's own backends accept are accepted by smddp, with their results."""

from __future__ import annotations

import collections
import functools
import os

import pytest

from . import harness, tiers
from .test_cuda import needs_cupy, on_gpu

TRANSPORTS = {
    "shm": {"SMDDP_TRANSPORT": "shm"},
    "gloo": {"SMDDP_TRANSPORT": "gloo"},
    "hierarchical": {"SMDDP_ALGORITHM": "hierarchical"},
}


@pytest.mark.parametrize("transport", [*TRANSPORTS, "mpi"])
def test_integer_averages_truncate_as_nccl_does(transport):
    """A training framework's DDP strategy averages an int64 counter with ReduceOp.AVG at its
    first metric sync; torch's nccl computes the sum divided by the group's size, truncated."""
    if transport == "mpi":
        harness.skip_without_mpiexec()
        results = harness.launch_mpi("tests.drop_in_programs:integer_averages", 3, env={"SMDDP_TRANSPORT": "mpi"})
    else:
        world, layout = (4, {"hosts_of": 2}) if transport == "hierarchical" else (3, {})  # 2 hosts x 2 ranks
        results = harness.launch("tests.drop_in_programs:integer_averages", world, env=TRANSPORTS[transport], **layout)
    assert all(r == {"wrong": []} for r in harness.values(results)), harness.values(results)


def test_all_gather_coalesced_lays_out_outputs_as_gloo_does():
    """Output lists indexed by rank, then by input; 3 ranks and 2 inputs were refused before
    ("expected 3 output tensors (one per rank), found 1")."""
    ours = harness.values(harness.launch("tests.drop_in_programs:all_gather_coalesced_layout", 3))
    reference = harness.values(harness.launch("tests.drop_in_programs:all_gather_coalesced_layout", 3, backend="gloo"))
    for rank, (mine, theirs) in enumerate(zip(ours, reference)):
        assert mine["outputs"] == theirs["outputs"], (rank, mine["outputs"], theirs["outputs"])
        assert mine["outputs"][2][1] == [20.0, 21.0, 22.0, 23.0], mine
        error = mine["wrong_count"]
        assert error["type"] == "InvalidCallError" and "expected 3 output lists" in error["message"], error


def test_compile_and_its_steps_raise_no_warning_from_this_project():
    """compile's agreement check used torch's deprecated all_gather_into_tensor, which printed a
    FutureWarning on every rank."""
    root = os.fspath(harness.ROOT)
    for report in harness.values(harness.launch("tests.drop_in_programs:warnings_of_compile", 2)):
        ours = [w for w in report["warnings"] if w.startswith(root) and "/tests/" not in w]
        assert ours == [], ours


_NEVER_IMPORTS_SMDDP_LITE = """
import json, os, sys
import torch
import torch.distributed as dist

# the "torch.backends" entry point imported the package, but not its compiler (nor Triton)
light = "smddp_lite.compiler" not in sys.modules and "triton" not in sys.modules
dist.init_process_group(backend="smddp")
t = torch.full((5,), float(dist.get_rank() + 1))
dist.all_reduce(t)
backend = type(dist.group.WORLD._get_backend(torch.device("cpu"))).__module__
with open(f"rank{dist.get_rank()}.json", "w") as out:  # ranks share stdout: lines may interleave
    json.dump({"rank": dist.get_rank(), "sum": t.tolist(), "backend": backend, "light": light}, out)
dist.destroy_process_group()
"""


@tiers.FULL_ONLY
def test_a_script_that_never_imports_smddp_lite_gets_the_backend(tmp_path):
    """init_process_group(backend="smddp") ended in torch's "Unknown backend type smddp" unless the
    script imported smddp_lite: scripts written for SageMaker's library import another package."""
    import json

    script = tmp_path / "train.py"
    script.write_text(_NEVER_IMPORTS_SMDDP_LITE)
    run = harness.torchrun([str(script)], cwd=tmp_path, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    for rank in range(2):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert r == {"rank": rank, "sum": [3.0] * 5, "backend": "smddp_lite.backend.process_group",
                     "light": True}, r


_WRITTEN_FOR_SMDDP = """
import json
import torch
import torch.distributed as dist
import smddp_lite.torch_smddp  # was: import smdistributed.dataparallel.torch.torch_smddp
for attempt in range(2):  # a second group after destroy_process_group meets again
    dist.init_process_group(backend="smddp")
    t = torch.full((3,), float(dist.get_rank() + 1))
    dist.all_reduce(t)
    result = {"rank": dist.get_rank(), "world": dist.get_world_size(), "sum": t.tolist()}
    dist.destroy_process_group()
with open(f"rank{result['rank']}.json", "w") as out:
    json.dump(result, out)
"""


def test_a_script_written_for_smddp_runs_under_mpirun_as_sagemaker_starts_it(tmp_path):
    """SageMaker's "smdistributed dataparallel" distribution starts the script with mpirun and
    ``python -m mpi4py``, no RANK, WORLD_SIZE or MASTER_PORT set, and the script calls
    init_process_group with torch's default env://; torch refused that ("environment variable
    RANK expected")."""
    import json
    import subprocess
    import sys

    harness.skip_without_mpiexec()
    script = tmp_path / "train.py"
    script.write_text(_WRITTEN_FOR_SMDDP)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SMDDP_", "TORCHELASTIC_", "MASTER_"))
           and k not in ("RANK", "WORLD_SIZE")}
    run = subprocess.run([harness.mpiexec(), "-n", "3", sys.executable, "-m", "mpi4py", str(script)], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    for rank in range(3):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == {"rank": rank, "world": 3, "sum": [6.0] * 3}


@tiers.FULL_ONLY
@pytest.mark.parametrize("first", ["import smddp_lite", "import torch; import smddp_lite"])
def test_either_import_order_registers_smddp_lite_without_a_warning(first):
    """torch's import loads the entry point; when the script imported smddp_lite first, the
    package is still mid-import then, and finishes the registration itself."""
    import subprocess
    import sys

    code = (f"{first}\nimport torch.distributed as dist\n"
            "print(dist.Backend._plugins['SMDDP'].creator_fn.__module__)\n")
    run = subprocess.run([sys.executable, "-W", "error", "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stderr == "", run.stderr
    assert run.stdout.strip() == "smddp_lite.backend.process_group"


SWEPT = {  # transport: (launcher, environment, layout); 3 ranks each, against torch's gloo at 3 ranks
    "shm": ("env", {"SMDDP_TRANSPORT": "shm"}, {}),
    "gloo": ("env", {"SMDDP_TRANSPORT": "gloo"}, {}),
    "hierarchical": ("env", {"SMDDP_ALGORITHM": "hierarchical"}, {"hosts_of": 2}),  # hosts of 2 ranks and 1
    "mpi": ("mpi", {"SMDDP_TRANSPORT": "mpi"}, {}),
}


CUDA_SWEPT = {  # transport: (environment, world size); CUDA tensors, every rank on cuda:0
    "cuda-nccl": ({"SMDDP_CUDA_TRANSPORT": "nccl"}, 1),  # NCCL refuses two ranks on one GPU
    "cuda-staged": ({"SMDDP_CUDA_TRANSPORT": "staged"}, 3),  # host staging: the path without cupy
}


@functools.lru_cache(maxsize=None)
def _swept_by_gloo(world: int) -> list[dict]:
    """The reference: torch's gloo over the sweep, on CPU tensors."""
    return harness.values(harness.launch("tests.sweep:run", world, backend="gloo", timeout=300))


@functools.lru_cache(maxsize=None)
def _swept(transport: str) -> list[dict]:
    if transport in CUDA_SWEPT:
        env, world = CUDA_SWEPT[transport]
        return harness.values(harness.launch("tests.sweep:run", world, env=env, timeout=300, device="cuda"))
    launcher, env, layout = SWEPT[transport]
    if launcher == "mpi":
        return harness.values(harness.launch_mpi("tests.sweep:run", 3, env=env, timeout=300))
    return harness.values(harness.launch("tests.sweep:run", 3, env=env, timeout=300, **layout))


def _compared(ours: list[dict], reference: list[dict]) -> tuple[list[str], collections.Counter]:
    """(what differs, a tally of the kinds of agreement) between smddp's sweep and gloo's."""
    problems, tally = [], collections.Counter()
    for rank, (mine, theirs) in enumerate(zip(ours, reference)):
        assert mine.keys() == theirs.keys()
        for call, got in mine.items():
            want = theirs[call]
            if got[0] == "ok" and got[2] != "right":
                problems.append(f"rank {rank} {call}: smddp gave {got[2]}")
            elif want[0] == "ok" and want[2] == "right":
                if got[0] != "ok" or got[1] != want[1]:
                    problems.append(f"rank {rank} {call}: gloo gave the right result, smddp {got}")
                tally["both give the same bytes"] += 1
            elif want[0] == "ok":  # gloo's bool SUM (bytes of 2), its complex AVG of reduce and reduce_scatter
                if got[0] != "ok":
                    problems.append(f"rank {rank} {call}: gloo accepts it, smddp {got}")
                tally["gloo gives a wrong result, smddp the right one"] += 1
            elif got[0] == "ok":
                tally["gloo refuses, smddp gives NCCL's result"] += 1
            else:
                if want[1] not in got[3]:
                    problems.append(f"rank {rank} {call}: gloo raised {want[1]}, smddp {got[1]} (caught as {got[3]})")
                tally["both refuse"] += 1
    return problems, tally


@pytest.mark.parametrize("transport", [pytest.param(t, marks=[pytest.mark.mpi] if t == "mpi" else []) for t in SWEPT])
def test_every_call_gloo_accepts_is_accepted_with_its_result(transport):
    """The sweep of tests/sweep.py: every collective, dtype, reduction, blocking and async, in place
    or not. Where torch's gloo gives the right result, smddp gives the same bytes; where gloo
    refuses, smddp refuses too (as an exception of a type that catches gloo's) or gives what NCCL
    gives; it never gives a wrong result, nor invents one for a call no backend defines."""
    if transport == "mpi":
        harness.skip_without_mpiexec()
    problems, tally = _compared(_swept(transport), _swept_by_gloo(3))
    print(f"\n{transport}: " + "; ".join(f"{what}: {n}" for what, n in sorted(tally.items())))
    assert not problems, f"{len(problems)} calls differ:\n" + "\n".join(problems[:40])


@on_gpu
@pytest.mark.parametrize("transport", [pytest.param("cuda-nccl", marks=needs_cupy), "cuda-staged"])
def test_every_call_gloo_accepts_is_accepted_with_its_result_on_cuda_tensors(transport):
    """The same sweep on CUDA tensors, against the same reference: torch's gloo on CPU tensors at
    the same world size (outputs are compared as bytes, wherever they lie). Calls NCCL has no
    type or op for are staged, so every call gloo accepts is accepted on CUDA too."""
    problems, tally = _compared(_swept(transport), _swept_by_gloo(CUDA_SWEPT[transport][1]))
    print(f"\n{transport}: " + "; ".join(f"{what}: {n}" for what, n in sorted(tally.items())))
    assert not problems, f"{len(problems)} calls differ:\n" + "\n".join(problems[:40])
