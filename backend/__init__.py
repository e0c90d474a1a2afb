"""The machinery behind the "smddp" torch.distributed backend.

``process_group`` is what torch.distributed sees (it validates and dispatches), ``algorithms``
decide what to move (16-bit accumulation, AVG, bool, op-signature checks), and ``transports``
move bytes (shared memory, gloo, MPI). Installed as ``smddp_lite.backend``.
"""

from .process_group import ProcessGroupSMDDP, create_process_group

__all__ = ["ProcessGroupSMDDP", "create_process_group"]
