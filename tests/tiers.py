"""The suite's two tiers.

``python -m pytest`` runs the quick tier, in minutes: every test function once, with its first
parameters (the first case of each matrix), at its smallest size, plus the cases marked
``@tiers.QUICK`` (so that every transport runs), less those marked ``@tiers.FULL_ONLY``.
``python -m pytest --full`` (what CI runs) runs every case of every matrix and each drill at
full size. Put a matrix's cheapest representative case first; a drill whose size differs
between the tiers asks ``tiers.size(quick, full)`` while it runs.
"""

from __future__ import annotations

import pytest

QUICK = pytest.mark.quick
"""In the quick tier too, though not its function's first case."""
FULL_ONLY = pytest.mark.full
"""Only in the full tier, though its function's first case (or not parametrized)."""

_full = False  # set from --full by tests/conftest.py before any test runs


def configure(full: bool) -> None:
    global _full
    _full = full


def full() -> bool:
    """True in the full tier (``--full``)."""
    return _full


def size(quick, full):
    """``full`` in the full tier, else ``quick``: a drill's size, asked while the test runs."""
    return full if _full else quick


def in_quick_tier(items: list) -> list:
    """The items the quick tier runs, in their order (see the module's docstring)."""
    chosen, seen = [], set()
    for item in items:
        function = item.nodeid.split("[", 1)[0]
        first = function not in seen
        seen.add(function)
        if item.get_closest_marker("full") is not None:
            continue
        if first or item.get_closest_marker("quick") is not None:
            chosen.append(item)
    return chosen
