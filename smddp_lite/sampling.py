"""``ElasticSampler``: each rank's share of every step's samples, re-split when ranks are lost or join.

Every rank holds the same epoch's *pool* (the sample indices not trained on yet, in the epoch's
shuffled order). Each step takes its global batch from the front of the pool and splits it
among the members in rank order; a rank yields its part. The pools stay equal because every
rank applies the same rules at the same steps, learnt from ``SurvivingSync``'s changes:

* **A loss.** The step whose average the survivors redo (``Change.first_step``) keeps the split
  it was drawn with, and the lost ranks' parts of it go back to the front of the pool, to be
  trained on in the next steps: the survivors' gradients of that step came from their own parts
  only. A survivor that had not drawn that step yet draws it with the old split too.
* **A replacement.** At the step it is admitted in, the others have drawn their parts already;
  it takes a part of its own from the front of the pool (and so do the others' pools), and the
  group trains that step with one part more. Its sampler arrives from rank 0 with the job's
  state (``SurvivingSync(..., sampler=...)``).

So within an epoch no sample is skipped and none is trained twice. One batch is drawn per
``sync()``, as a training loop does.
"""

from __future__ import annotations

from typing import Iterator

import torch


class ElasticSampler:
    """This rank's sample indices for each step, re-split at every change of the group.

    Hand it to ``SurvivingSync(..., sampler=sampler)``, which tells it of every change and sends
    its state to replacements::

        sampler = smddp_lite.ElasticSampler(len(dataset), batch_size=32, seed=0)
        sync = smddp_lite.SurvivingSync(model, optimizer, sampler=sampler)
        for epoch in range(sampler.epoch, epochs):   # a replacement starts in the job's epoch
            sampler.set_epoch(epoch)
            for indices in sampler:                  # this rank's part of the step's batch
                loss = model(collate([dataset[i] for i in indices])).mean()
                loss.backward()
                sync()
                optimizer.step()
                optimizer.zero_grad()

    Args:
        dataset_size: the number of samples.
        batch_size: the samples each rank trains on per step (its part may be one smaller when
            the global batch does not split evenly, and smaller at the end of an epoch).
        constant_global_batch: keep the global batch at ``batch_size`` times the first world
            size whatever the membership, splitting it among the ranks there are (each then
            trains on more samples per step when ranks are lost). Otherwise each rank trains on
            ``batch_size`` samples and the global batch follows the membership.
        shuffle: a new order each epoch (from ``seed`` and the epoch), the same on every rank.
        drop_last: end the epoch when fewer samples are left than a global batch, instead of
            splitting the last ones (a rank's part of that step may then be empty).
    """

    def __init__(self, dataset_size: int, batch_size: int, *, constant_global_batch: bool = False,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False) -> None:
        if dataset_size < 1 or batch_size < 1:
            raise ValueError(f"ElasticSampler expected dataset_size >= 1 and batch_size >= 1; found {dataset_size} "
                             f"and {batch_size}")
        self.dataset_size, self.batch_size = dataset_size, batch_size
        self.constant_global_batch, self.shuffle, self.seed, self.drop_last = (
            constant_global_batch, shuffle, seed, drop_last)
        self.epoch = 0
        self.members: list[int] = []  # ids, in rank order
        self.me: int | None = None  # this rank's id
        self._global_batch: int | None = None  # with constant_global_batch: batch_size * the first world size
        self._pool: list[int] | None = None  # this epoch's samples left, in order
        self._drawn = 0  # steps drawn in the job, over epochs
        self._last: tuple[list[int], list[list[int]]] | None = None  # (members, parts) of the step last drawn
        self._old_split: tuple[int, list[int], tuple[int, ...]] | None = None  # (step, members, lost) to draw
        self._reserved: list[int] | None = None  # a replacement's part of the step it joined in

    # membership, from SurvivingSync -------------------------------------------------------------
    def attach(self, me: int, members: tuple[int, ...]) -> None:
        """This rank's id and the group's members (SurvivingSync, at its start)."""
        self.me, self.members = me, list(members)
        if self._global_batch is None:
            self._global_batch = self.batch_size * len(members)

    def changed(self, change) -> None:
        """Apply a ``SurvivingSync`` change (a ``Change``) to the pool and the split."""
        first, drawn_last = change.first_step, self._drawn - 1
        if first not in (drawn_last, drawn_last + 1):
            raise RuntimeError(
                f"ElasticSampler: the group changed from step {first}, but this rank drew {self._drawn} steps; draw "
                "exactly one batch per sync() (the sampler and SurvivingSync count steps alike)")
        if change.lost:
            old = list(self.members)
            if first == drawn_last:  # this rank drew the step that is redone: its lost parts go back
                self._give_back(*self._last, change.lost)
            else:  # a survivor a step behind: it draws that step with the old split
                self._old_split = (first, old, tuple(change.lost))
        self.members = list(change.members)
        for joined in change.joined:  # their parts of the step they join in, after the others'
            part = self._take(self._part_sizes(len(self.members))[self.members.index(joined)])
            if joined == self.me:
                self._reserved = part

    def _give_back(self, members: list[int], parts: list[list[int]], lost: tuple[int, ...]) -> None:
        returned = [i for member, part in zip(members, parts) if member in lost for i in part]
        self._pool[:0] = returned

    # the epoch ------------------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch``'s order; the epoch in progress (a replacement's, received from rank 0)
        is kept."""
        if epoch == self.epoch and self._pool is not None:
            return
        self.epoch = epoch
        if self.shuffle:
            order = torch.randperm(self.dataset_size, generator=torch.Generator().manual_seed(self.seed + epoch))
            self._pool = order.tolist()
        else:
            self._pool = list(range(self.dataset_size))

    def __iter__(self) -> Iterator[list[int]]:
        if self._pool is None:
            self.set_epoch(self.epoch)
        if self.me is None:
            raise RuntimeError("ElasticSampler: hand it to SurvivingSync(..., sampler=...) before iterating; the "
                               "split follows the group's membership")
        while True:
            if self._reserved is not None:  # a replacement's first step: drawn for it by the others
                part, self._reserved = self._reserved, None
                yield part
                continue
            members, lost = self.members, ()
            if self._old_split is not None and self._old_split[0] == self._drawn:
                _, members, lost = self._old_split
                self._old_split = None
            sizes = self._part_sizes(len(members))
            if not self._pool or (self.drop_last and len(self._pool) < sum(sizes)):
                self._pool = None  # the epoch is over
                self.epoch += 1
                return
            whole = self._take(sum(sizes))
            parts = _split(whole, len(members))
            self._last = (list(members), parts)
            self._drawn += 1
            if lost:
                self._give_back(members, parts, lost)
            yield parts[members.index(self.me)]

    def _part_sizes(self, ranks: int) -> list[int]:
        total = self._global_batch if self.constant_global_batch else self.batch_size * ranks
        return [total // ranks + (r < total % ranks) for r in range(ranks)]

    def _take(self, n: int) -> list[int]:
        taken, self._pool[:n] = self._pool[:n], []
        return taken

    # a replacement's copy ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        pool = None if self._pool is None else list(self._pool)
        return {"epoch": self.epoch, "pool": pool, "drawn": self._drawn, "members": list(self.members),
                "global_batch": self._global_batch, "last": self._last, "old_split": self._old_split}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self._drawn = state["epoch"], state["drawn"]
        self._pool = None if state["pool"] is None else list(state["pool"])
        self.members, self._global_batch = list(state["members"]), state["global_batch"]
        self._last, self._old_split = state["last"], state["old_split"]


def _split(whole: list[int], ranks: int) -> list[list[int]]:
    """``whole`` in ``ranks`` consecutive parts, the first ones one longer where it does not divide."""
    base, extra = divmod(len(whole), ranks)
    parts, at = [], 0
    for r in range(ranks):
        n = base + (r < extra)
        parts.append(whole[at:at + n])
        at += n
    return parts
