"""Telling peers that a rank refused a call, or called a different one, for transports that
cannot tell them themselves.

A rank that refuses a collective (bad input on that rank alone: a dtype, a device, a size) raises
before it enters the transport, but its peers may already be inside the call. Shared memory has a
flag for that (shm_segment.py). Gloo and MPI have none: a peer would wait for the process group's
timeout, 30 minutes by default. So the refusing rank writes one key, named by the call's index,
into the group's store, and a rank waiting in gloo, MPI or (under the hierarchical transport)
shared memory looks for the key of its own call every ``POLL_S`` and raises with the refusing
rank's message. Keys are written only on refusals, failures and waits that lasted a second (the
mismatch look below), and looked up only by waits that have already lasted ``POLL_S``, so a
collective that completes in time never touches the store.

A peer that leaves a call this way leaves its gloo or MPI operation posted, and gloo and MPI
match operations by order: the refusing rank's next call would pair with it and mix the two
calls' data. So every rank records its outcome of a refused call (refused it too, or left it),
and the refusing rank's next call waits for all of them: if every rank refused, the group goes
on; if any left, the group is failed on the refusing rank too. A rank whose part of the refused
call ended without the refusing rank (a rooted call's) never waited in it: it hears of it in its
next wait (LATEST_REFUSAL_KEY), and records that it left.

The board also finds ranks that called different collectives and wait for each other in them (a
collective that only some ranks call, or a broadcast from different roots): a rank whose wait in a
call has lasted MISMATCH_LOOK_AFTER_S posts the signature (signatures.py) of the step it waits in
once, and compares it with the one a peer waiting in the same step posted first. A rank that finds
a different one announces it, and every waiting rank raises CollectiveMismatchError instead of
waiting for the group's timeout. Calls that complete in time pay nothing; with
SMDDP_CHECK_COLLECTIVES=0, calls that differ but still pair with each other (gloo and MPI match
operations by order) are not found this way.
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta

import torch.distributed as dist

from .. import agreement
from ..errors import CollectiveMismatchError, PeerFailureError, PeerRefusedError, SMDDPError
from ..signatures import MISMATCH_SAID, mismatch_said

log = logging.getLogger("smddp_lite")

POLL_S = 0.05
"""How often a waiting rank looks for a refusal of its call. A look is one store round trip (it
reads NEWS_KEY) unless that count moved since the rank last looked."""
POLL = timedelta(seconds=POLL_S)
SLOW_POLL_AFTER_S = 5.0
SLOW_POLL_S = 1.0
"""A wait that has lasted SLOW_POLL_AFTER_S looks only every SLOW_POLL_S: a refusal comes before
a call starts, so it is nearly always heard early, and hundreds of ranks waiting for one slow
rank would otherwise send thousands of requests a second to the store's host."""

REFUSED, LEFT = "refused", "left"
LATEST_REFUSAL_KEY = "latest"
"""The number of the group's latest refused call: a rank whose part of it ended without the
refusing rank (a broadcast's root under MPI sends small messages without waiting; gloo's tree
broadcast and scatter end early on some ranks) never waited in it, and hears of it in a later
call's wait instead."""
FAILED_IN_CALL, FAILED_KEY = "failed in call", "failed"
"""What a failure's announcement says after the rank's number, and its key: one for the whole
group, since the peers may have left the failed call and be waiting in a later one."""
MISMATCH_KEY = "mismatch"
"""The key of a mismatch's announcement (signatures.mismatch_said's words): one for the whole
group, as a failure's."""
MISMATCH_LOOK_AFTER_S = 1.0
"""How long a wait in a call lasts (from its first look) before it posts and compares the
signature of the step it waits in: one store round trip, once per step of a call that waits that
long (a rank slow to arrive makes its peers wait this long without anything being wrong)."""
_TAKEOVER_TRIES = 4
"""Compare-and-sets one look makes at most: each further one follows a peer that wrote the slot
between two of this rank's, which ranks entering one step do once each."""
SIGNATURE_SLOTS = 64
"""Signatures are posted under the call's number modulo this, replacing an older call's: the
store holds at most this many per group, however long the job runs. A collective completes only
once every rank has entered it, so ranks are hardly ever this many calls apart; one that ran
ahead through calls that end without their peers (a broadcast's root) takes a slot that a
slower rank then cannot compare in, which only leaves that wait to the timeout, as before."""
NEWS_KEY = "news"
"""A count of the refusals, failures and mismatches posted in the group, added to after each one's keys are
written. A waiting rank reads it (``add(NEWS_KEY, 0)``: one round trip, never blocking) and reads
the other keys only when it moved: 512 ranks waiting for a slow one asked the store's host for
two to four keys each every 50 ms, once any call of the group had been refused."""


