"""The words every mismatch is reported in (signatures.mismatch_said): the check, the waiting
ranks' look and shm's headers all use them, so they are tested here once, by what differs."""

import pytest
import torch

from smddp_lite.backend.signatures import MISMATCH_SAID, describe, mismatch_said, signature

F32 = torch.float32


def _said(*calls):
    """mismatch_said of (rank, signature) pairs, all in call #3."""
    return mismatch_said([(rank, 3, sig) for rank, sig in calls])


def test_ranks_that_called_the_same_are_named_together_in_runs():
    eight = [(r, signature("all_reduce", F32, 7 if r == 5 else 10, 0)) for r in range(8)]
    said = _said(*eight)
    assert said.startswith(f"{MISMATCH_SAID} as call #3 of this group: ranks 0-4, 6-7: "
                           "all_reduce(numel=10, dtype=float32, op=SUM); rank 5: all_reduce(numel=7, "), said
    assert said.endswith("."), said


@pytest.mark.parametrize("theirs,look", [
    (signature("broadcast", F32, 10, 0), "look for a collective that only some ranks call"),
    (signature("barrier", None, 0), "look for a collective that only some ranks call"),
    (signature("all_reduce", F32, 10, 3), "the same root and reduce op"),
    (signature("all_reduce", F32, 9, 0), "same size to a collective: look for a tensor whose shape depends"),
    (signature("all_reduce", torch.float64, 10, 0), "same dtype to a collective: look for a cast"),
])
def test_where_to_look_follows_what_differs(theirs, look):
    said = _said((0, signature("all_reduce", F32, 10, 0)), (1, theirs))
    assert f"rank 1: {describe(theirs)}. " in said and look in said, said
    others = ("only some ranks call", "root and reduce op", "same size", "same dtype", "split sizes")
    assert [words for words in others if words in said] == [w for w in others if w in look], said


def test_sizes_and_dtypes_that_both_differ_get_both_hints():
    said = _said((0, signature("all_reduce", F32, 10, 0)), (1, signature("all_reduce", torch.float16, 4, 0)))
    assert "same size to a collective" in said and "same dtype to a collective" in said, said


@pytest.mark.parametrize("uneven,even", [
    (signature("all_to_all_v", F32, 0), signature("all_to_all", F32, 4)),
    (signature("all_gather_v", F32, 0), signature("all_gather", F32, 4)),
    (signature("split_sizes", torch.int64, 2), signature("all_gather", torch.int64, 2)),
])
def test_the_uneven_form_on_some_ranks_only_is_named_as_such(uneven, even):
    said = _said((0, uneven), (1, even))
    assert "Some ranks passed split sizes (or output tensors of different sizes) and others did not" in said, said


def test_the_exchange_of_sizes_against_another_collective_is_an_extra_call():
    said = _said((0, signature("split_sizes", torch.int64, 2)), (1, signature("all_reduce", torch.int64, 2, 0)))
    assert "rank 0: the exchange of sizes that starts all_to_all(with split sizes)" in said, said
    assert "only some ranks call" in said and "split sizes (or" not in said, said


def test_call_numbers_that_differ_are_named_per_rank():
    said = mismatch_said([(0, 3, signature("barrier", None, 0)), (1, 4, signature("barrier", None, 0))])
    assert said.startswith(f"{MISMATCH_SAID}: rank 0: call #3 barrier(); rank 1: call #4 barrier(). "), said
    assert "only some ranks call" in said, said


def test_a_waiting_look_says_so():
    said = mismatch_said([(1, 2, signature("barrier", None, 0)), (0, 2, signature("all_reduce", F32, 1, 0))],
                         waiting=True)
    assert said.startswith(f"{MISMATCH_SAID} as call #2 of this group, and each waits for the others in it: "
                           "rank 0: all_reduce("), said
