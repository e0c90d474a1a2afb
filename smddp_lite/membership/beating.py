"""The process that beats a rank's heartbeat, so that the beat never waits for the rank's GIL.

A thread of the rank itself beats late whenever the rank holds the GIL for long (a C call that
never releases it, a large unpickle, a first import of hundreds of modules) or is starved of CPU,
and the others then declare a live rank lost. This process shares nothing with the rank but its
store: it adds to the rank's counter every ``beat_s`` while the rank lives and is not stopped
(SIGSTOP, a debugger: a stopped rank must look lost, as it is). It ends when the rank ends:
its parent changes (it is the rank's child), which it checks before every beat, so a dead rank
never beats again.

Run by path, not as ``-m smddp_lite...``: the package's import (the backend, its transports)
would double the start-up. Its arguments are the rank's pid, the store's host and port, the
job's prefix in it, the counter's key, the interval in seconds and how long a store request may
wait. It says ``beating`` on stdout after its first beat; on a store error it writes the error
to stderr and exits with status 1.
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta

import torch.distributed as dist


def stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped by a signal or traced at a stop (``/proc``'s T or t)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
    except OSError:  # gone: the parent check below ends this process
        return False
    return fields[0] in (b"T", b"t")


def _store_link():
    """Its neighbour module, imported without the package (whose import would load the backend)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    try:
        import store_link
    finally:
        sys.path.pop(0)
    return store_link


def main(argv: list[str]) -> int:
    parent, host, port, prefix, key, beat_s, timeout_s = (int(argv[0]), argv[1], int(argv[2]), argv[3], argv[4],
                                                          float(argv[5]), float(argv[6]))
    try:
        store = dist.PrefixStore(prefix, dist.TCPStore(host, port, is_master=False,
                                                       timeout=timedelta(seconds=timeout_s)))
    except Exception as exc:
        print(f"the heartbeat's process could not reach the store at {host}:{port}: {exc!r}", file=sys.stderr)
        return 1
    _store_link().bound_unacknowledged_requests(store, timeout_s)  # cut off, it ends rather than hang
    announced = False
    while os.getppid() == parent:
        if not stopped(parent):
            try:
                store.add(key, 1)
            except Exception as exc:
                print(f"the heartbeat's store request failed: {exc!r}", file=sys.stderr)
                return 1
            if not announced:  # the rank's thread stops beating once this is read
                print("beating", flush=True)
                announced = True
        time.sleep(beat_s)
    return 0

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
