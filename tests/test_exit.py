"""A job ends the way torch's own backends let it: torchrun sees every process exit with 0.

These run plain processes under torchrun (not tests/worker.py, which exits with os._exit to
survive broken groups), so that the interpreter's own shutdown runs as in a user's script.
"""

from __future__ import annotations

import subprocess
import sys

from . import harness

_SCRIPT = """
import torch, torch.distributed as dist
import smddp_lite
dist.init_process_group("smddp")
gloo = dist.new_group(backend="gloo")
t = torch.ones(3)
dist.all_reduce(t)
dist.all_reduce(t, group=gloo)
dist.destroy_process_group()
"""


def test_a_job_with_a_gloo_subgroup_exits_cleanly(tmp_path):
    """A gloo group's worker thread frees a finished call's tensors just after the caller's wait
    returns, under the GIL: a script that exited at once aborted in 5 of 12 runs ("terminate
    called without an active exception", SIGABRT), and torchrun reported the job failed."""
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    for run in range(10):
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                               str(script)], env=harness._base_env(None), capture_output=True, text=True,
                              cwd=harness.ROOT, timeout=120)
        out = done.stdout + done.stderr
        assert done.returncode == 0 and "terminate called" not in out, (run, done.returncode, out[-3000:])
