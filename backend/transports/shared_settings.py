"""The settings every rank of a group must share, compared once when the group is made.

Some SMDDP_* settings decide which steps a collective takes, or how shared memory is laid out.
Ranks that read different values (a variable exported on one host only, an ``mpirun`` without
``-x``) would call different steps for the same collective: a hang until the group's timeout,
a mismatch named in the steps' terms, or, for a shared-memory layout, silently wrong data. So
each rank publishes its values beside its host name at init, every rank compares them all, and
each raises the same error naming the setting, its values and the ranks holding each
(agreement.py's exchange through the store, comparison and words).
"""

from __future__ import annotations

import json

from .. import agreement

# setting -> how the user sets it (the message names the variable to fix). Only what shapes the
# collectives' steps: SMDDP_DEBUG's logging, SMDDP_BLOCKING_WAIT and the scratch size stay local.
# SMDDP_TRANSPORT is rank 0's choice, followed by all, so it may differ.
SHARED = {
    "algorithm": "SMDDP_ALGORITHM",
    "hierarchical_min_bytes": "SMDDP_HIERARCHICAL_MIN_BYTES",
    "hierarchical_chunk_bytes": "SMDDP_HIERARCHICAL_CHUNK_BYTES",
    "inter_node_wire_dtype": "SMDDP_INTER_NODE_WIRE_DTYPE",
    "inter_node_wire_block": "SMDDP_INTER_NODE_WIRE_BLOCK",
    "inter_node_accumulate": "SMDDP_INTER_NODE_ACCUMULATE",
    "shm_chunk_bytes": "SMDDP_SHM_CHUNK_BYTES",
    "cuda_transport": "SMDDP_CUDA_TRANSPORT",
    # the check is one extra all_gather per call on gloo and MPI: a rank making it pairs with its
    # peers' data
    "checks_collectives": "SMDDP_CHECK_COLLECTIVES (SMDDP_DEBUG turns it on too)",
}


def shared_values(config) -> str:
    """This rank's values of the shared settings, as published (JSON, keys sorted)."""
    return json.dumps({name: getattr(config, name) for name in SHARED}, sort_keys=True)


def disagreement(published: list[str]) -> str | None:
    """What differs between the ranks' published values (``shared_values``, rank by rank), as the
    body of an init error, or None where every rank agrees. Every rank computes it from the same
    list, so each raises the same words."""
    if agreement.agreed(published):
        return None
    values = [json.loads(p) for p in published]
    differing = []
    for name, variable in SHARED.items():
        shown = [_shown(mine.get(name)) for mine in values]
        if not agreement.agreed(shown):
            differing.append(f"{variable} is {agreement.said(shown, joined=' and ')}")
    return ("the ranks of this group run with different settings, so their collectives would take different "
            f"steps and wait for each other or mix their data: {'; '.join(differing)}. Every rank must see the "
            "same SMDDP_* settings: set them where the launcher passes them to every host (torchrun and srun pass "
            "their environment; mpirun needs -x VARIABLE for each), or unset them everywhere.")


def _shown(value) -> str:
    if isinstance(value, bool):
        return "enabled" if value else "disabled"
    return "unset" if value is None else str(value)
