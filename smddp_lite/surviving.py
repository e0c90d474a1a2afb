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
buffer of their own, and ``param.grad`` is written only once the average has arrived and the
step has committed (one more small call, ``_commit``, which completes only once every member's
average arrived). A rank lost between its average and the commit never applies the step. A rank
whose commit returned may already be computing the next step when another rank's commit failed;
it cannot be further ahead. So after a loss the survivors compare steps: those a step ahead
still hold the average the others missed (the last two averages are kept), send it to them, and
everyone goes on from the next step's sync together.

Who is in the job: smddp_lite/membership/. Every change of members (a loss, an admission) is a
generation whose members one compare-and-set in the store decides (``generations.py``); every
rank adopts it, enters it through a barrier that ends on a stale heartbeat, makes the default
group again under the generation's prefix (every transport is rebuilt by the group's own
rendezvous), and settles (``_settle``): the interrupted step, and the job's state for the
replacements. Each rank's heartbeat (``heartbeat.py``) is a counter beaten by a process of its
own; a member whose counter stood still for ``stale_after`` is declared lost at once, whatever
the group's timeout (``ProcessGroupSMDDP.interrupt``). A rank that checks in after the others
decided (it was stopped, or its network came back) finds itself missing and raises
``RankDeclaredLostError``, never joining silently.

Each training path plugs in its own reducer, and this module only orchestrates: a plain
module's gradients are averaged flat in ``sync()`` (surviving_flat.py); a DistributedDataParallel
model keeps its buckets, reduced during backward by a comm hook (surviving_ddp.py); a
``smddp_lite.compile`` model keeps its buckets and fused step, its reducer regrouped after a
loss (surviving_compiled.py). ``sync()`` settles a step the same way on every path.

