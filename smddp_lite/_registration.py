"""Registers the "smddp" backend with torch.distributed, once, and says which package owns it.

AWS's closed package registers a backend under the same name; torch silently lets the last
registration win, so we detect a foreign owner and warn (naming both) instead of guessing.
"""

from __future__ import annotations

import logging
import warnings

import torch.distributed as dist

from ._autoload import BACKEND_NAME, create_on_first_use

log = logging.getLogger("smddp_lite")


def _current_owner() -> str | None:
    plugin = dist.Backend._plugins.get(BACKEND_NAME.upper())
    if plugin is None:
        return None
    return getattr(plugin.creator_fn, "__module__", "?")


def register() -> None:
    """Make ``init_process_group(backend="smddp")`` use smddp-lite for CPU and CUDA tensors."""
    from smddp_lite.backend.process_group import create_process_group

    owner = _current_owner()
    if owner == create_process_group.__module__:
        return
    if owner is not None and owner != create_on_first_use.__module__:  # the stand-in torch's import registered is ours
        warnings.warn(
            f"smddp-lite: backend 'smddp' was registered by {owner} (likely AWS's smdistributed "
            "package); smddp-lite now replaces it in this process. Import only one of them.",
            stacklevel=3,
        )
    dist.Backend.register_backend(BACKEND_NAME, create_process_group, extended_api=True, devices=["cpu", "cuda"])
