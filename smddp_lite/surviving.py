"""Data-parallel training that goes on when a rank is lost, without a restart.

``SurvivingSync`` averages a model's gradients over the ranks that are alive. When a rank dies,
stops (found by its heartbeat, which then interrupts the waiting call) or exits mid-step, the
call that met it fails on the survivors;
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
thread beats a counter in the store every half second and reads the members' counters four
times a second (from the member's first beat: making a ``SurvivingSync`` waits until every
member has made its own); a member whose counter stood still for ``stale_after`` is declared lost
at once, whatever the group's timeout (``ProcessGroupSMDDP.interrupt``). The survivors wait until every rank of
the old group has checked in or has a counter that stood still for ``stale_after``; the first
to decide writes the members with a compare-and-set, and everyone adopts that list. A rank that
checks in later (it was stopped, or its network came back) finds itself missing and raises
``RankDeclaredLostError``, never joining silently.

A DistributedDataParallel model keeps its buckets: smddp_lite/surviving_ddp.py reduces them
during backward, and ``sync()`` settles the step the same way, bucket by bucket.

Growing back: a replacement process (the same script, started by the user's launcher) makes its
``SurvivingSync`` before any process group exists (or in the group of one that
``smddp_lite.init()`` makes in a replacement ``smddp_lite.launch`` started); finding the job running in the store, it
takes a ticket and waits. The heartbeat threads read the ticket count, rank 0 adds it to the
gradient average (one element more, at no cost of a call), so every member learns of the
newcomer in the same step; at the start of the next ``sync()`` they admit it: the group is made
again with the newcomer last, and rank 0 sends it the parameters, the optimizer's state and the
step count. The newcomer then trains that step with the others.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Iterable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from .backend import before_exit
from .backend.errors import CollectiveMismatchError, SMDDPError
from .job_store import RUNNING, finished, job_store, mark_finished, root_store, running_job_store
from .launch import init, standing_by
from .sampling import ElasticSampler
from .surviving_ddp import DDPBuckets, refuse_wrappers_that_cannot_survive

_log = logging.getLogger("smddp_lite")

_BEAT_S = 0.5  # how often a rank adds to its counter
_LOOK_S = 0.25  # how often it reads the others': a stale counter is seen within this of stale_after


class RankDeclaredLostError(SMDDPError):
    """This rank was declared lost by the others (it did not check in before they decided who is
    left) and may not rejoin: the group went on without it."""


class HeartbeatStoppedError(RankDeclaredLostError):
    """This rank's heartbeat thread stopped (its store client failed): the others no longer hear
    it and declare it lost once ``stale_after`` passes, so it may not train on."""


class JobFinishedError(SMDDPError):
    """A replacement found the job it was started for finished: there is nothing to join."""


class TooFewRanksError(SMDDPError):
    """Fewer ranks are left than ``min_world_size``: the job stops rather than train on."""


@dataclass(frozen=True)
class Change:
    """What a loss changed, as ``on_change`` receives it."""

    generation: int  # 1 after the first loss, and so on
    lost: tuple[int, ...]  # the ranks lost, by their ids (a first-group rank's id is its rank then)
    joined: tuple[int, ...]  # the replacements admitted, by their ids (the first world size on)
    members: tuple[int, ...]  # the ranks now in the group, by their ids, in rank order
    rank: int  # this rank in the new group
    world_size: int  # the new group's size
    step: int  # the sync at which the group changed (0 is the first ``sync()``)
    seconds: float  # from this rank's failed call (or its admission's start) to the new group's first call
    # the first sync whose average the new members make, the same on every rank (``step`` is
    # this rank's: after a loss, a rank whose average had arrived is one sync ahead)
    first_step: int


class SurvivingSync:
    """Average ``model``'s gradients over the live ranks; go on when ranks are lost, and grow back
    when replacements start.

    Call it where DDP would have synchronised: after ``backward()`` and before the optimizer's
    step. Make it before the training loop, in place of ``smddp_lite.init()`` (or after it): in a
    replacement process it joins the running job instead. The rendezvous store must outlive every
    rank (docs/surviving.md)::

        import smddp_lite
        sampler = smddp_lite.ElasticSampler(len(dataset), batch_size=32)
        sync = smddp_lite.SurvivingSync(model, optimizer, min_world_size=2, sampler=sampler)
        for epoch in range(sampler.epoch, epochs):  # a replacement starts in the job's epoch
            sampler.set_epoch(epoch)
            for indices in sampler:                 # this rank's part of the step, re-split at changes
                model(batch_of(dataset, indices)).loss.backward()
                sync()                  # the average over the live ranks, in every param.grad
                optimizer.step()
                optimizer.zero_grad()

    Args:
        model: the module (or an iterable of parameters) whose ``.grad`` are averaged. Every rank
            must start from the same parameters, as with DDP. A ``DistributedDataParallel``
            keeps its buckets, reduced during backward through a comm hook of SurvivingSync's
            (make the group with ``smddp_lite.init()`` first; docs/surviving.md). FSDP and
            ``smddp_lite.compile`` models are refused.
        optimizer: sent, with the parameters, to each replacement (its ``state_dict``). Without
            it a replacement gets the parameters only.
        min_world_size: below this many live ranks, ``sync()`` raises ``TooFewRanksError`` on
            every survivor.
        on_change: called on every rank after each change (a loss, or replacements admitted),
            with a ``Change``: the place to remake other groups, or re-split data by hand.
        stale_after: how long a rank's heartbeat may stand still before the survivors count it
            lost (a rank that is alive but stopped, or cut off).
        timeout: the process group's timeout where this makes the group (no group yet).
        sampler: an ``ElasticSampler``, told of every change (so that no sample of the epoch is
            skipped or trained twice) and sent to each replacement with the job's state.

    Other process groups made from the old default group are gone after a change: make them
    again in ``on_change``.
    """

    def __init__(self, model: torch.nn.Module | Iterable[torch.Tensor],
                 optimizer: torch.optim.Optimizer | None = None, *, min_world_size: int = 1,
                 on_change: Callable[[Change], None] | None = None,
                 stale_after: timedelta = timedelta(seconds=2), timeout: timedelta | None = None,
                 sampler: ElasticSampler | None = None) -> None:
        refuse_wrappers_that_cannot_survive(model)
        params = model.parameters() if isinstance(model, torch.nn.Module) else model
        self.params = [p for p in params if p.requires_grad]
        # sent to replacements with the parameters (BatchNorm's running statistics and the like)
        self.buffers = list(model.buffers()) if isinstance(model, torch.nn.Module) else []
        if not self.params:
            raise ValueError("SurvivingSync found no parameter that requires grad in the model it was given")
        if min_world_size < 1:
            raise ValueError(f"min_world_size must be 1 or more, found {min_world_size}")
        self.optimizer, self.min_world_size, self.on_change = optimizer, min_world_size, on_change
        self.sampler = sampler
        self._first_new_step = 0
        self.stale_after_s = stale_after.total_seconds()
        self.generation = 0
        self.step = 0  # the next sync's number
        self._tickets_admitted = 0
        self._tickets_seen = 0  # as the group learnt it from rank 0, in the last average
        by_dtype: dict[torch.dtype, int] = {}
        for p in self.params:
            by_dtype[p.dtype] = by_dtype.get(p.dtype, 0) + p.numel()
        # the ticket count rides in the last element of a float32 or float64 average (exact up to
        # 2**24), or in a float32 tensor of its own where the model has neither
        self._carrier = next((d for d in (torch.float32, torch.float64) if d in by_dtype), None)
        device = self.params[0].device
        # two averages per dtype: this step's, and the last one, which a lagging survivor may need
        self._averages = [{dtype: torch.zeros(n + (dtype == self._carrier), dtype=dtype, device=device)
                           for dtype, n in by_dtype.items()} for _ in range(2)]
        self._control = None if self._carrier else torch.zeros(1, dtype=torch.float32, device=device)
        self._buckets: DDPBuckets | None = None
        if isinstance(model, DistributedDataParallel):
            self._buckets = DDPBuckets(model, tickets=lambda: self._heart.tickets, step=lambda: self.step)
            model.register_forward_pre_hook(self._before_forward)
        store = standing_by() if dist.is_initialized() else running_job_store()
        if store is not None:
            self._join(store, timeout)
            return
        if not dist.is_initialized():
            init(timeout=timeout)
        group = dist.group.WORLD
        self._backend = dist.get_backend(group)
        self._timeout = _group_timeout(group)
        self._base_store = job_store(root_store(dist.distributed_c10d._get_default_store()))
        self.members: tuple[int, ...] = tuple(range(dist.get_world_size()))
        self.first_rank = dist.get_rank()  # this rank's id for good
        self._heart = _Heartbeat(self._base_store, self.first_rank, self.stale_after_s, self._found_stale)
        # each member is watched from its first beat: a rank still building its model or loading
        # its data when the others start watching (seconds apart on a loaded machine) is late, not lost
        self._heart.wait_for_first_beats(self.members, self._timeout)
        self._heart.watch(self.members)
        self._base_store.set("first_world", str(dist.get_world_size()))
        self._base_store.set("how", f"{self._backend},{self._timeout}")
        self._base_store.set(RUNNING, "1")
        before_exit.stop_at_exit(self._finish_at_exit)
        if sampler is not None:
            sampler.attach(self.first_rank, self.members)

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def world_size(self) -> int:
        return dist.get_world_size()

    def close(self) -> None:
        """End this rank's training: say in the store that the job is over, and stop the heartbeat
        (a rank that stops beating would otherwise be waited for as lost). A replacement started
        from then on (by a launcher that saw a rank fail as the job ended, or by hand) exits at
        once with ``JobFinishedError`` instead of waiting to be admitted. A member whose process
        ends without an unhandled exception does this at exit. A rank the others declared lost,
        or whose heartbeat stopped, says nothing."""
        if self._heart.beating():
            mark_finished(self._base_store, self.first_rank, self.step)
        self._heart.stop()

    def _finish_at_exit(self) -> None:
        """backend/before_exit.py calls this at the interpreter's exit, before the heartbeat's stop."""
        if getattr(sys, "last_exc", None) is None and getattr(sys, "last_value", None) is None:
            self.close()  # no unhandled exception: the script reached its end
        else:
            self._heart.stop()

    def __call__(self) -> None:
        """Average every parameter's gradient over the live ranks, in place in ``param.grad``."""
        self._heart.raise_if_stopped()
        if self._buckets is not None and self.step not in self._buckets.flat_steps:
            self._settle_ddp_step()
        else:
            self._sync_flat()
        if self._buckets is not None:  # a survivor a step ahead may still send the one before
            self._buckets.flat_steps.intersection_update({self.step - 1, self.step - 2})

    def _sync_flat(self) -> None:
        while True:
            try:
                if self._tickets_seen > self._tickets_admitted and self._buckets is None:
                    self._admit()  # (DDP's are admitted before the forward: _before_forward)
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

    def _settle_ddp_step(self) -> None:
        """DDP's hooks averaged the buckets during backward; after a failed call, agree on who is
        left and average the kept buckets again, or take a survivor's that is a step ahead."""
        buckets = self._buckets
        failure = buckets.finish()
        while failure is not None:
            if isinstance(failure, CollectiveMismatchError):
                raise failure  # every rank is alive and called something else: a bug to fix, not a loss
            if self._recover(failure):  # (which raises what ends this rank's part in the job)
                return  # the average of this step came from a survivor a step ahead
            try:
                self._tickets_seen = max(self._tickets_seen, buckets.reduce_again(self.step))
            except CollectiveMismatchError:
                raise
            except dist.DistError as again:  # another rank lost during the redo
                failure = again
                continue
            self.step += 1
            return
        self._tickets_seen = max(self._tickets_seen, buckets.arrived(self.step))
        self.step += 1

    def _before_forward(self, _module: torch.nn.Module, _inputs: object) -> None:
        """With DDP, replacements are admitted before the forward of the step they train, since
        its backward reduces the buckets. That step is averaged flat: a new DDP's first bucket
        layout differs from the others', and every rank rebuilds its layout at the next forward."""
        if self._tickets_seen > self._tickets_admitted:
            self._admit()
            self._buckets.flat_steps.add(self.step)

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
        tickets = self._heart.tickets if dist.get_rank() == 0 else 0
        control = averages[self._carrier][-1:] if self._carrier else self._control
        control.fill_(tickets)
        world = dist.get_world_size()
        for dtype, flat in averages.items():
            dist.all_reduce(flat)
            (flat[:-1] if dtype == self._carrier else flat).div_(world)
        if self._control is not None:
            dist.all_reduce(self._control)
        self._tickets_seen = max(self._tickets_seen, int(control.item()))
        if self._buckets is not None:  # rank 0's module buffers, which DDP would have broadcast
            self._buckets.send_buffers(step)

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

    # growing back -------------------------------------------------------------------------------
    def _join(self, store: dist.Store, timeout: timedelta | None) -> None:
        """This process is a replacement: take a ticket, wait to be admitted, and take the job's
        state from rank 0."""
        started = time.monotonic()
        self._base_store = store
        self._refuse_a_finished_job(store)
        ticket = store.add("tickets", 1)
        self.first_rank = int(store.get("first_world")) + ticket - 1
        backend, timeout_s = store.get("how").decode().split(",")
        self._backend, self._timeout = backend, float(timeout_s)
        self._heart = _Heartbeat(store, self.first_rank, self.stale_after_s, self._found_stale)
        key = f"admit/{ticket}"
        wait = (timeout or timedelta(seconds=max(self._timeout, 60))).total_seconds()
        deadline = time.monotonic() + wait
        looked = time.monotonic()
        while not store.check([key]):
            self._heart.raise_if_stopped()
            if time.monotonic() - looked > _LOOK_S:  # the job may end while this one waits
                looked = time.monotonic()
                self._refuse_a_finished_job(store)
            if time.monotonic() > deadline:
                self._heart.stop()
                raise SMDDPError(
                    f"SurvivingSync: this replacement (id {self.first_rank}) was not admitted within {wait:.0f} s. "
                    "The job's ranks admit a replacement at their next sync(); is the job still training?")
            time.sleep(0.02)
        generation, members = store.get(key).decode().split(";")
        self.generation, self.members = int(generation), _parse(members)
        self._heart.watch(self.members)
        before_exit.stop_at_exit(self._finish_at_exit)
        self._rebuild(self.members, self.generation, admitted=True)
        self._receive_state()
        if self._buckets is not None:  # its first step is averaged flat, as _before_forward says
            self._buckets.flat_steps.add(self.step)
        change = Change(self.generation, (), (self.first_rank,), self.members, dist.get_rank(),
                        dist.get_world_size(), self.step, time.monotonic() - started, self.step)
        _log.warning("smddp: joined as rank %d of %d at sync %d, %.2f s after starting", change.rank,
                     change.world_size, change.step, change.seconds)
        self._tell(change)

    def _refuse_a_finished_job(self, store: dist.Store) -> None:
        done = finished(store)
        if done is None:
            return
        if getattr(self, "_heart", None) is not None:
            self._heart.stop()
        member, step = done
        raise JobFinishedError(
            f"SurvivingSync: the job this replacement was started for has finished (member {member} ended its "
            f"training after sync {step}), so there is nothing to join; this process ends here. To train "
            "further, start a new job (from its last checkpoint).")

    def _admit(self) -> None:
        """Every member, at the same sync: make the group again with the waiting replacements last,
        and send them the job's state."""
        started = time.monotonic()
        first_world = int(self._base_store.get("first_world"))
        tickets = range(self._tickets_admitted + 1, self._tickets_seen + 1)
        joined = tuple(first_world + t - 1 for t in tickets)
        members, generation = self.members + joined, self.generation + 1
        if dist.get_rank() == 0:
            for t in tickets:
                self._base_store.set(f"admit/{t}", f"{generation};{','.join(map(str, members))}")
        self._tickets_admitted = self._tickets_seen
        self.members, self.generation = members, generation
        self._heart.watch(members)
        self._rebuild(members, generation, admitted=True)
        self._send_state()
        change = Change(generation, (), joined, members, dist.get_rank(), dist.get_world_size(), self.step,
                        time.monotonic() - started, self.step)
        _log.warning("smddp: admitted %s at sync %d; %d ranks now (this one is rank %d), %.2f s",
                     _said(joined), self.step, change.world_size, change.rank, change.seconds)
        self._tell(change)

    def _tell(self, change: Change) -> None:
        if self.sampler is not None:
            self.sampler.changed(change)
        if self.on_change is not None:
            self.on_change(change)

    def _send_state(self) -> None:
        state = [{"step": self.step, "tickets": self._tickets_admitted,
                  "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
                  "sampler": self.sampler.state_dict() if self.sampler is not None else None}]
        dist.broadcast_object_list(state, src=0)
        with torch.no_grad():
            for t in self.params + self.buffers:
                dist.broadcast(t.data, src=0)

    def _receive_state(self) -> None:
        state = [None]
        dist.broadcast_object_list(state, src=0)
        with torch.no_grad():
            for t in self.params + self.buffers:
                dist.broadcast(t.data, src=0)
        self.step = state[0]["step"]
        self._tickets_admitted = self._tickets_seen = state[0]["tickets"]
        if self.optimizer is not None and state[0]["optimizer"] is not None:
            self.optimizer.load_state_dict(state[0]["optimizer"])
        if self.sampler is not None and state[0]["sampler"] is not None:
            self.sampler.load_state_dict(state[0]["sampler"])
            self.sampler.me = self.first_rank

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
            self._heart.watch(members)
            try:
                self._rebuild(members, generation, admitted=False)
                settled = self._settle_interrupted_step()
            except dist.DistError as again:  # another rank lost while the group was remade
                failure = again
                continue
            break
        change = Change(generation, lost, (), members, dist.get_rank(), dist.get_world_size(), interrupted,
                        time.monotonic() - started, self._first_new_step)
        _log.warning("smddp: lost %s; going on with %d ranks (this one is now rank %d), %.2f s after the "
                     "failure at sync %d: %s", _said(lost), change.world_size, change.rank, change.seconds,
                     change.step, failure)
        self._tell(change)
        return settled

    def _found_stale(self, ranks: tuple[int, ...], stood_s: float) -> None:
        """On the heartbeat's thread: members stopped beating. End the call this rank waits in
        (the lost rank may never answer it before the group's timeout); sync() then recovers as
        from a death, and the agreement leaves those ranks out."""
        if not set(ranks) & set(self.members):
            return
        reason = (f"{_said(ranks)} stopped beating (its heartbeat stood still for {stood_s:.1f} s, past "
                  f"stale_after={self.stale_after_s:g} s): SurvivingSync declares it lost (it is stopped, hung or "
                  "cut off)")
        _log.warning("smddp: %s", reason)
        try:
            backend = dist.group.WORLD._get_backend(torch.device("cpu"))
        except (RuntimeError, AttributeError, ValueError) as exc:  # between groups: the agreement sees it
            _log.debug("smddp: no group to interrupt for the stale rank: %r", exc)
            return
        interrupt = getattr(backend, "interrupt", None)
        if interrupt is None:  # another backend: its calls end at the group's timeout
            _log.warning("smddp: the %s backend's calls cannot be interrupted; the survivors go on once its "
                         "timeout passes", self._backend)
            return
        interrupt(reason)

    def _agree_on_members(self, old: tuple[int, ...], generation: int) -> tuple[int, ...]:
        store, key = self._base_store, f"{generation}"
        store.set(f"{key}/in/{self.first_rank}", str(self.step))
        decided_key = f"{key}/members"
        deadline = time.monotonic() + max(self._timeout, 4 * self.stale_after_s)
        while True:
            if store.check([decided_key]):
                return _parse(store.get(decided_key))
            checked_in = [r for r in old if store.check([f"{key}/in/{r}"])]
            # a busy rank (a long forward pass) keeps beating, and is waited for
            waiting = [r for r in old if r not in checked_in and not self._heart.stale(r)]
            if not waiting or time.monotonic() > deadline:
                decided = _parse(store.compare_set(decided_key, "", ",".join(map(str, checked_in))))
                return decided
            time.sleep(0.05)

    def _rebuild(self, members: tuple[int, ...], generation: int, admitted: bool) -> None:
        try:
            dist.destroy_process_group()
        except Exception as exc:  # the old group met a dead peer: what it could not close is gone with it
            _log.debug("smddp: the old group's teardown after a loss raised %r", exc)
        store = dist.PrefixStore(f"{generation}/group/", self._base_store)
        dist.init_process_group(self._backend, store=store, rank=members.index(self.first_rank),
                                world_size=len(members), timeout=timedelta(seconds=self._timeout))
        if self._buckets is not None:
            self._buckets.regrouped(admitted)

    def _settle_interrupted_step(self) -> bool:
        """Every survivor's step, gathered: those a step behind take the average a rank ahead
        still holds (True for them); everyone else redoes the sync of the step it is at."""
        rows = [torch.zeros(2, dtype=torch.int64) for _ in range(dist.get_world_size())]
        dist.all_gather(rows, torch.tensor([self.step, self._tickets_seen], dtype=torch.int64))
        steps = [int(row[0]) for row in rows]
        # a rank ahead finished the behind ones' step with the old members' average
        self._first_new_step = max(steps)
        # a rank a step ahead read the ticket count in the average the others missed
        self._tickets_seen = max(int(row[1]) for row in rows)
        behind = min(steps)
        if max(steps) == behind:
            return False
        if max(steps) != behind + 1:  # an average needs every rank, so no rank can be two ahead
            raise RuntimeError(f"SurvivingSync: survivors are at syncs {steps}, more than one apart; "
                               "every rank must call sync() once per step")
        holder = steps.index(behind + 1)
        flat = self._buckets is None or behind in self._buckets.flat_steps
        for average in (self._averages[behind % 2].values() if flat else self._buckets.averages(behind)):
            dist.broadcast(average, src=holder)
        if self.step == behind:
            if flat:
                self._unpack(behind)
            else:
                self._tickets_seen = max(self._tickets_seen, self._buckets.unpack(behind))
            self.step += 1
            return True
        return False