Growing back: a replacement process (the same script, started by the user's launcher) makes its
``SurvivingSync`` before any process group exists (or in the group of one that
``smddp_lite.init()`` makes in a replacement ``smddp_lite.launch`` started); finding the job running in the store, it
starts its heartbeat, takes a ticket and waits. The heartbeat threads read the ticket count,
rank 0 adds it to the gradient average (one element more, at no cost of a call), so every member
learns of the newcomer in the same step; at the start of the next ``sync()`` rank 0 writes the
next generation with the newcomers whose heartbeats move, and the healer (the first member of
the furthest step) sends each newcomer the job's state, peer to peer (surviving_state.py). The
newcomer then trains that step with the others.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Iterable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from .backend import before_exit
from .backend.errors import CollectiveMismatchError, SMDDPError
from .launch import init, standing_by
from .membership.errors import (  # HeartbeatStoppedError: raised here through the heartbeat, caught by users
    HeartbeatStoppedError,  # noqa: F401
    JobFinishedError,
    RankDeclaredLostError,
    TooFewRanksError,
)
from .membership.heartbeat import LOOK_S, Heartbeat, said
from .membership import generations
from .membership.job_store import (
    RUNNING,
    JobStore,
    finished,
    job_store,
    mark_finished,
    root_store,
    running_job_store,
)
from . import surviving_state
from .sampling import ElasticSampler
from .surviving_compiled import CompiledSteps
from .surviving_flat import FlatAverages
from .surviving_ddp import DDPBuckets, refuse_wrappers_that_cannot_survive

_log = logging.getLogger("smddp_lite")

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
    # the job's state this rank received, in bytes, and the seconds it took: a replacement's
    # (parameters, buffers, optimizer state); 0 for a member, which holds it already
    state_bytes: int = 0
    state_seconds: float = 0.0


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
            (make the group with ``smddp_lite.init()`` first; docs/surviving.md), and so does a
            ``smddp_lite.compile`` model (give its optimizer too). FSDP models, sharded
            optimizer state and 8-bit wires are refused.
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
        self._tickets_considered = 0  # admitted or refused, as the last generation's record says
        self._tickets_seen = 0  # as the group learnt it from rank 0, in the last average
        self._holds_state = True  # False in a replacement until a member sent it the job's state
        self._commit_flag = torch.zeros(1, dtype=torch.int32, device=self.params[0].device)
        self._buckets: DDPBuckets | CompiledSteps | None = None
        compiled = _is_compiled(model)
        if isinstance(model, DistributedDataParallel):
            self._buckets = DDPBuckets(model, tickets=lambda: self._heart.tickets, step=lambda: self.step)
        elif compiled:
            self._buckets = CompiledSteps(model, tickets=lambda: self._heart.tickets)
        if self._buckets is not None:  # their backward reduces: replacements come in before the forward
            model.register_forward_pre_hook(self._before_forward)
        # the plain module's path, and DDP's for the step a replacement joins (a compiled step
        # never takes it: its buckets are its own)
        self._flat = FlatAverages(self.params) if not compiled else None
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
        self._heart = Heartbeat(self._base_store, self.first_rank, self.stale_after_s, self._found_stale,
                                self._interrupt)
        # each member is watched from its first beat: a rank still building its model or loading
        # its data when the others start watching (seconds apart on a loaded machine) is late, not lost
        self._heart.wait_for_first_beats(self.members, self._timeout)
        self._heart.watch(self.members)
        self._first_world = dist.get_world_size()
        self._base_store.set("first_world", str(self._first_world))
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
            self._settle_bucketed_step()
        else:
            self._sync_flat()
        if self._buckets is not None:  # a survivor a step ahead may still send the one before
            self._buckets.flat_steps.intersection_update({self.step - 1, self.step - 2})

    def _admission_due(self) -> bool:
        return self._tickets_seen > self._tickets_considered

    def _sync_flat(self) -> None:
        while True:
            try:
                # (DDP's are admitted before the forward: _before_forward)
                if self._admission_due() and self._buckets is None and self._change(in_sync=True):
                    return  # (a generation that settled this step: it cannot, for a rank that admits)
                tickets = self._flat.average(self.step, self._heart.tickets)
                if self._buckets is not None:  # rank 0's module buffers, which DDP would have broadcast
                    self._buckets.send_buffers(self.step)
                self._tickets_seen = max(self._tickets_seen, tickets)
                self._commit()
            except CollectiveMismatchError:
                raise  # every rank is alive and called something else: a bug to fix, not a loss
            except dist.DistError as failure:
                if self._change(failure, in_sync=True):
                    return  # the average of this step came from a survivor a step ahead
                continue  # redo this step's sync in the new group
            self._flat.unpack(self.step)
            self.step += 1
            return

    def _settle_bucketed_step(self) -> None:
        """DDP's hooks (or the compiled model's reducer) averaged the buckets during backward;
        after a failed call, agree on who is left and average the kept buckets again, or take a
        survivor's that is a step ahead."""
        buckets = self._buckets
        failure = buckets.finish()
        if failure is None:
            failure = self._commit_or_failure()
        while failure is not None:
            if isinstance(failure, CollectiveMismatchError):
                raise failure  # every rank is alive and called something else: a bug to fix, not a loss
            if self._change(failure, in_sync=True):  # (which raises what ends this rank's part in the job)
                return  # the average of this step came from a survivor a step ahead
            if self.step in buckets.flat_steps:  # replacements came in: they average this step flat
                buckets.restore_local_gradients()
                self._sync_flat()
                return
            try:
                buckets.reduce_again(self.step)
                self._commit()
            except CollectiveMismatchError:
                raise
            except dist.DistError as again:  # another rank lost during the redo
                failure = again
                continue
            break
        self._tickets_seen = max(self._tickets_seen, buckets.arrived(self.step))
        self.step += 1

    def _before_forward(self, _module: torch.nn.Module, _inputs: object) -> None:
        """With DDP, replacements are admitted before the forward of the step they train, since
        its backward reduces the buckets. That step is averaged flat (``_settle``): a new DDP's
        first bucket layout differs from the others', and every rank rebuilds its layout at the
        next forward."""
        if self._admission_due():
            self._change()

    def _commit(self) -> None:
        """The step's commit: a call each member makes only once its average arrived. A rank
        applies a step only after it, so a rank that received the average and was then lost
        (stopped, cut off) before every member had it never applies a step the others redo
        without it; a member whose commit returned is a step ahead, and the others, whose
        averages had all arrived, take the step from it after a loss (``_settle``)."""
        carried = self._buckets.commit_tensor(self.step) if self._buckets is not None else None
        dist.all_reduce(carried if carried is not None else self._commit_flag)
        # over shared memory the call can complete on what the others posted before they left
        # (they were interrupted waiting for this rank): ask the group whether anyone left
        check = getattr(_backend_of(self._commit_flag.device), "raise_if_a_peer_left", None)
        if check is not None:
            check()

    def _commit_or_failure(self) -> BaseException | None:
        try:
            self._commit()
        except CollectiveMismatchError:
            raise
        except dist.DistError as failure:
            return failure
        return None

    # one step -----------------------------------------------------------------------------------
    # growing back -------------------------------------------------------------------------------
    def _join(self, store: JobStore, timeout: timedelta | None) -> None:
        """This process is a replacement: take a ticket, wait to be admitted (the ticket counts
        only while this process's heartbeat moves), then enter the generation that admitted it
        and take the job's state from a member."""
        started = time.monotonic()
        self._base_store = store
        self._refuse_a_finished_job(store)
        self._first_world = int(store.get("first_world"))
        self.first_rank = self._first_world + store.add("ids", 1) - 1
        self._holds_state = False
        self._received_state = (0, 0.0)
        backend, timeout_s = store.get("how").decode().split(",")
        self._backend, self._timeout = backend, float(timeout_s)
        # (its thread beats until the process does: a replacement only waits, with the GIL free,
        # and its ticket should not wait for a second import of torch)
        self._heart = Heartbeat(store, self.first_rank, self.stale_after_s, self._found_stale, self._interrupt,
                                wait_for_process=False)
        # the ticket is taken once this process beats: from then on a ticket's heartbeat moves
        # unless its process died, which the members see before admitting it
        ticket = store.add("tickets", 1)
        store.set(f"ticket/{ticket}", str(self.first_rank))
        key = f"admit/{self.first_rank}"
        wait = (timeout or timedelta(seconds=max(self._timeout, 60))).total_seconds()
        deadline = time.monotonic() + wait
        looked = time.monotonic()
        while not store.check([key]):
            self._heart.raise_if_stopped()
            if time.monotonic() - looked > LOOK_S:  # the job may end while this one waits
                looked = time.monotonic()
                self._refuse_a_finished_job(store)
            if time.monotonic() > deadline:
                self._heart.stop()
                raise SMDDPError(
                    f"SurvivingSync: this replacement (id {self.first_rank}) was not admitted within {wait:.0f} s. "
                    "The job's ranks admit a replacement at their next sync(); is the job still training?")
            time.sleep(0.02)
        said_ = store.get(key).decode()
        if said_.startswith("refused"):
            self._heart.stop()
            raise SMDDPError(
                f"SurvivingSync: the job's rank 0 refused this replacement (id {self.first_rank}): {said_[8:]}. "
                "Start it again; a replacement must keep its heartbeat (made with SurvivingSync) beating while "
                "it waits.")
        generation, record = said_.split("/", 1)
        members, tickets = generations.parse(record)
        self.generation, self.members = int(generation) - 1, ()
        before_exit.stop_at_exit(self._finish_at_exit)
        self._change(adopted=(members, tickets), started=started)

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

    def _propose_admission(self, generation: int) -> None:
        """Rank 0, at the sync where every member learnt of new tickets: write the next
        generation's members with the replacements whose heartbeats move; the others are refused."""
        ids = []
        for t in range(self._tickets_considered + 1, self._tickets_seen + 1):
            try:  # written just after the ticket: missing only where the replacement died in between
                self._base_store.wait([f"ticket/{t}"], timedelta(seconds=self.stale_after_s))
            except dist.DistStoreError:
                continue
            ids.append(int(self._base_store.get(f"ticket/{t}")))
        alive = generations.lease(self._base_store, self._heart, ids, wait_s=2 * self.stale_after_s + 1)
        held = generations.propose(self._base_store, generation, self.members + tuple(alive), self._tickets_seen)
        if held[1] != self._tickets_seen:
            return  # a loss took this generation first: the tickets wait for the next sync
        for i in ids:
            if i not in alive:
                self._base_store.set(f"admit/{i}", f"refused: its heartbeat did not move for {self.stale_after_s:g} "
                                                   "s after it took its ticket")
                _log.warning("smddp: refused replacement %d: its heartbeat stood still (it died after taking its "
                             "ticket)", i)

    def _announce(self, generation: int, members: tuple[int, ...]) -> None:
        """Tell the replacements among ``members`` that this generation admits them (every member
        writes it, so that the admission holds even where rank 0 dies right after deciding it)."""
        said_ = f"{generation}/{generations.record(members, self._tickets_considered)}"
        for i in members:
            if i >= self._first_world and i not in self.members:
                self._base_store.set(f"admit/{i}", said_)

    def _tell(self, change: Change) -> None:
        if self.sampler is not None:
            self.sampler.changed(change)
        if self.on_change is not None:
            self.on_change(change)

    # every change of members --------------------------------------------------------------------
    def _change(self, failure: BaseException | None = None, adopted: tuple[tuple[int, ...], int] | None = None,
                started: float | None = None, in_sync: bool = False) -> bool:
        """Go to the next generation: after ``failure`` (a loss), to admit replacements (no
        failure, at the start of a sync where tickets are due), or, in a replacement, into the
        generation that admitted it (``adopted``). Agree on its members, enter it, make the group,
        settle the interrupted step and send the replacements the job's state; again if a member
        is lost meanwhile. True when this rank's step was settled by a survivor's average (the
        caller returns), False when the step's sync is to be redone in the new group."""
        if isinstance(failure, (RankDeclaredLostError, TooFewRanksError)):
            raise failure
        self._heart.raise_if_stopped()  # the others no longer hear this rank: it may not check in
        started = started if started is not None else time.monotonic()
        before, interrupted, record = self.members, self.step, adopted
        admitting = failure is None and adopted is None
        while True:
            generation = self.generation + 1
            if record is None:
                if admitting and dist.get_rank() == 0:
                    self._propose_admission(generation)
                deadline = max(self._timeout, 4 * self.stale_after_s)
                record = generations.agree(self._base_store, self._heart, self.first_rank, self.members, generation,
                                           self.step, self._tickets_considered, deadline)
            members, tickets = record
            record, admitting = None, False
            self._check_membership(members, generation, failure, before)
            self._tickets_considered = tickets
            self._announce(generation, members)
            self.members, self.generation = members, generation
            self._heart.watch(members)
            try:
                generations.barrier(self._base_store, self._heart, self.first_rank, generation, members,
                                    self._timeout)
                self._rebuild(members, generation)
                settled, newcomers = self._settle()
            except CollectiveMismatchError:
                raise
            except dist.DistError as again:  # another rank lost while the group was made
                failure = again
                continue
            break
        if self._buckets is not None:
            # replacements build their first bucket layout at their next forward; every rank must
            # rebuild its own at the same forward (the one after the step they join), which DDP
            # arranges for a rank that has not run that step's backward yet. A rank that redoes
            # the step inside sync() ran it after the admission's generation had arranged it.
            self._buckets.regrouped(admitted=bool(newcomers) and (settled or not in_sync))
        lost = tuple(r for r in before if r not in members)
        # (a replacement knew no members before: it and those admitted with it joined)
        joined = tuple(members[r] for r in newcomers) if not before else tuple(r for r in members if r not in before)
        state_bytes, state_seconds = self._received_state if not before else (0, 0.0)
        change = Change(generation, lost, joined, members, dist.get_rank(), dist.get_world_size(),
                        interrupted if before else self.step, time.monotonic() - started, self._first_new_step,
                        state_bytes, state_seconds)
        if not before:
            _log.warning("smddp: joined as rank %d of %d at sync %d, %.2f s after starting; received the job's "
                         "state (%.3f GB) in %.2f s (%.2f GB/s)", change.rank, change.world_size, self.step,
                         change.seconds, state_bytes / 1e9, state_seconds, state_bytes / 1e9 / max(state_seconds, 1e-9))
        else:
            what = "; ".join(f"{w} {said(r)}" for w, r in (("lost", lost), ("admitted", joined)) if r)
            _log.warning("smddp: %s; %d ranks now (this one is rank %d), %.2f s after %s at sync %d%s",
                         what or "the group made again with the same members (no replacement admitted)",
                         change.world_size, change.rank, change.seconds,
                         "the failure" if failure is not None else "the admission began", interrupted,
                         f": {failure}" if failure is not None else "")
        self._tell(change)
        return settled

    def _check_membership(self, members: tuple[int, ...], generation: int, failure: BaseException | None,
                          before: tuple[int, ...]) -> None:
        if self.first_rank not in members:
            self._heart.stop()
            raise RankDeclaredLostError(
                f"[smddp rank {self.first_rank}] SurvivingSync: the other ranks declared this rank lost and "
                f"went on as generation {generation} without it (members {list(members)}): it did not check "
                f"in after the failure ({failure}). A lost rank cannot rejoin: end this process.")
        if len(members) < self.min_world_size:
            self._heart.stop()
            lost = tuple(r for r in before if r not in members)
            raise TooFewRanksError(
                f"[smddp rank {self.first_rank}] SurvivingSync: {len(members)} ranks are left after losing "
                f"{said(lost)}, fewer than min_world_size={self.min_world_size}; the job stops here. "
                f"Restart it from a checkpoint, or lower min_world_size to train on with fewer ranks.")

    def _found_stale(self, ranks: tuple[int, ...], stood_s: float) -> None:
        """On the heartbeat's thread: members stopped beating. End the call this rank waits in
        (the lost rank may never answer it before the group's timeout); sync() then recovers as
        from a death, and the agreement leaves those ranks out."""
        if not set(ranks) & set(self.members):
            return
        reason = (f"{said(ranks)} stopped beating (its heartbeat stood still for {stood_s:.1f} s, past "
                  f"stale_after={self.stale_after_s:g} s): SurvivingSync declares it lost (it is stopped, hung or "
                  "cut off)")
        _log.warning("smddp: %s", reason)
        self._interrupt(reason)

    def _interrupt(self, reason: str) -> None:
        """End the call this rank waits in, saying ``reason`` (on the heartbeat's thread: a member
        stopped beating, or this rank's own heartbeat did, which the recovery then raises)."""
        try:
            backend = dist.group.WORLD._get_backend(torch.device("cpu"))
        except (RuntimeError, AttributeError, ValueError) as exc:  # between groups: the agreement sees it
            _log.debug("smddp: no group to interrupt: %r", exc)
            return
        interrupt = getattr(backend, "interrupt", None)
        if interrupt is None:  # another backend: its calls end at the group's timeout
            _log.warning("smddp: the %s backend's calls cannot be interrupted; the survivors go on once its "
                         "timeout passes", self._backend)
            return
        interrupt(reason)

    def _rebuild(self, members: tuple[int, ...], generation: int) -> None:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception as exc:  # the old group met a dead peer: what it could not close is gone with it
                _log.debug("smddp: the old group's teardown raised %r", exc)
        store = dist.PrefixStore(f"{generation}/group/", self._base_store)
        dist.init_process_group(self._backend, store=store, rank=members.index(self.first_rank),
                                world_size=len(members), timeout=timedelta(seconds=self._timeout))

    def _settle(self) -> tuple[bool, list[int]]:
        """In a new group: every member's step, gathered. Those a step behind take the average a
        member ahead still holds (True for them: their sync is done); the replacements take the
        job's state from that member; everyone else redoes the sync of the step it is at. Returns
        that, and the replacements' ranks."""
        rows = [torch.zeros(3, dtype=torch.int64) for _ in range(dist.get_world_size())]
        dist.all_gather(rows, torch.tensor([self.step, self._tickets_seen, self._holds_state], dtype=torch.int64))
        holders = [r for r, row in enumerate(rows) if row[2]]
        newcomers = [r for r, row in enumerate(rows) if not row[2]]
        if not holders:
            raise RuntimeError("SurvivingSync: no member of the new group holds the job's state")
        steps = {r: int(rows[r][0]) for r in holders}
        ahead, behind = max(steps.values()), min(steps.values())
        if ahead > behind + 1:  # an average needs every rank, so no rank can be two ahead
            raise RuntimeError(f"SurvivingSync: survivors are at syncs {sorted(steps.values())}, more than one "
                               "apart; every rank must call sync() once per step")
        # a rank ahead finished the behind ones' step with the old members' average, and read
        # the ticket count in it
        self._first_new_step = ahead
        self._tickets_seen = max(self._tickets_seen, max(int(row[1]) for row in rows))
        healer = min(r for r in holders if steps[r] == ahead)
        me = dist.get_rank()
        settled = False
        if ahead != behind:
            flat = self._buckets is None or behind in self._buckets.flat_steps
            averages = self._flat.averages(behind) if flat else self._buckets.averages(behind)
            if me == healer:
                for r in holders:
                    if steps[r] == behind:
                        for average in averages:
                            dist.send(average, r)
            elif me in holders and steps[me] == behind:
                for average in averages:
                    dist.recv(average, healer)
                reducer = self._flat if flat else self._buckets
                self._tickets_seen = max(self._tickets_seen, reducer.unpack(behind))
                self.step += 1
                settled = True
        if newcomers:
            model = self.params + self.buffers
            if me == healer:
                surviving_state.send(newcomers, model, self.optimizer, self._state_extras())
            elif me in newcomers:
                began = time.monotonic()
                received = surviving_state.receive(healer, model, self.optimizer)
                self._received_state = (received.bytes, time.monotonic() - began)
                self._take_state(received.extras)
            if self._buckets is not None:
                self._buckets.newcomers_at(ahead)
        return settled, newcomers

    def _state_extras(self) -> dict:
        return {"step": self._first_new_step, "tickets": self._tickets_seen,
                "sampler": self.sampler.state_dict() if self.sampler is not None else None,
                "layout": self._buckets.layout() if self._buckets is not None else None}

    def _take_state(self, extras: dict) -> None:
        mine = self._buckets.layout() if self._buckets is not None else None
        if extras.get("layout") != mine:  # its collectives would not meet the members': a mismatch ends every rank
            self._heart.stop()
            raise ValueError(
                f"SurvivingSync: this replacement (id {self.first_rank}) reduces its gradients in other buckets "
                f"than the job's ranks: theirs {_said_layout(extras.get('layout'))}, this one's "
                f"{_said_layout(mine)}. Make its model as theirs (the same smddp_lite.compile options: "
                "bucket_cap_mb, first_bucket_mb, wire_dtype, and the SMDDP_* variables that set them); it "
                "ends here, and the others go on without it.")
        self.step = extras["step"]
        self._tickets_seen = max(self._tickets_seen, extras["tickets"])
        self._holds_state = True
        if self.sampler is not None and extras["sampler"] is not None:
            self.sampler.load_state_dict(extras["sampler"])
            self.sampler.me = self.first_rank


def _said_layout(layout: list | None) -> str:
    if layout is None:
        return "none (not a compiled model)"
    return f"{len(layout)} buckets: " + ", ".join(f"{n} {dtype} on a {wire} wire" for n, dtype, wire in layout[:6]) + (
        ", ..." if len(layout) > 6 else "")


def _is_compiled(model: object) -> bool:
    """A ``smddp_lite.compile`` model (looked up, not imported: the compiler's import is a
    replacement's time, and a model of it cannot exist before it is imported)."""
    compiled = sys.modules.get("smddp_lite.compiler.model")
    return compiled is not None and isinstance(model, compiled.CompiledModel)


def _backend_of(device: torch.device) -> object | None:
    try:
        return dist.group.WORLD._get_backend(device)
    except (RuntimeError, AttributeError, ValueError):  # no group, or none for this device
        return None


def _group_timeout(group: dist.ProcessGroup) -> float:
    timeout = getattr(group._get_backend(torch.device("cpu")), "timeout", None)
    if timeout is None:
        timeout = dist.distributed_c10d._get_pg_default_timeout(group) if hasattr(
            dist.distributed_c10d, "_get_pg_default_timeout") else timedelta(minutes=30)
    return timeout.total_seconds()
