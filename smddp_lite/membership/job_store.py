"""The surviving job's keys in the store: where they live and what each means. SurvivingSync
writes and reads them; the launcher (``smddp_lite.launch``) only asks whether a job trains, so
both import this module and neither imports the other for it.

Every key lives under ``smddp-surviving/<torchrun restart count>/`` of the job's root store
(torchrun keeps its store when it restarts every worker, which would otherwise find the last
run's job running):

- ``running``: the first generation's ranks train with SurvivingSync here; a replacement looks
  for it before anything else.
- ``first_world``: the first world size; replacements' ids go on from it.
- ``how``: ``<backend>,<group timeout in s>``, for replacements to make the same groups.
- ``finished``: ``<id>,<sync>``: a member ended its training (``close()``, or its process's
  end without an error), so the job is over; a replacement that finds it exits at once instead
  of waiting to be admitted, and the launcher starts none.
- ``ids``: a counter, one per replacement that started; its id is ``first_world`` plus the
  count before it. ``tickets``: a counter a replacement adds to once its heartbeat beats;
  ``ticket/<n>``: the id that took ticket n. ``admit/<id>``: ``<generation>/<record>``, the
  generation that admits it, or ``refused: <why>``.
- ``beat/<id>``: a counter each member's heartbeat adds to.
- ``<generation>/members``: the generation's record, ``<ids>;<tickets considered>``, written once
  by a compare-and-set (membership/generations.py); ``<generation>/in/<id>``: the check-ins
  after a failure; ``<generation>/here/<id>`` and ``<generation>/arrived``: its barrier;
  ``<generation>/group/``: the prefix of its process group's own keys.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch.distributed as dist

RUNNING, FINISHED = "running", "finished"


class JobStore(dist.PrefixStore):
    """The job's keys: a PrefixStore that remembers its prefix and root, which the heartbeat's
    process needs to reach the same keys (smddp_lite/membership/beating.py)."""

    def __init__(self, prefix: str, root: dist.Store) -> None:
        super().__init__(prefix, root)
        self.prefix, self.root = prefix, root


def job_store(root: dist.Store, restart_count: str | None = None) -> JobStore:
    """The job's keys in ``root`` (see the module's docstring for the prefix); ``restart_count``:
    torchrun's, by default this process's ``TORCHELASTIC_RESTART_COUNT``."""
    if restart_count is None:
        restart_count = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return JobStore(f"smddp-surviving/{restart_count}/", root)


def root_store(store: dist.Store) -> dist.Store:
    """The store under every prefix of ``store``."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store


def running_job_store() -> JobStore | None:
    """The store of a job already training with SurvivingSync, where this process is a replacement;
    None otherwise. Asked only where the store lives outside the ranks (torchrun's agent store, or
    a store of its own: TORCHELASTIC_USE_AGENT_STORE=True), since a rank would wait here for a
    store its rank 0 has not opened yet."""
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not port or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = job_store(dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=30)))
    return store if store.check([RUNNING]) else None


def mark_finished(store: dist.Store, member: int, step: int) -> None:
    """Say in ``store`` (the job's) that the job is over: ``member`` ended at sync ``step``."""
    store.set(FINISHED, f"{member},{step}")


def finished(store: dist.Store) -> tuple[int, int] | None:
    """(member, sync) of the mark ``mark_finished`` left, or None while the job trains."""
    if not store.check([FINISHED]):
        return None
    member, step = store.get(FINISHED).decode().split(",")
    return int(member), int(step)
