"""Nothing a job's shared-memory segment leaves in /dev/shm when a rank is lost during init.

A real torchrun job: rank 1 dies after it read the segment's name from the store and before it
mapped the segment, so no rank unlinks the name as the last to map it; torchrun then ends rank 0,
waiting for it, with SIGTERM. The ranks are plain processes (not tests/worker.py), so that the
launcher's signal meets the interpreter's own handling, as in a user's script.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from smddp_lite.backend.transports import shm_segment

from . import harness

pytestmark = pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="needs /dev/shm (Linux)")

# rank 1 replaces the check that comes between reading the name and mapping it with its own death
_SCRIPT = """
import os, signal, sys
from datetime import timedelta
from pathlib import Path
import torch.distributed as dist
import smddp_lite
from smddp_lite.backend.transports import shm_segment

marks = Path(sys.argv[1])
if os.environ["RANK"] == "0":
    (marks / "rank0.pid").write_text(str(os.getpid()))
else:
    def killed_before_mapping(path, size):
        (marks / "published").write_text(path)
        os.kill(os.getpid(), signal.SIGKILL)

    shm_segment._open_published = killed_before_mapping
dist.init_process_group("smddp", timeout=timedelta(seconds=60))
"""


def test_a_rank_lost_during_init_leaves_no_segment_in_dev_shm(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script), str(tmp_path)], env=harness._base_env({"SMDDP_TRANSPORT": "shm"}),
                          capture_output=True, text=True, cwd=harness.ROOT, timeout=120)
    out = done.stdout + done.stderr
    published = tmp_path / "published"
    assert published.exists(), ("rank 1 never read the segment's name", out[-3000:])
    pid = (tmp_path / "rank0.pid").read_text()
    left = sorted(Path("/dev/shm").glob(f"smddp-*-{pid}-*"))
    for segment in left:  # the test's own leftover, so a failure leaves nothing either
        segment.unlink(missing_ok=True)
    assert Path(published.read_text()).name.split("-")[2] == pid, (published.read_text(), pid)
    # torchrun ended rank 0 with SIGTERM while it waited, and saw it end by that signal (its own
    # timeout, 60 s, would have removed the name on the way out)
    assert done.returncode != 0 and re.search(r"exitcode\s*:\s*-15\b", out), out[-3000:]
    assert left == [], (left, out[-3000:])


def test_init_leaves_every_signal_handler_as_it_found_it(monkeypatch):
    """Rank 0 handles the ending signals left at their default only while it alone can remove the
    segment's name; a handler of the user's is never replaced."""
    def users(signum, frame):  # a handler of the user's, never called here
        pass

    previous = signal.signal(signal.SIGHUP, users)
    try:
        found = {s: signal.getsignal(s) for s in shm_segment._ENDING_SIGNALS}
        inside = {}
        sweep = shm_segment.remove_stale_segments

        def seen_inside():  # rank 0 sweeps just before it makes the segment
            inside.update({s: signal.getsignal(s) for s in shm_segment._ENDING_SIGNALS})
            return sweep()

        monkeypatch.setattr(shm_segment, "remove_stale_segments", seen_inside)
        shm_segment.ShmSegment(dist.HashStore(), 0, 1, 4096, timedelta(seconds=10)).close()
        assert {s: signal.getsignal(s) for s in shm_segment._ENDING_SIGNALS} == found
        assert inside[signal.SIGHUP] is users
        assert all(inside[s] != signal.SIG_DFL for s in shm_segment._ENDING_SIGNALS), inside
    finally:
        signal.signal(signal.SIGHUP, previous)
