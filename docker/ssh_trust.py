#!/usr/bin/env python3
"""ssh trust for one SageMaker job: made at container start, limited to the job's own hosts.

SageMaker's "smdistributed dataparallel" distribution (and the toolkit's other MPI runners) starts
``/usr/sbin/sshd -D`` in every container of the job; the first host's mpirun then starts Open MPI's
daemon on the others over ssh, as root, and later writes ``/tmp/done.<host>`` to each over ssh; the
other hosts test the first one's sshd (paramiko, with root's key) while they wait for it. So root's
key must be accepted between the job's hosts, and nowhere else. The image's entry point
(``docker/entrypoint.py``, installed as ``/usr/local/bin/smddp-entrypoint``, with this file beside
it as ``smddp_ssh_trust.py``) runs :func:`setup` before SageMaker's ``train``, which:

1. resolves every host of ``resourceconfig.json`` (``hosts``) to its addresses, waiting up to
   ``SSH_TRUST_DNS_WAIT_S`` seconds (default 900, the toolkit's own wait for the same names) for
   the job's DNS, which SageMaker documents can lag the container's start. A name that still does
   not resolve fails the container before ``train`` starts (the toolkit would fail on it too), with
   a message naming it: a host left out would be refused later, and a wider pattern would trust
   addresses that are not the job's. (The variable is not named ``SMDDP_*``: the job's environment
   reaches its ranks too, where smddp-lite refuses ``SMDDP_*`` names it does not know.)
2. makes this container's ssh host key (ed25519) fresh: the image holds none (the Dockerfile
   removes those Debian's package makes at install), so no two containers, and no copy of the
   image, share one;
3. writes root's ``authorized_keys``: the image's key (``/root/.ssh/id_rsa.pub``, baked into the
   image, as the toolkit expects) with ``from="<the job's addresses>"``, and no agent, X11 or port
   forwarding; any other line the file had is dropped;
4. writes an sshd snippet, ``/etc/ssh/sshd_config.d/00-smddp-ssh-trust.conf`` (Debian's
   ``sshd_config`` includes that folder before its own settings, and sshd keeps the first value
   of a setting, so the plain ``sshd -D`` the toolkit starts reads it): the fresh host key only,
   root by key only, no passwords or keyboard-interactive login, and ``AllowUsers root@<address>``
   for the job's addresses, so even another key or method is refused from anywhere else;
5. writes ``/root/.ssh/smddp_job_hosts`` (which the image's ``/root/.ssh/config`` includes):
   ``StrictHostKeyChecking no`` and no known-hosts file for the job's hosts only (their names and
   addresses). Their host keys are made in each container at its start, so no container can know
   another's in advance; every other host is checked as ssh checks by default.

Why the key itself stays baked: the job's containers share nothing secret at start (the job's
configuration is not secret, and they cannot reach each other before sshd runs), so a key per job
would need a channel that does not exist. The trust is therefore bound to where a login comes from,
the job's addresses, and the host keys to each container. docs/security.md says what a stranger on
the same network can and cannot still do.

Nothing is written until every name has resolved and the host key is made, so a failure leaves
ssh as the image has it: no ``authorized_keys`` at all, and sshd without a host key refuses to
start; never wider open. Runnable as a script with every path given (the tests point it at a
temporary folder): ``python ssh_trust.py --help``. Standard library only: it runs in the image's
PID 1.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

DEFAULT_DNS_WAIT_S = 900.0  # the toolkit's _dns_lookup retries for 15 minutes
SNIPPET_NAME = "00-smddp-ssh-trust.conf"
CLIENT_HOSTS_NAME = "smddp_job_hosts"
HOST_KEY_NAME = "ssh_host_ed25519_key"


class TrustError(RuntimeError):
    """The job's ssh trust cannot be made; the message says what was expected, found, and the fix."""


def _base_dir() -> str:
    return os.environ.get("SAGEMAKER_BASE_DIR", "/opt/ml")


def resourceconfig_path() -> str:
    return os.path.join(_base_dir(), "input", "config", "resourceconfig.json")


