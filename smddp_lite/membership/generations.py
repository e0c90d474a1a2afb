"""One compare-and-set per generation: who trains in it, whether a loss or an admission made it.

Every change of members is a generation, and each generation's members are written once, by a
compare-and-set on ``<generation>/members``, whoever writes first: a survivor that decides a loss,
or rank 0 admitting replacements. Every rank adopts what is written, whatever it proposed, so a
loss and an admission that meet at one generation can never make two groups.

- **A loss**: each survivor checks in (``<generation>/in/<id>``); a survivor decides once every
  member of the last generation has checked in or stood still for ``stale_after``. A member that
  still beats but has not checked in (busy, or cut off from the others but not from the store)
  is waited for until the deadline, where only a majority of the last generation may decide
  (half, where it holds the lowest id): the smaller side of a partition never declares the
  larger one lost.
- **An admission**: rank 0 writes the members with the replacements whose heartbeats move (their
  tickets are leased by their own heartbeats: a replacement that died after taking its ticket is
  refused, never admitted), and only then checks in, so no other member decides without it.
- **Entering** a generation is a barrier in the store that ends on a member's stale heartbeat
  (``MembersMissing``): the group's own rendezvous would wait for a dead member until its timeout.

The record is ``<members>;<tickets>``: the ids in rank order and the tickets considered so far.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch.distributed as dist

from .heartbeat import LOOK_S, Heartbeat, said

_POLL_S = 0.02


class MembersMissing(dist.DistError):
    """Members of a generation did not arrive at its barrier and stopped beating: the
    generation cannot start, and the survivors agree on the next one without them."""


def record(members: Iterable[int], tickets: int) -> str:
    return f"{','.join(map(str, members))};{tickets}"


def parse(text: bytes | str) -> tuple[tuple[int, ...], int]:
    """(members, tickets considered) of a record."""
    text = text.decode() if isinstance(text, bytes) else text
    members, tickets = text.split(";")
    return tuple(int(r) for r in members.split(",") if r), int(tickets)


def may_decide(old: tuple[int, ...], present: Iterable[int]) -> bool:
    """Whether ``present`` may decide the next generation without the rest of ``old`` while the
    rest still beat: more than half of ``old``, or half with its lowest id."""
    present = set(present) & set(old)
    return 2 * len(present) > len(old) or (2 * len(present) == len(old) and min(old) in present)


def propose(store: dist.Store, generation: int, members: Iterable[int], tickets: int) -> tuple[tuple[int, ...], int]:
    """Write this generation's record unless one is written; returns the record that holds."""
    key = f"{generation}/members"
    return parse(store.compare_set(key, "", record(members, tickets)))


def decided(store: dist.Store, generation: int) -> tuple[tuple[int, ...], int] | None:
    key = f"{generation}/members"
    return parse(store.get(key)) if store.check([key]) else None


def agree(store: dist.Store, heart: Heartbeat, me: int, old: tuple[int, ...], generation: int, step: int,
          tickets: int, deadline_s: float) -> tuple[tuple[int, ...], int]:
    """Check in at ``generation`` and return its record, deciding it where this rank may: every
    member of ``old`` checked in or went stale, or, past the deadline, a majority checked in."""
    store.set(f"{generation}/in/{me}", str(step))
    deadline = time.monotonic() + deadline_s
    while True:
        held = decided(store, generation)
        if held is not None:
            return held
        present = [r for r in old if store.check([f"{generation}/in/{r}"])]
        # a busy rank (a long forward pass) keeps beating, and is waited for
        waiting = [r for r in old if r not in present and not heart.stale(r)]
        if not waiting or (time.monotonic() > deadline and may_decide(old, present)):
            return propose(store, generation, present, tickets)
        time.sleep(_POLL_S)


def lease(store: dist.Store, heart: Heartbeat, ids: Iterable[int], wait_s: float) -> list[int]:
    """The ``ids`` (replacements) whose heartbeats move: each is watched until its counter moves
    (alive) or stands still for ``stale_after`` (dead), at most ``wait_s``."""
    ids = list(ids)
    heart.watch_also(ids)
    deadline = time.monotonic() + wait_s
    while True:
        alive = [i for i in ids if heart.moved(i)]
        dead = [i for i in ids if heart.stale(i)]
        if len(alive) + len(dead) == len(ids) or time.monotonic() > deadline:
            return alive
        time.sleep(_POLL_S)


def barrier(store: dist.Store, heart: Heartbeat, me: int, generation: int, members: tuple[int, ...],
            timeout_s: float) -> None:
    """Wait until every member arrived at ``generation``; raise ``MembersMissing`` once one that
    has not arrived stopped beating, or ``timeout_s`` passes."""
    store.set(f"{generation}/here/{me}", "1")
    arrived = store.add(f"{generation}/arrived", 1)
    deadline, looked = time.monotonic() + timeout_s, time.monotonic()
    while arrived < len(members):
        time.sleep(_POLL_S)
        arrived = store.add(f"{generation}/arrived", 0)
        if time.monotonic() - looked < LOOK_S:  # who is missing: asked only as often as beats are read
            continue
        looked = time.monotonic()
        missing = tuple(r for r in members if not store.check([f"{generation}/here/{r}"]))
        gone = tuple(r for r in missing if heart.stale(r))
        if missing and (gone or time.monotonic() > deadline):
            why = "stopped beating" if gone else f"did not arrive within {timeout_s:g} s"
            raise MembersMissing(f"SurvivingSync: {said(gone or missing)} of generation {generation} "
                                 f"(members {list(members)}) {why} before the group could be made")