class RefusalBoard:
    """The keys of one process group's refused calls, failures and mismatched calls, in that
    group's store."""

    def __init__(self, store, rank: int, world_size: int, timeout: timedelta, hears_failures: bool = False) -> None:
        self.rank, self.world_size, self.timeout = rank, world_size, timeout
        # ``store`` is the process group's own part of the store (process_group._own_keys): a
        # group destroyed and made again under the same prefix numbers its calls from 1 again,
        # and gets a part of its own, so an old refusal cannot fail a new call
        self._store = dist.PrefixStore("smddp-refused", store)
        self._looking_at = (0, 0.0, 0.0)  # (call, first look, last look) of the current wait
        self._news_seen = 0  # NEWS_KEY's count when this rank last found nothing new for it
        self._settled = 0  # the latest refused call this rank refused too or recorded that it left
        self._step: tuple[int, int, list[int]] | None = None  # (call, step, signature) being waited in
        self._step_compared = True  # whether that step's signature was compared already
        self.hears_failures = hears_failures
        """Whether waits also look for a failure announced in any call (announce_failure): one
        more store round trip whenever NEWS_KEY moved, so only transports whose failures some
        ranks cannot see turn it on: MPI (an error can stay on one rank), gloo and the
        hierarchical transport (a rank on another host sees a dead peer's host only by address)."""

    # the refusing rank ----------------------------------------------------------------------------
    def post(self, call: int, reason: str, learn_outcome: bool = True) -> str | None:
        """This rank refused call ``call`` because of ``reason`` (its error text). Returns None
        once every rank has refused it too (the group goes on), or why the group cannot go on:
        ranks that were inside the call and left it hold operations that this rank's next call
        would pair with. ``learn_outcome=False``: returns None at once (a group already failed
        on this rank need not learn it; waiting for a dead peer's outcome held the communication
        thread for the group's timeout, and destroy_process_group for 5 s)."""
        key = str(call)
        self._store.set(key, f"rank {self.rank} refused this call: {reason}")
        agreement.publish(self._store, key, self.rank, REFUSED)  # every rank's outcome, learnt below
        self._store.set(LATEST_REFUSAL_KEY, key)
        self._store.add(NEWS_KEY, 1)  # after the keys it announces (heard() reads them in that order)
        self._settled = max(self._settled, call)
        if not learn_outcome:
            return None
        try:
            outcomes = agreement.learn(self._store, key, self.world_size, self.timeout)
        except (RuntimeError, OSError) as exc:  # DistStoreError: the timeout, or the store's host died
            return f"this rank refused call #{call}, and could not learn whether its peers entered it ({exc})"
        left = [r for r, outcome in enumerate(outcomes) if outcome == LEFT]
        if not left:
            return None
        return (f"this rank refused call #{call} while rank(s) {', '.join(map(str, left))} were inside it; they "
                "left it with an error, but their operations stay posted and would pair with this rank's next "
                "call, so the ranks' calls no longer line up. This process group can no longer be used; fix the "
                "input and restart the job (or destroy and re-create the group).")

    # a failing rank -------------------------------------------------------------------------------
    def announce_failure(self, call: int, reason: str) -> None:
        """This rank's part of call ``call`` failed with ``reason`` (its error text) in a way its
        peers may not see: an MPI error raised on one rank only leaves the others waiting for the
        group's timeout, in that call or, where their part of it could end without this rank, in
        a later one (and, under mpiexec, leaves this rank waiting for them in MPI_Finalize). Peers
        waiting in any call of the group hear it as they hear a refusal. Does not wait. Where the
        store cannot be reached, the peers wait as before, and the log says so: this rank is
        raising its own error anyway, which a store error must not replace."""
        try:
            self._store.set(FAILED_KEY, f"rank {self.rank} {FAILED_IN_CALL} #{call}: {reason}")
            self._store.add(NEWS_KEY, 1)
        except (RuntimeError, OSError) as exc:
            log.warning("smddp: rank %d could not tell its peers that call #%d failed (%s); they will wait "
                        "for the process group's timeout", self.rank, call, exc)

    # a rank entering a call ---------------------------------------------------------------------
    def entering(self, call: int, signature: list[int]) -> None:
        """This rank is about to run a step of call ``call`` (a call runs one per dtype of its
        tensors) whose signature is ``signature``; a wait in it that lasts compares it."""
        step = self._step[1] + 1 if self._step is not None and self._step[0] == call else 0
        self._step, self._step_compared = (call, step, signature), False

    # a waiting rank -------------------------------------------------------------------------------
    def mismatch_in(self, call: int) -> str | None:
        """Post the signature of the step of call ``call`` this rank waits in, once, and compare it
        with the one posted first by a peer waiting in the same step; returns what differs (and
        announces it to the group), or None. A store error leaves the step to compare at the next
        look."""
        if self._step is None or self._step[0] != call or self._step_compared:
            return None
        said = self._compare(*self._step)
        self._step_compared = True
        return said

    def _compare(self, call: int, step: int, mine: list[int]) -> str | None:
        # Not agreement.exchange_in_store: only ranks whose wait lasts post, so a rank compares
        # with the first peer that posted (one compare_set), never waits for every rank's value.
        # A slot holding an older call's entry is taken over (compare_set on the entry found), so
        # two ranks that find it stale still meet in one entry
        key = f"signature/{call % SIGNATURE_SLOTS}"
        written = ",".join(map(str, mine))
        posted = f"{call} {step} {written} {self.rank}"
        expected = ""
        for _ in range(_TAKEOVER_TRIES):
            found = self._store.compare_set(key, expected, posted).decode()
            if found == posted:
                return None  # the first to wait this long in this step: later ones compare with it
            their_call, their_step, theirs, their_rank = found.split(" ")
            if (int(their_call), int(their_step)) > (call, step):
                return None  # a peer is past this step: it finished it, so it is no mismatch
            if (int(their_call), int(their_step)) == (call, step):
                if agreement.agreed([theirs, written]):
                    return None
                peer, their_signature = int(their_rank), [int(v) for v in theirs.split(",")]
                return self._post_mismatch(mismatch_said([(peer, call, their_signature), (self.rank, call, mine)],
                                                         waiting=True))
            expected = found
        return None

    def _post_mismatch(self, said: str) -> str:
        """Put ``said`` on the board unless a mismatch is there already, and return the one there:
        the first announcement stays, so that every rank names the same pair of calls (several
        pairs may differ when several ranks do). Store errors propagate."""
        said = self._store.compare_set(MISMATCH_KEY, "", said).decode(errors="replace")
        self._store.add(NEWS_KEY, 1)  # after the key it announces
        return said

    def announce_mismatch(self, said: str) -> None:
        """Tell the group what ranks that called different collectives called (mismatch_said's
        words), found where the ranks met without the board: shared memory's headers, under the
        hierarchical transport, whose ranks on other hosts wait between hosts for the ones that
        found it, or see their connections close. Does not wait; where the store cannot be
        reached, those ranks learn as before, and this rank raises its own error anyway."""
        try:
            self._post_mismatch(said)
        except (RuntimeError, OSError) as exc:
            log.warning("smddp: rank %d could not tell its peers on other hosts that ranks called different "
                        "collectives (%s); they will learn it later, or at the process group's timeout", self.rank, exc)

    def heard(self, call: int) -> str | None:
        """What a refusing rank said of call ``call``, recording that this rank leaves the call,
        (``hears_failures``) what a failing rank said of its failure in any call, or which ranks
        called different collectives (found by this rank once its wait has lasted
        MISMATCH_LOOK_AFTER_S, or announced by any ranks of the group); None if none happened, if
        the current wait looked too recently, or if the store cannot be reached (its host died:
        the transport reports that peer's failure itself, naming it, which a store error would
        not)."""
        now = time.monotonic()
        looked_call, first, last = self._looking_at
        if looked_call != call:
            first = last = now
        elif now - first > SLOW_POLL_AFTER_S and now - last < SLOW_POLL_S:
            return None
        self._looking_at = (call, first, now)
        try:
            if now - first >= MISMATCH_LOOK_AFTER_S:
                clash = self.mismatch_in(call)
                if clash is not None:
                    return clash
            return self._read_news(call)
        except (RuntimeError, OSError):  # DistStoreError and socket errors
            return None

    def news(self, call: int) -> str | None:
        """What the group's board says to a rank whose part of call ``call`` just failed (a peer's
        connection closed), looked up at once: a refusal, failure or mismatch that a peer posted
        before it left, or None (nothing posted, or the store cannot be reached)."""
        try:
            return self._read_news(call)
        except (RuntimeError, OSError):
            return None

    def _read_news(self, call: int) -> str | None:
        news = self._store.add(NEWS_KEY, 0)
        if news == self._news_seen:
            return None
        # read after the count: every refusal, failure or mismatch it counts has written its keys
        said = self._news_for(call)
        if said is None:
            self._news_seen = news
        return said

    def _news_for(self, call: int) -> str | None:
        """What the group's refusal, failure and mismatch keys say to a rank waiting in call ``call``."""
        if self._store.check([MISMATCH_KEY]):  # announced by ranks in a call this rank may not be in
            return self._store.get(MISMATCH_KEY).decode(errors="replace")
        said = self._refusal_for(call) if self._store.check([LATEST_REFUSAL_KEY]) else None
        if said is None and self.hears_failures and self._store.check([FAILED_KEY]):
            return self._store.get(FAILED_KEY).decode(errors="replace")
        return said

    def _refusal_for(self, call: int) -> str | None:
        latest = int(self._store.get(LATEST_REFUSAL_KEY).decode())
        key = str(call)
        # this call refused (a peer that refused it too may since have refused a later one)
        if latest >= call and self._store.check([key]):
            said = self._store.get(key).decode(errors="replace")
            agreement.publish(self._store, key, self.rank, LEFT)
            return said
        if latest < call and latest > self._settled:
            # an earlier call refused by a peer, which this rank neither refused nor left: its part
            # ended without that rank, whose next call would pair with it
            self._settled = latest
            if agreement.absent(self._store, str(latest), [self.rank]):
                said = self._store.get(str(latest)).decode(errors="replace")
                agreement.publish(self._store, str(latest), self.rank, LEFT)
                return said.replace("refused this call", f"refused call #{latest}, which this rank's part "
                                    "ended without it", 1)
        return None

    def raise_if_told(self, call: int, prefix: str) -> None:
        """Raise on this waiting rank (its text after ``prefix``, errors.where's) if a peer
        refused call ``call`` (PeerRefusedError), announced that it failed in it
        (PeerFailureError), or called a different collective (CollectiveMismatchError)."""
        said = self.heard(call)
        if said is not None:
            raise explained(said, prefix)


def explained(said: str, prefix: str) -> SMDDPError:
    """The error a rank raises for what its group's board said (RefusalBoard.heard), after
    ``prefix`` (errors.where's), with what to do about it."""
    if said.startswith(MISMATCH_SAID):
        return CollectiveMismatchError(  # ``said`` says what differs and where to look (mismatch_said)
            f"{prefix} {said} Ranks may be left inside these calls, so this process group can no longer be used; "
            "fix the calls and restart the job (or destroy and re-create the group)."
        )
    if FAILED_IN_CALL in said:
        return PeerFailureError(
            f"{prefix} {said}. The call cannot complete without that rank, so this process group can "
            "no longer be used; that rank's error says why it failed. Restart the job once it is fixed."
        )
    return PeerRefusedError(
        f"{prefix} {said}. The call cannot complete without that rank, and this "
        "rank is left inside it, so this process group can no longer be used; fix the input on that "
        "rank and restart the job (or destroy and re-create the group)."
    )