def read_hosts(path: str) -> tuple[list[str], str]:
    """The job's hosts and this host's name, from SageMaker's resourceconfig.json."""
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        raise TrustError(f"expected SageMaker's resourceconfig.json at {path}, found it unreadable ({exc}); "
                         "SageMaker writes it in every training container: check the job's /opt/ml "
                         "(SAGEMAKER_BASE_DIR moves it)") from None
    hosts = config.get("hosts") if isinstance(config, dict) else None
    current = config.get("current_host") if isinstance(config, dict) else None
    if (not isinstance(hosts, list) or not hosts or not all(isinstance(h, str) and h.strip() for h in hosts)
            or not isinstance(current, str)):
        raise TrustError(f"expected {path} to hold \"hosts\" (a list of host names) and \"current_host\", found "
                         f"hosts={hosts!r}, current_host={current!r}; it is SageMaker's file: fix or rewrite it")
    for host in hosts:  # the names go into sshd's and ssh's configuration: plain host names only
        if not all(c.isalnum() or c in "-._" for c in host):
            raise TrustError(f"expected host names of letters, digits, '-', '.' and '_' in {path}, found {host!r}")
    return list(dict.fromkeys(hosts)), current


def _addresses(host: str) -> list[str]:
    found = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    addresses = []
    for _, _, _, _, sockaddr in found:
        address = ipaddress.ip_address(sockaddr[0].split("%")[0])
        if address.version == 6 and address.ipv4_mapped:
            address = address.ipv4_mapped
        addresses.append(str(address))
    return sorted(set(addresses))


def resolve_hosts(hosts: list[str], wait_s: float, resolve=_addresses) -> dict[str, list[str]]:
    """Every host's addresses, retrying names that do not resolve yet for up to ``wait_s`` seconds."""
    deadline = time.monotonic() + wait_s
    resolved: dict[str, list[str]] = {}
    pause, errors = 0.2, {}
    while True:
        for host in hosts:
            if host not in resolved:
                try:
                    addresses = resolve(host)
                except (OSError, UnicodeError) as exc:
                    errors[host] = str(exc)
                    continue
                if addresses:
                    resolved[host] = addresses
                    errors.pop(host, None)
        missing = [h for h in hosts if h not in resolved]
        if not missing:
            return {h: resolved[h] for h in hosts}
        if time.monotonic() + pause > deadline:
            shown = "; ".join(f"{h}: {errors.get(h, 'no address')}" for h in missing)
            raise TrustError(
                f"expected every host of the job to resolve to an address within {wait_s:g} s (ssh logins are "
                f"accepted only from the job's addresses), found {len(missing)} that did not ({shown}); the "
                "job's network gives these names: check the instances' network, or set SSH_TRUST_DNS_WAIT_S "
                "to wait longer")
        time.sleep(pause)
        pause = min(pause * 2, 5.0)


def _write(path: str, text: str, mode: int) -> None:
    """Write ``path`` whole, or not at all (a temporary file renamed over it)."""
    folder = os.path.dirname(path) or "."
    fd, tmp = tempfile.mkstemp(dir=folder, prefix="." + os.path.basename(path) + ".")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def make_host_key(key_dir: str, host: str) -> str:
    """A fresh ed25519 host key in ``key_dir``; returns its private key's path."""
    os.makedirs(key_dir, exist_ok=True)
    path = os.path.join(key_dir, HOST_KEY_NAME)
    for old in (path, path + ".pub"):
        if os.path.lexists(old):
            os.unlink(old)
    try:
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"root@{host}", "-f", path],
                       check=True, capture_output=True, text=True, timeout=120)
    except FileNotFoundError:
        raise TrustError("expected ssh-keygen on PATH to make this container's ssh host key, found none: "
                         "install openssh-client in the image") from None
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        raise TrustError(f"expected ssh-keygen to make a host key at {path}, found it failed: "
                         f"{getattr(exc, 'stderr', '') or exc}") from None
    return path


def authorized_keys_text(public_key: str, addresses: list[str]) -> str:
    return (f'from="{",".join(addresses)}",no-agent-forwarding,no-X11-forwarding,no-port-forwarding '
            f"{public_key.strip()}\n")


