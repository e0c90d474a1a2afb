"""Which host each rank of a group runs on, by the addresses gloo's errors show.

Gloo names a peer whose connection closed by its socket address alone (``[10.0.3.7]:41829``).
Ranks on this machine are named by LocalPeers (their processes can be looked at); a peer on
another host can only be recognised by its address. Each rank appends its host's name and
addresses to one store key before the group's rendezvous, and reads the key once after it (one
read per rank, however many ranks: the store may be gone by the time a peer fails, since it
may have lived in the failed rank's process).
"""

from __future__ import annotations

import fcntl
import ipaddress
import re
import socket
import struct

from .. import sagemaker_host

_KEY = "peer_hosts"
_SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address
# gloo's "[address]:port" in a pair's error text
_ADDRESS_IN_ERROR = re.compile(r"\[([0-9A-Fa-f.:%\w]+)\]:\d+")


def host_addresses() -> list[str]:
    """This host's IPv4 addresses on every interface, and what its name resolves to, loopback
    left out (every host has the same loopback addresses)."""
    found = set()
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            try:
                packed = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
            except OSError:  # an interface without an IPv4 address
                continue
            found.add(socket.inet_ntoa(packed[20:24]))
    try:
        named = [str(info[4][0]) for info in socket.getaddrinfo(socket.gethostname(), None)]
    except OSError:  # a name the resolver does not know: the interfaces' addresses are all there is
        named = []
    return sorted(a for a in found.union(named) if not ipaddress.ip_address(a.split("%")[0]).is_loopback)


class PeerHosts:
    """Made (which publishes this rank's host) before the group's rendezvous, ``learn`` after it;
    then ``named_in`` says which ranks a gloo error's address belongs to."""

    def __init__(self, store, shown_rank: int) -> None:
        self._store = store
        self._hosts: dict[int, tuple[str, set[str]]] = {}
        store.append(_KEY, f"{shown_rank} {sagemaker_host.current_host() or socket.gethostname()} {','.join(host_addresses())};")

    def learn(self) -> None:
        for entry in self._store.get(_KEY).decode().split(";"):
            if entry:
                rank, host, addresses = (entry.split(" ") + [""])[:3]
                self._hosts[int(rank)] = (host, set(filter(None, addresses.split(","))))

    def named_in(self, error_text: str) -> tuple[list[int], str] | None:
        """The ranks on the host whose address ``error_text`` shows, and that host's name; None
        where it shows none, or one no rank published."""
        match = _ADDRESS_IN_ERROR.search(error_text)
        if match is None:
            return None
        ranks = sorted(r for r, (_, addresses) in self._hosts.items() if match.group(1) in addresses)
        return (ranks, self._hosts[ranks[0]][0]) if ranks else None
