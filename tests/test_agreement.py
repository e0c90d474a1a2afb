"""How ranks check that they agree (backend/agreement.py), in one process: ranks as threads over
a HashStore, or a thread all_gather; the words as pure functions of every rank's value."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from smddp_lite.backend import agreement


def test_agreed_compares_every_rank_with_the_first_and_takes_unhashable_values():
    assert agreement.agreed(["a", "a", "a"]) and agreement.agreed([[1, 2]] * 3) and agreement.agreed(["x"])
    assert not agreement.agreed([[1, 2], [1, 2], [1, 3]]) and not agreement.agreed(["", "why"])


def test_holders_keep_the_order_of_each_values_first_rank():
    assert agreement.holders(["b", "a", "b", "c"]) == {"b": [0, 2], "a": [1], "c": [3]}
    assert agreement.holders(["x", "y"], ranks=[4, 9]) == {"x": [4], "y": [9]}


@pytest.mark.parametrize("values, kwargs, words", [
    (["a", "b", "a"], {}, "a on ranks 0, 2, b on rank 1"),
    (["unset", "unset", "8", "unset"], {"joined": " and "}, "unset on ranks 0-1, 3 and 8 on rank 2"),
    (["f()", "g()"], {"ranks": [3, 5], "each": "{ranks}: {value}", "joined": "; "}, "rank 3: f(); rank 5: g()"),
    (["{braces}"], {}, "{braces} on rank 0"),  # a value is substituted, never read as a format
])
def test_said_names_the_ranks_holding_each_value(values, kwargs, words):
    assert agreement.said(values, **kwargs) == words


def _ranks(world: int, body):
    """``body(rank)`` on ``world`` threads at once; returns their results, rank by rank."""
    with ThreadPoolExecutor(world) as pool:
        return list(pool.map(body, range(world)))


def test_every_rank_learns_every_ranks_value_through_the_store():
    store = dist.HashStore()
    learnt = _ranks(3, lambda r: agreement.exchange_in_store(store, "p", r, 3, "" if r == 1 else f"v{r}",
                                                             timedelta(seconds=10)))
    assert learnt == [["v0", "", "v2"]] * 3


def test_a_value_published_before_the_wait_is_learnt_with_the_others():
    """The refusal board publishes its outcome, announces the refusal, and only then learns."""
    store = dist.HashStore()
    agreement.publish(store, "7", 1, "left")
    assert agreement.exchange_in_store(store, "7", 0, 2, "refused") == ["refused", "left"]


def test_a_rank_that_never_publishes_is_named_after_the_timeout():
    store = dist.HashStore()
    start = time.monotonic()
    with pytest.raises((dist.DistStoreError, RuntimeError)):
        agreement.exchange_in_store(store, "arrivals/0", 0, 3, "state_dict()", timedelta(seconds=0.2))
    assert time.monotonic() - start < 5
    agreement.publish(store, "arrivals/0", 2, "state_dict()")
    assert agreement.absent(store, "arrivals/0", range(3)) == [1]


class _ThreadGather:
    """An all_gather(output, input) between threads, counting its calls."""

    def __init__(self, world: int) -> None:
        self.world, self.calls = world, 0
        self._inputs: dict[int, torch.Tensor] = {}
        self._barrier = threading.Barrier(world)
        self._lock = threading.Lock()

    def of(self, rank: int):
        def all_gather(out: torch.Tensor, inp: torch.Tensor) -> None:
            with self._lock:
                self.calls += rank == 0
                self._inputs[rank] = inp.clone()
            self._barrier.wait(timeout=10)
            out.copy_(torch.cat([self._inputs[r] for r in range(self.world)]))
            self._barrier.wait(timeout=10)
        return all_gather


def test_ranks_that_agree_exchange_one_fingerprint_in_one_all_gather():
    gather = _ThreadGather(3)
    cpu = torch.device("cpu")
    learnt = _ranks(3, lambda r: agreement.exchange_in_group('["same", "words"]', 3, gather.of(r), cpu))
    assert learnt == [['["same", "words"]'] * 3] * 3 and gather.calls == 1


def test_ranks_that_differ_learn_every_ranks_words_in_a_second_all_gather():
    gather = _ThreadGather(3)
    mine = ["short", "", "a longer value, ü"]
    learnt = _ranks(3, lambda r: agreement.exchange_in_group(mine[r], 3, gather.of(r), torch.device("cpu")))
    assert learnt == [mine] * 3 and gather.calls == 2
