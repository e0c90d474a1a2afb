"""What ends a rank's part in a surviving job, raised on that rank with the reason."""

from __future__ import annotations

from ..backend.errors import SMDDPError


class RankDeclaredLostError(SMDDPError):
    """This rank was declared lost by the others (it did not check in before they decided who is
    left) and may not rejoin: the group went on without it."""


class HeartbeatStoppedError(RankDeclaredLostError):
    """This rank's heartbeat stopped (its store client failed, or its process died): the others no
    longer hear it and declare it lost once ``stale_after`` passes, so it may not train on."""


class JobFinishedError(SMDDPError):
    """A replacement found the job it was started for finished: there is nothing to join."""


class TooFewRanksError(SMDDPError):
    """Fewer ranks are left than ``min_world_size``: the job stops rather than train on."""
