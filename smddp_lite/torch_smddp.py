"""SageMaker-compatible import path.

Scripts written for AWS's library do ``import smdistributed.dataparallel.torch.torch_smddp``;
with smddp-lite the same line becomes ``import smddp_lite.torch_smddp``, and
``dist.init_process_group(backend="smddp")`` then works unchanged, under torchrun and under
mpirun too (SageMaker's "smdistributed dataparallel" distribution), where the import meets the
other ranks through MPI and sets what torch's env:// rendezvous reads.
"""

from . import BACKEND_NAME, init  # noqa: F401  (importing the package registers the backend)
from .launch import meet_for_env_rendezvous

meet_for_env_rendezvous()
