"""``torch.compile`` around DistributedDataParallel on "smddp" trains as it does on gloo, on every
CPU transport, with torch's default DDPOptimizer and with compiled autograd. Accelerate and the
Hugging Face Trainer compile this way when their compile switch is on (test_frameworks.py runs
those)."""

from __future__ import annotations

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
