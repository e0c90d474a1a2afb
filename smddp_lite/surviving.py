"""Data-parallel training that goes on when a rank is lost, without a restart.

``SurvivingSync`` averages a model's gradients over the ranks that are alive. When a rank dies,
stops past the group's timeout or exits mid-step, the call that met it fails on the survivors;
they then agree on who is left (through the rendezvous store, which must outlive any rank, as
torchrun's agent store does), build a new default process group among themselves (every
transport is rebuilt by the new group's own rendezvous), redo the interrupted gradient
average with the gradients they still hold, and return. The caller applies the optimizer step
as usual: every live rank applies the same gradients at every step.

Why a step can never be applied by one rank and not another: the gradients are averaged in a
buffer of their own, and ``param.grad`` is written only once the average has arrived. A rank
whose average arrived may already be computing the next step when another rank's average of the
same step failed (the last piece of an all_reduce reached one and not the other); it cannot be
further ahead, since its average needed every rank's gradients. So after a loss the survivors
compare steps: those a step ahead still hold the average the others missed (the last two
averages are kept), send it to them, and everyone goes on from the next step's sync together.

Who is left: each rank checks in under the new generation's keys when its call fails, and a
thread beats a counter in the store every half second. The survivors wait until every rank of
the old group has checked in or has a counter that stood still for ``stale_after``; the first
to decide writes the members with a compare-and-set, and everyone adopts that list. A rank that
checks in later (it was stopped, or its network came back) finds itself missing and raises
``RankDeclaredLostError``, never joining silently.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Iterable

import torch
import torch.distributed as dist

from .backend.errors import CollectiveMismatchError, SMDDPError

_log = logging.getLogger("smddp_lite")

_PREFIX = "smddp-surviving"
_BEAT_S = 0.5


class RankDeclaredLostError(SMDDPError):
    """This rank was declared lost by the others (it did not check in before they decided who is
    left) and may not rejoin: the group went on without it."""


class TooFewRanksError(SMDDPError):
    """Fewer ranks are left than ``min_world_size``: the job stops rather than train on."""


@dataclass(frozen=True)
class Change:
    """What a loss changed, as ``on_change`` receives it."""

    generation: int  # 1 after the first loss, and so on
    lost: tuple[int, ...]  # the ranks lost, numbered as in the job's first group
    members: tuple[int, ...]  # the ranks left, numbered as in the job's first group
    rank: int  # this rank in the new group
    world_size: int  # the new group's size
    step: int  # the sync that was interrupted (0 is the first ``sync()``)
    seconds: float  # from this rank's failed call to the new group's first call


class SurvivingSync:
    """Average ``model``'s gradients over the live ranks, and go on when ranks are lost.

    Call it where DDP would have synchronised: after ``backward()`` and before the optimizer's
    step. The default process group must exist (``smddp_lite.init()``), and its store must outlive
    every rank (torchrun's agent store does; a store hosted by rank 0 ends with rank 0)::

        import smddp_lite
        smddp_lite.init()
        sync = smddp_lite.SurvivingSync(model, min_world_size=2,
                                        on_change=lambda c: sampler.set_world(c.rank, c.world_size))
        for batch in loader:
            model(batch).loss.backward()
            sync()                      # the average over the live ranks, in every param.grad
            optimizer.step()
            optimizer.zero_grad()

    Args:
        model: the module (or an iterable of parameters) whose ``.grad`` are averaged. Every rank
            must start from the same parameters, as with DDP.
        min_world_size: below this many live ranks, ``sync()`` raises ``TooFewRanksError`` on
            every survivor.
        on_change: called on every survivor after each loss, with a ``Change`` (new rank, world
            size, who was lost): the place to re-split a sampler's data.
        stale_after: how long a rank's heartbeat may stand still before the survivors count it
            lost (a rank that is alive but stopped, or cut off).

    Other process groups made from the old default group are gone after a loss: make them again
    in ``on_change``.
    """

    def __init__(self, model: torch.nn.Module | Iterable[torch.Tensor], *, min_world_size: int = 1,
                 on_change: Callable[[Change], None] | None = None,
                 stale_after: timedelta = timedelta(seconds=2)) -> None:
        if not dist.is_initialized():
            raise RuntimeError("SurvivingSync needs the default process group: call smddp_lite.init() first")
        params = model.parameters() if isinstance(model, torch.nn.Module) else model
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("SurvivingSync found no parameter that requires grad in the model it was given")
        if min_world_size < 1:
            raise ValueError(f"min_world_size must be 1 or more, found {min_world_size}")
        self.min_world_size, self.on_change = min_world_size, on_change
        self.stale_after_s = stale_after.total_seconds()
        group = dist.group.WORLD
        self._backend = dist.get_backend(group)
        self._timeout = _group_timeout(group)
        self._base_store = _root_store(dist.distributed_c10d._get_default_store())
        self.members: tuple[int, ...] = tuple(range(dist.get_world_size()))
        self.first_rank = dist.get_rank()  # this rank's number in the job's first group, for good
        self.generation = 0
        self.step = 0  # the next sync's number
        by_dtype: dict[torch.dtype, int] = {}
        for p in self.params:
            by_dtype[p.dtype] = by_dtype.get(p.dtype, 0) + p.numel()
        # two averages per dtype: this step's, and the last one, which a lagging survivor may need
        self._averages = [{dtype: torch.zeros(n, dtype=dtype, device=self.params[0].device)
                           for dtype, n in by_dtype.items()} for _ in range(2)]
        self._heart = _Heartbeat(self._base_store, self.first_rank)

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def world_size(self) -> int:
        return dist.get_world_size()

    def close(self) -> None:
        """Stop the heartbeat (a rank that leaves on purpose would otherwise be waited for as lost
        only once its beats stop)."""
        self._heart.stop()

    def __call__(self) -> None:
        """Average every parameter's gradient over the live ranks, in place in ``param.grad``."""
        while True:
            try:
                self._average(self.step)
            except CollectiveMismatchError:
                raise  # every rank is alive and called something else: a bug to fix, not a loss
            except dist.DistError as failure:
                if self._recover(failure):
                    return  # the average of this step came from a survivor a step ahead
                continue  # redo this step's sync in the new group
            self._unpack(self.step)
            self.step += 1
            return

    # one step -----------------------------------------------------------------------------------
    def _average(self, step: int) -> None:
        averages = self._averages[step % 2]
        offsets = dict.fromkeys(averages, 0)
        for p in self.params:
            flat = averages[p.dtype]
            at = offsets[p.dtype]
            view = flat[at:at + p.numel()]
            if p.grad is None:
                view.zero_()
            else:
                view.copy_(p.grad.reshape(-1))
            offsets[p.dtype] = at + p.numel()
        for flat in averages.values():
            dist.all_reduce(flat)
            flat.div_(dist.get_world_size())

    def _unpack(self, step: int) -> None:
        averages = self._averages[step % 2]
        offsets = dict.fromkeys(averages, 0)
        for p in self.params:
            at = offsets[p.dtype]
            average = averages[p.dtype][at:at + p.numel()].view_as(p)
            if p.grad is None:
                p.grad = average.clone()
            else:
                p.grad.copy_(average)
            offsets[p.dtype] = at + p.numel()

    # after a loss -------------------------------------------------------------------------------
    def _recover(self, failure: BaseException) -> bool:
        """Agree on who is left, make the new group, and settle the interrupted step; again if a
        rank is lost meanwhile. True when this rank's step was settled by a survivor's average
        (the caller returns), False when the step's sync is to be redone in the new group."""
        if isinstance(failure, (RankDeclaredLostError, TooFewRanksError)):
            raise failure
        started, first, interrupted = time.monotonic(), self.members, self.step
        while True:
            generation = self.generation + 1
            members = self._agree_on_members(self.members, generation)
            lost = tuple(r for r in first if r not in members)
            if self.first_rank not in members:
                self._heart.stop()
                raise RankDeclaredLostError(
                    f"[smddp rank {self.first_rank}] SurvivingSync: the other ranks declared this rank lost and "
                    f"went on as generation {generation} without it (members {list(members)}): it did not check "
                    f"in after the failure ({failure}). A lost rank cannot rejoin: end this process.")
            if len(members) < self.min_world_size:
                self._heart.stop()
                raise TooFewRanksError(
                    f"[smddp rank {self.first_rank}] SurvivingSync: {len(members)} ranks are left after losing "
                    f"{_said(lost)}, fewer than min_world_size={self.min_world_size}; the job stops here. "
                    f"Restart it from a checkpoint, or lower min_world_size to train on with fewer ranks.")
            self.members, self.generation = members, generation
            try:
                self._rebuild(members, generation)
                settled = self._settle_interrupted_step()
            except dist.DistError as again:  # another rank lost while the group was remade
                failure = again
                continue
            break
        change = Change(generation, lost, members, dist.get_rank(), dist.get_world_size(), interrupted,
                        time.monotonic() - started)
        _log.warning("smddp: lost %s; going on with %d ranks (this one is now rank %d), %.2f s after the "
                     "failure at sync %d: %s", _said(lost), change.world_size, change.rank, change.seconds,
                     change.step, failure)
        if self.on_change is not None:
            self.on_change(change)
        return settled

    def _agree_on_members(self, old: tuple[int, ...], generation: int) -> tuple[int, ...]:
        store, key = self._base_store, f"{_PREFIX}/{generation}"
        store.set(f"{key}/in/{self.first_rank}", str(self.step))
        decided_key = f"{key}/members"
        beats = {r: (self._heart.read(r), time.monotonic()) for r in old}
        deadline = time.monotonic() + max(self._timeout, 4 * self.stale_after_s)
        while True:
            if store.check([decided_key]):
                return _parse(store.get(decided_key))
            checked_in = [r for r in old if store.check([f"{key}/in/{r}"])]
            now = time.monotonic()
            waiting = []
            for r in old:
                if r in checked_in:
                    continue
                beat = self._heart.read(r)
                if beat != beats[r][0]:
                    beats[r] = (beat, now)
                if now - beats[r][1] < self.stale_after_s:
                    waiting.append(r)
            if not waiting or now > deadline:
                decided = _parse(store.compare_set(decided_key, "", ",".join(map(str, checked_in))))
                return decided
            time.sleep(0.05)

    def _rebuild(self, members: tuple[int, ...], generation: int) -> None:
        try:
            dist.destroy_process_group()
        except Exception as exc:  # the old group met a dead peer: what it could not close is gone with it
            _log.debug("smddp: the old group's teardown after a loss raised %r", exc)
        store = dist.PrefixStore(f"{_PREFIX}/{generation}/group/", self._base_store)
        dist.init_process_group(self._backend, store=store, rank=members.index(self.first_rank),
                                world_size=len(members), timeout=timedelta(seconds=self._timeout))

    def _settle_interrupted_step(self) -> bool:
        """Every survivor's step, gathered: those a step behind take the average a rank ahead
        still holds (True for them); everyone else redoes the sync of the step it is at."""
        steps = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
        dist.all_gather(steps, torch.tensor([self.step], dtype=torch.int64))
        steps = [int(s) for s in steps]
        behind = min(steps)
        if max(steps) == behind:
            return False
        if max(steps) != behind + 1:  # an average needs every rank, so no rank can be two ahead
            raise RuntimeError(f"SurvivingSync: survivors are at syncs {steps}, more than one apart; "
                               "every rank must call sync() once per step")
        holder = steps.index(behind + 1)
        for flat in self._averages[behind % 2].values():
            dist.broadcast(flat, src=holder)
        if self.step == behind:
            self._unpack(behind)
            self.step += 1
            return True
        return False


class _Heartbeat:
    """A counter per rank in the store, added to every half second by a thread with its own store
    client: a rank whose counter stands still is dead, stopped or cut off."""

    def __init__(self, store: dist.Store, rank: int) -> None:
        self.store, self.rank = store, rank
        self._stop = threading.Event()
        self._beating_store = _own_client(store)
        self._beating_store.add(self._key(rank), 1)
        self._thread = threading.Thread(target=self._beat, name="smddp-heartbeat", daemon=True)
        self._thread.start()

    def _key(self, rank: int) -> str:
        return f"{_PREFIX}/beat/{rank}"

    def _beat(self) -> None:
        while not self._stop.wait(_BEAT_S):
            try:
                self._beating_store.add(self._key(self.rank), 1)
            except Exception as exc:  # the store is gone: the job is ending
                _log.debug("smddp: the heartbeat stopped: %r", exc)
                return

    def read(self, rank: int) -> int:
        return self.store.add(self._key(rank), 0)

    def stop(self) -> None:
        self._stop.set()


def _root_store(store: dist.Store) -> dist.Store:
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store


def _own_client(store: dist.Store) -> dist.Store:
    if isinstance(store, dist.TCPStore):
        return dist.TCPStore(store.host, store.port, is_master=False, timeout=timedelta(seconds=30))
    return store


def _group_timeout(group: dist.ProcessGroup) -> float:
    timeout = getattr(group._get_backend(torch.device("cpu")), "timeout", None)
    if timeout is None:
        timeout = dist.distributed_c10d._get_pg_default_timeout(group) if hasattr(
            dist.distributed_c10d, "_get_pg_default_timeout") else timedelta(minutes=30)
    return timeout.total_seconds()


def _parse(text: bytes | str) -> tuple[int, ...]:
    text = text.decode() if isinstance(text, bytes) else text
    return tuple(int(r) for r in text.split(",") if r)


def _said(ranks: tuple[int, ...]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))