def sshd_snippet_text(host_key: str, addresses: list[str]) -> str:
    return ("# smddp-lite: written at container start (smddp_ssh_trust.py); root logs in by key, from the\n"
            "# job's hosts only (resourceconfig.json), to this container's own host key\n"
            f"HostKey {host_key}\n"
            "PermitRootLogin prohibit-password\n"
            "PubkeyAuthentication yes\n"
            "PasswordAuthentication no\n"
            "KbdInteractiveAuthentication no\n"
            f"AllowUsers {' '.join(f'root@{a}' for a in addresses)}\n")


def client_hosts_text(hosts: dict[str, list[str]]) -> str:
    names = list(hosts) + sorted({a for addresses in hosts.values() for a in addresses})
    return ("# smddp-lite: the job's hosts (resourceconfig.json), whose host keys are made at their start:\n"
            "# no host-key checking for them, and for them only\n"
            f"Host {' '.join(names)}\n"
            "  StrictHostKeyChecking no\n"
            "  UserKnownHostsFile /dev/null\n"
            "  LogLevel ERROR\n")


def setup(config: str | None = None, host_key_dir: str = "/etc/ssh", sshd_config_dir: str = "/etc/ssh/sshd_config.d",
          ssh_dir: str = "/root/.ssh", public_key: str | None = None, dns_wait_s: float = DEFAULT_DNS_WAIT_S,
          resolve=_addresses) -> dict:
    """Make this container's ssh trust for the job of ``config`` (resourceconfig.json); returns
    what it made: hosts (name: addresses), addresses, and the files' paths. The entry point passes
    ``dns_wait_s`` from ``SSH_TRUST_DNS_WAIT_S``, read with its other settings."""
    config = config or resourceconfig_path()
    public_key = public_key or os.path.join(ssh_dir, "id_rsa.pub")
    hosts, current = read_hosts(config)
    try:
        with open(public_key) as f:
            key = f.read().strip()
    except OSError as exc:
        raise TrustError(f"expected root's public ssh key at {public_key} (the image makes it), found none ({exc}); "
                         "rebuild the image from docker/Dockerfile") from None
    if not key or "\n" in key:
        raise TrustError(f"expected one public key in {public_key}, found {len(key.splitlines())} lines")
    resolved = resolve_hosts(hosts, dns_wait_s, resolve)
    addresses = sorted({a for found in resolved.values() for a in found},
                       key=lambda a: (ipaddress.ip_address(a).version, ipaddress.ip_address(a)))
    host_key = make_host_key(host_key_dir, current)
    os.makedirs(ssh_dir, mode=0o700, exist_ok=True)
    os.makedirs(sshd_config_dir, exist_ok=True)
    made = {"hosts": resolved, "addresses": addresses, "host_key": host_key,
            "authorized_keys": os.path.join(ssh_dir, "authorized_keys"),
            "sshd_snippet": os.path.join(sshd_config_dir, SNIPPET_NAME),
            "client_hosts": os.path.join(ssh_dir, CLIENT_HOSTS_NAME)}
    _write(made["sshd_snippet"], sshd_snippet_text(host_key, addresses), 0o644)
    _write(made["client_hosts"], client_hosts_text(resolved), 0o600)
    _write(made["authorized_keys"], authorized_keys_text(key, addresses), 0o600)
    return made


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", help="resourceconfig.json (default: $SAGEMAKER_BASE_DIR or /opt/ml, "
                                         "input/config/resourceconfig.json)")
    parser.add_argument("--host-key-dir", default="/etc/ssh")
    parser.add_argument("--sshd-config-dir", default="/etc/ssh/sshd_config.d")
    parser.add_argument("--ssh-dir", default="/root/.ssh", help="root's ssh folder")
    parser.add_argument("--public-key", help="the key to trust (default: SSH_DIR/id_rsa.pub)")
    parser.add_argument("--dns-wait-s", type=float, default=DEFAULT_DNS_WAIT_S,
                        help="how long names may take to resolve (default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        made = setup(args.config, args.host_key_dir, args.sshd_config_dir, args.ssh_dir, args.public_key,
                     args.dns_wait_s)
    except (TrustError, OSError) as exc:
        print(f"ssh_trust: {exc}", file=sys.stderr)
        return 1
    print(f"ssh_trust: root's key accepted from {', '.join(made['addresses'])} only "
          f"({', '.join(made['hosts'])}); host key {made['host_key']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
