"""What SageMaker says about the host a rank runs on: its name in the job and the network
interface that joins the job's hosts.

A SageMaker training container is told both in ``resourceconfig.json`` (``current_host``, e.g.
``algo-2``, and ``network_interface_name``), and neither need match what the container itself
reports: its hostname may be the instance's own, and its first interface may not be the one the
job's hosts reach each other on. AWS's toolkits read the file (and preload a ``gethostname`` that
answers ``current_host``); ranks started over ssh by the toolkit's mpirun get none of the job's
``SM_*`` variables, so the file, which every container holds, is what this reads.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import socket

log = logging.getLogger("smddp_lite")

DEFAULT_BASE_DIR = "/opt/ml"
"""Where a SageMaker container holds its job; ``SAGEMAKER_BASE_DIR`` moves it (as the toolkit reads it)."""


@functools.lru_cache(maxsize=None)
def resource_config() -> dict | None:
    """This container's ``resourceconfig.json``, or None outside a SageMaker job (no file, or one
    that is not a resource config)."""
    base = os.environ.get("SAGEMAKER_BASE_DIR", DEFAULT_BASE_DIR)
    path = os.path.join(base, "input", "config", "resourceconfig.json")
    try:
        with open(path) as f:
            config = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        log.warning("smddp: %s is not readable JSON (%s); host names come from gethostname()", path, exc)
        return None
    if not isinstance(config, dict) or not isinstance(config.get("current_host"), str):
        log.warning("smddp: %s has no current_host; host names come from gethostname()", path)
        return None
    return config


def current_host() -> str | None:
    """This host's name in the SageMaker job (``algo-1``), or None outside one."""
    config = resource_config()
    return config["current_host"] if config else None


def network_interface() -> str | None:
    """The interface SageMaker says the job's hosts talk over, where this machine has it."""
    config = resource_config()
    name = (config or {}).get("network_interface_name")
    if not isinstance(name, str) or name not in {n for _, n in socket.if_nameindex()}:
        return None
    return name


def use_job_interface_for_gloo() -> None:
    """Point gloo's sockets at SageMaker's job interface unless ``GLOO_SOCKET_IFNAME`` names one.

    Gloo otherwise binds to what the hostname resolves to, which in a SageMaker container may be
    an address the other hosts cannot reach (or loopback). torch reads the variable each time it
    makes a gloo group, so setting it before the first one is enough."""
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return
    name = network_interface()
    if name is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = name