class _Heartbeat:
    """A counter per rank in the store, added to every half second by a thread with its own store
    client, which also reads the members' counters: a member whose counter stood still for
    ``stale_after`` is dead, stopped or cut off, and ``on_stale`` hears of it at once (a death
    is also seen by the calls themselves; a stopped rank only at the group's timeout). The
    thread also reads how many replacements asked to join."""

    def __init__(self, store: dist.PrefixStore, rank: int, stale_after_s: float,
                 on_stale: Callable[[tuple[int, ...], float], None] | None = None) -> None:
        self.store, self.rank, self.stale_after_s, self.on_stale = store, rank, stale_after_s, on_stale
        self._stop = threading.Event()
        self._beating_store = job_store(_own_client(store.underlying_store))
        self._beating_store.add(self._key(rank), 1)
        self.tickets = 0  # replacements that asked to join so far, as last read
        self._lock = threading.Lock()
        self._seen: dict[int, tuple[int, float]] = {}  # member -> (its count, when it last moved)
        self._declared: set[int] = set()  # members on_stale was told of
        self.failure: BaseException | None = None  # what ended the thread, where it ended unasked
        self._all_beating = False  # every watched member's key exists (then one multi_get reads them)
        self._thread = threading.Thread(target=self._beat, name="smddp-heartbeat", daemon=True)
        self._thread.start()
        before_exit.stop_at_exit(self.stop)

    def _key(self, rank: int) -> str:
        return f"beat/{rank}"

    def wait_for_first_beats(self, members: Iterable[int], timeout_s: float) -> None:
        """Until every one of ``members`` has beaten once, that is, made its SurvivingSync."""
        members = tuple(members)
        keys = [self._key(r) for r in members]
        try:
            self.store.wait(keys, timedelta(seconds=timeout_s))
        except dist.DistStoreError as exc:
            missing = [r for r, key in zip(members, keys) if not self.store.check([key])]
            raise RuntimeError(
                f"[smddp rank {self.rank}] SurvivingSync: {_said(tuple(missing))} made no SurvivingSync within "
                f"the group's timeout ({timeout_s:g} s); every rank must make one, at the same point of its "
                f"script") from exc

    def watch(self, members: Iterable[int]) -> None:
        """Read these ranks' counters from now on (this rank's own excepted); a rank watched
        before keeps its count and the time it last moved."""
        now = time.monotonic()
        with self._lock:
            self._seen = {r: self._seen.get(r, (-1, now)) for r in members if r != self.rank}
            self._all_beating = False

    def stale(self, rank: int) -> bool:
        """Whether watched ``rank``'s counter stood still for ``stale_after`` (as of the last look)."""
        with self._lock:
            since = self._seen.get(rank, (-1, time.monotonic()))[1]
        return time.monotonic() - since >= self.stale_after_s

    def _beat(self) -> None:
        next_beat = time.monotonic() + _BEAT_S
        while not self._stop.wait(_LOOK_S):
            try:
                if time.monotonic() >= next_beat:
                    self._beating_store.add(self._key(self.rank), 1)
                    self.tickets = self._beating_store.add("tickets", 0)
                    next_beat = time.monotonic() + _BEAT_S
                self._look()
            except Exception as exc:
                # the store's host is gone (at the job's end, where a rank hosts it) or this
                # rank's client failed: the next sync() raises rather than train on unheard
                self.failure = exc
                _log.debug("smddp: the heartbeat stopped: %r", exc)
                return

    def beating(self) -> bool:
        """The thread runs: not stopped (as a rank declared lost is) and not ended on an error."""
        return not self._stop.is_set() and self.failure is None

    def raise_if_stopped(self) -> None:
        """Raise ``HeartbeatStoppedError`` where the thread ended on an error."""
        if self.failure is not None:
            raise HeartbeatStoppedError(
                f"[smddp rank {self.rank}] SurvivingSync: this rank's heartbeat stopped ({self.failure!r}), so the "
                f"other ranks no longer hear it and declare it lost once stale_after ({self.stale_after_s:g} s) "
                "passes. A lost rank cannot rejoin: end this process (smddp_lite.launch with --max-restarts starts "
                "a replacement). Is the rendezvous store still up, and reachable from this host?") from self.failure

    def _look(self) -> None:
        with self._lock:
            ranks = list(self._seen)
            all_beating = self._all_beating
        if not ranks:
            return
        keys = [self._key(r) for r in ranks]
        if not all_beating:  # multi_get would wait for a key that no beat made yet
            all_beating = self._beating_store.check(keys)
        counts = [int(c) for c in self._beating_store.multi_get(keys)] if all_beating else [
            self._beating_store.add(k, 0) for k in keys]
        now, stale, stood = time.monotonic(), [], 0.0
        with self._lock:
            self._all_beating = all_beating or self._all_beating
            for r, count in zip(ranks, counts):
                if r not in self._seen:  # no longer watched
                    continue
                if count != self._seen[r][0]:
                    self._seen[r] = (count, now)
                elif now - self._seen[r][1] >= self.stale_after_s and r not in self._declared:
                    self._declared.add(r)
                    stale.append(r)
                    stood = max(stood, now - self._seen[r][1])
        if stale and self.on_stale is not None:
            self.on_stale(tuple(stale), stood)

    def stop(self) -> None:
        """End the thread and wait for its last store request (backend/before_exit.py)."""
        self._stop.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=2 * _LOOK_S + 1)


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
