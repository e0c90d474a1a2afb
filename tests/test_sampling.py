"""ElasticSampler: the parts every rank trains on, through losses and replacements, cover each
sample of the epoch exactly once, with the samplers of all ranks agreeing step by step.

The ranks are simulated in one process, each with its own sampler, told of the changes that
SurvivingSync would tell them (its ``Change``), including a survivor a step behind the others
(whose interrupted step was finished with the old members' average) and a replacement that
receives rank 0's state. The multi-process form runs in test_launcher.py."""

from __future__ import annotations

import pytest

from smddp_lite.sampling import ElasticSampler
from smddp_lite.surviving import Change


def _change(members, lost=(), joined=(), first_step=0) -> Change:
    return Change(1, tuple(lost), tuple(joined), tuple(members), 0, len(members), first_step, 0.0, first_step)


class _Rank:
    def __init__(self, me: int, members, sampler: ElasticSampler) -> None:
        self.me, self.sampler = me, sampler
        sampler.attach(me, tuple(members))
        self.batches = iter(sampler)
        self.part: list[int] | None = None

    def draw(self) -> list[int] | None:
        self.part = next(self.batches, None)
        return self.part


def _sampler(**kwargs) -> ElasticSampler:
    return ElasticSampler(100, 4, seed=1, **kwargs)


def _run(losses: dict[int, tuple[int, str]], joins: dict[int, int], **kwargs) -> list[int]:
    """Train one epoch on 3 simulated ranks; ``losses``: step -> (id, "redo" or "behind"), where
    "behind" has rank 2 a step behind (the others finished that step with the old members);
    ``joins``: step -> the id of a replacement admitted at that step. Returns every index trained."""
    members = [0, 1, 2]
    ranks = {m: _Rank(m, members, _sampler(**kwargs)) for m in members}
    trained: list[int] = []
    step = 0
    while True:
        parts = {m: ranks[m].draw() for m in members}
        if all(p is None for p in parts.values()):
            break
        assert None not in parts.values(), f"ranks disagree on the epoch's end at step {step}: {parts}"
        if step in joins:  # admitted at the start of this step's sync: it takes a part of its own
            new = joins[step]
            rank0_state = ranks[members[0]].sampler.state_dict()
            members = members + [new]
            change = _change(members, joined=[new], first_step=step)
            for m in members[:-1]:
                ranks[m].sampler.changed(change)
            sampler = _sampler(**kwargs)
            sampler.load_state_dict(rank0_state)
            sampler.me = new
            sampler.changed(change)
            ranks[new] = _Rank(new, members, sampler)
            parts[new] = ranks[new].draw()
        if step in losses:
            lost, how = losses[step]
            survivors = [m for m in members if m != lost]
            if how == "redo":  # nobody had the average: the survivors redo this step
                change = _change(survivors, lost=[lost], first_step=step)
                for m in survivors:
                    ranks[m].sampler.changed(change)
                trained += [i for m in survivors for i in parts[m]]
            else:  # every survivor but the last had the average of this step and drew the next
                behind = survivors[-1]
                trained += [i for m in members for i in parts[m]]
                ahead_parts = {m: ranks[m].draw() for m in survivors[:-1]}
                change = _change(survivors, lost=[lost], first_step=step + 1)
                for m in survivors:
                    ranks[m].sampler.changed(change)
                step += 1
                parts = {**ahead_parts, behind: ranks[behind].draw()}
                trained += [i for m in survivors for i in parts[m]]
            members = survivors
            del ranks[lost]
        else:
            trained += [i for m in members for i in parts[m]]
        step += 1
    return trained


@pytest.mark.parametrize("constant_global_batch", [False, True])
@pytest.mark.parametrize("losses,joins", [
    ({}, {}),
    ({3: (1, "redo")}, {}),
    ({3: (1, "behind")}, {}),
    ({3: (1, "redo")}, {6: 3}),
    ({3: (0, "behind")}, {5: 3}),
    ({2: (2, "redo"), 4: (1, "behind")}, {7: 3}),
])
def test_every_sample_is_trained_once(losses, joins, constant_global_batch):
    trained = _run(losses, joins, constant_global_batch=constant_global_batch)
    assert sorted(trained) == list(range(100))


def test_a_constant_global_batch_is_split_among_the_ranks_left():
    a, b = _sampler(constant_global_batch=True), _sampler(constant_global_batch=True)
    a.attach(0, (0, 1, 2))
    b.attach(2, (0, 1, 2))
    ia, ib = iter(a), iter(b)
    assert (len(next(ia)), len(next(ib))) == (4, 4)
    change = _change((0, 2), lost=[1], first_step=0)  # step 0 redone by the two left
    a.changed(change)
    b.changed(change)
    assert (len(next(ia)), len(next(ib))) == (6, 6)  # 12 samples a step, now over 2 ranks


def test_drawing_out_of_step_with_sync_is_refused():
    s = _sampler()
    s.attach(0, (0, 1))
    it = iter(s)
    next(it)
    with pytest.raises(RuntimeError, match="draw exactly one batch per sync"):
        s.changed(_change((0,), lost=[1], first_step=5))


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="batch_size >= 1"):
        ElasticSampler(10, 0)
