"""What a user on AWS EFA (or any NCCL network) needs, and what this process actually has.

Logged once per process when the first NCCL communicator is made: on rank 0 at INFO level with
``SMDDP_DEBUG=1``, and as a warning on every rank when the host has EFA devices but NCCL would
not use them (no aws-ofi-nccl plugin found), which silently falls back to TCP sockets at a
fraction of the bandwidth.
"""

from __future__ import annotations

import glob
import os
from typing import Callable, Mapping

# where the aws-ofi-nccl plugin is installed by AWS's AMIs and Deep Learning Containers
PLUGIN_DIRS = ("/opt/amazon/ofi-nccl/lib", "/opt/aws-ofi-nccl/lib", "/usr/local/lib", "/usr/lib/x86_64-linux-gnu")
PLUGIN_NAMES = ("libnccl-net.so", "libnccl-net-ofi.so", "libnccl-net-aws-ofi.so")
EFA_ADVICE = (
    "on EFA: install NCCL's aws-ofi-nccl plugin (AWS AMIs and DLCs have it in /opt/amazon/ofi-nccl) and put its "
    "lib directory on LD_LIBRARY_PATH; set FI_PROVIDER=efa, FI_EFA_USE_DEVICE_RDMA=1 on p4d/p5 (GPUDirect RDMA), "
    "and NCCL_SOCKET_IFNAME to the instance's primary interface (e.g. ens32 or eth0) for NCCL's bootstrap"
)


def efa_devices(glob_fn: Callable[[str], list[str]] = glob.glob) -> list[str]:
    """EFA adapters on this host (they appear as rdmap* InfiniBand devices)."""
    return sorted(os.path.basename(p) for p in glob_fn("/sys/class/infiniband/rdmap*"))


def find_net_plugin(environ: Mapping[str, str], exists: Callable[[str], bool] = os.path.exists) -> str | None:
    """Path of the NCCL network plugin NCCL would load, or None (NCCL then uses its own sockets/IB)."""
    named = environ.get("NCCL_NET_PLUGIN")
    dirs = [d for d in environ.get("LD_LIBRARY_PATH", "").split(":") if d] + list(PLUGIN_DIRS)
    names = ([named, f"libnccl-net-{named}.so"] if named else []) + list(PLUGIN_NAMES)
    for d in dirs:
        for name in names:
            path = os.path.join(d, name)
            if exists(path):
                return path
    return None


def network_report(nccl_version: str, environ: Mapping[str, str], plugin: str | None,
                   efa: list[str]) -> tuple[list[str], list[str]]:
    """(lines describing NCCL's network set-up, warnings about it)."""
    keys = ("FI_PROVIDER", "FI_EFA_USE_DEVICE_RDMA", "NCCL_SOCKET_IFNAME", "NCCL_NET_PLUGIN", "NCCL_PROTO",
            "NCCL_ALGO", "NCCL_DEBUG")
    shown = ", ".join(f"{k}={environ[k]}" for k in keys if k in environ) or "none of FI_*/NCCL_* set"
    lines = [f"NCCL {nccl_version}; network plugin: {plugin or 'none found (NCCL uses its own sockets or IB)'}",
             f"EFA devices: {', '.join(efa) if efa else 'none'}; environment: {shown}"]
    warnings = []
    if efa and plugin is None:
        warnings.append(f"this host has EFA devices ({', '.join(efa)}) but no aws-ofi-nccl plugin was found, so "
                        f"NCCL will use TCP sockets; {EFA_ADVICE}")
    if efa and environ.get("FI_PROVIDER", "efa") != "efa":
        warnings.append(f"FI_PROVIDER={environ['FI_PROVIDER']} on an EFA host; set FI_PROVIDER=efa")
    return lines, warnings
