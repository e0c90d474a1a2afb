"""How the ranks of a group check that they agree, and the words they say where they do not.

Ranks check that they agree on a collective's signature (``SMDDP_CHECK_COLLECTIVES``' all_gather in
algorithms.Collectives._agree, a long wait's look in refusals.RefusalBoard.mismatch_in, the
shared-memory transport's headers in shm_segment.py), on a refused call's outcome
(RefusalBoard.post), on the settings that shape the collectives (select._choose with
shared_settings.py), on the way CUDA tensors move (cuda.agree_on_path), on what ``compile``
builds (compiler/agreement.py) and on calling a sharded state_dict (compiler/sharding.py's
check_every_rank_calls). Each is the same three steps, which live here:

- an exchange: each rank publishes a value and learns every rank's, through the store (one key
  per rank under a prefix: ``publish``, ``learn``, ``exchange_in_store``, ``absent``) or through
  an all_gather on the group (``exchange_in_group``);
- a comparison (``agreed``);
- one formatter naming the ranks that hold each value (``holders``, ``said``): every rank computes
  it from the same values, so every rank raises the same words.

Two exchanges stay where they are, for their cost, and use the comparison and formatter from
here (signatures.mismatch_said formats with ``said``): the per-call check's all_gather runs inside
the transport on every collective, and shm's headers are compared in shared memory.
"""

from __future__ import annotations

import zlib
from datetime import timedelta
from typing import Callable, Hashable, Iterable, Sequence

import torch

from .errors import ranks_said


# comparison and words ---------------------------------------------------------------------------
def agreed(values: Sequence) -> bool:
    """Whether every rank's value (``values[r]``) is the same; values need not be hashable."""
    return all(v == values[0] for v in values)


def holders(values: Sequence[Hashable], ranks: Sequence[int] | None = None) -> dict:
    """Each distinct value -> the ranks holding it, in the order of their first holder.
    ``ranks``: the rank each value is shown as (default: its index)."""
    held: dict = {}
    for rank, value in zip(range(len(values)) if ranks is None else ranks, values):
        held.setdefault(value, []).append(rank)
    return held


def said(values: Sequence[str], ranks: Sequence[int] | None = None, each: str = "{value} on {ranks}",
         joined: str = ", ") -> str:
    """Which ranks hold which value, in words: ``each`` for every distinct value (``{value}``,
    ``{ranks}`` as errors.ranks_said writes them), joined by ``joined``:
    ``said(["a", "b", "a"]) == "a on ranks 0, 2, b on rank 1"``."""
    return joined.join(each.format(value=value, ranks=ranks_said(rs)) for value, rs in holders(values, ranks).items())


# exchange through the store ---------------------------------------------------------------------
def _key(prefix: str, rank: int) -> str:
    return f"{prefix}/{rank}"


def publish(store, prefix: str, rank: int, value: str) -> None:
    """This rank's ``value`` under ``prefix``, for ``learn``."""
    store.set(_key(prefix, rank), value)


def learn(store, prefix: str, world_size: int, timeout: timedelta | None = None) -> list[str]:
    """Every rank's value published under ``prefix``, rank by rank, once all have published:
    two store requests (a wait, and one multi_get). The store's error propagates where a rank
    has not published within ``timeout`` (default: the store's own)."""
    keys = [_key(prefix, r) for r in range(world_size)]
    store.wait(keys) if timeout is None else store.wait(keys, timeout)
    return [v.decode(errors="replace") for v in store.multi_get(keys)]


def exchange_in_store(store, prefix: str, rank: int, world_size: int, mine: str,
                      timeout: timedelta | None = None) -> list[str]:
    """``publish`` ``mine``, then ``learn`` every rank's value."""
    publish(store, prefix, rank, mine)
    return learn(store, prefix, world_size, timeout)


def absent(store, prefix: str, ranks: Iterable[int]) -> list[int]:
    """Those of ``ranks`` that have not published under ``prefix`` (one request each)."""
    return [r for r in ranks if not store.check([_key(prefix, r)])]


# exchange through the group ---------------------------------------------------------------------
def exchange_in_group(mine: str, world_size: int, all_gather: Callable[[torch.Tensor, torch.Tensor], None],
                      device: torch.device) -> list[str]:
    """Every rank's ``mine``, through ``all_gather(output, input)`` on the group (collective:
    every rank calls it). One all_gather of two numbers (crc32 and length) where the ranks agree,
    which returns ``[mine] * world_size``; only where those differ a second one brings the words
    (every rank saw the same table, so every rank makes it)."""
    words = mine.encode()
    fingerprint = torch.tensor([zlib.crc32(words), len(words)], dtype=torch.int64, device=device)
    table = torch.empty(world_size * 2, dtype=torch.int64, device=device)
    all_gather(table, fingerprint)
    rows = table.view(world_size, 2).tolist()
    if agreed(rows):
        return [mine] * world_size
    longest = max(length for _, length in rows)
    padded = torch.zeros(longest, dtype=torch.uint8)
    if words:  # frombuffer refuses an empty buffer
        padded[: len(words)] = torch.frombuffer(bytearray(words), dtype=torch.uint8)
    everyone = torch.empty(world_size * longest, dtype=torch.uint8, device=device)
    all_gather(everyone, padded.to(device))
    flat = everyone.cpu().view(world_size, longest)
    return [bytes(flat[r, :length].tolist()).decode(errors="replace") for r, (_, length) in enumerate(rows)]
