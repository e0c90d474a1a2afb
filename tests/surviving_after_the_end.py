"""A SurvivingSync job that ends, then a replacement started for it (as a launcher that saw a rank
fail just as the job ended would start one): run under torchrun, whose agent store outlives the
ranks that finish.

    torchrun --standalone --nproc-per-node 2 -m tests.surviving_after_the_end OUT [--close]

Both ranks train 3 steps. Rank 1 then ends: by ``sync.close()`` with ``--close``, else by its
process's end without an error. Rank 0 waits until the store says the job finished, starts the
replacement, and writes to OUT (JSON) how long the replacement took to end, its exit status
and what it said."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import torch

import smddp_lite
from smddp_lite.membership.job_store import finished, running_job_store

REPLACEMENT = ("import torch, smddp_lite; net = torch.nn.Linear(4, 2); "
               "smddp_lite.SurvivingSync(net, torch.optim.SGD(net.parameters(), lr=0.1))")


def main() -> None:
    out, close = sys.argv[1], "--close" in sys.argv
    net = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    sync = smddp_lite.SurvivingSync(net, optimizer)
    for step in range(3):
        net(torch.full((2, 4), float(step + sync.rank))).square().mean().backward()
        sync()
        optimizer.step()
        optimizer.zero_grad()
    if sync.rank == 1:
        if close:
            sync.close()
        return  # the interpreter's exit: SurvivingSync marks the job finished there, unless closed
    store = running_job_store()
    deadline = time.monotonic() + 60
    while finished(store) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    marked = finished(store)
    started = time.monotonic()
    replacement = subprocess.run([sys.executable, "-c", REPLACEMENT], env=dict(os.environ, SMDDP_REPLACEMENT="1"),
                                 capture_output=True, text=True, timeout=120)
    with open(out, "w") as f:
        json.dump({"marked": marked, "seconds": time.monotonic() - started, "returncode": replacement.returncode,
                   "said": replacement.stdout + replacement.stderr}, f)
    sync.close()


if __name__ == "__main__":
    main()
