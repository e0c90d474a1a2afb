"""A DeprecationWarning or FutureWarning raised while this project's code is on the stack fails
the test: our code paths must not use what the torch we test with deprecates.

Warning filters match only the module a warning is attributed to, and torch attributes its
deprecations to its own wrappers (``c10d_logger``), not to the caller: so the stack is read
when the warning is shown. ``install`` serves ranks (tests/worker.py), ``installed`` the tests
of pytest's own process (tests/conftest.py), inside pytest's recording of warnings.
"""

from __future__ import annotations

import contextlib
import sys
import warnings

CATEGORIES = (DeprecationWarning, FutureWarning)


def _our_frame() -> str | None:
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if name == "smddp_lite" or name.startswith("smddp_lite."):
            return f"{name}:{frame.f_lineno}"
        frame = frame.f_back
    return None


def _gated(show):
    def showwarning(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, CATEGORIES):
            ours = _our_frame()
            if ours is not None:
                raise category(f"{message} [raised through {ours}: this project must not use what torch deprecates]")
        show(message, category, filename, lineno, file, line)

    return showwarning


def install() -> None:
    """For the rest of this process: deprecations reach the gate (each shown once per place, as
    Python's "default" action does, when it lets them pass)."""
    seen: set[tuple] = set()
    show = warnings.showwarning

    def once(message, category, filename, lineno, file=None, line=None):
        if (str(message), category, filename, lineno) not in seen:
            seen.add((str(message), category, filename, lineno))
            show(message, category, filename, lineno, file, line)

    for category in CATEGORIES:
        warnings.simplefilter("always", category)
    warnings.showwarning = _gated(once)


@contextlib.contextmanager
def installed():
    """For one test, inside the recording pytest sets up around it."""
    show = warnings.showwarning
    warnings.showwarning = _gated(show)
    try:
        for category in CATEGORIES:
            warnings.simplefilter("always", category)
        yield
    finally:
        warnings.showwarning = show
