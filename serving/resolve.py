"""Engine host names and addresses compared in one spelling: what `/v1/metaserver` needs to recognise an
engine (its caller, the instance it names) however it is written (an IP address, a name, IPv4 mapped into
IPv6). Names are resolved without blocking and cached per worker for `RESOLVED_FOR_S`; a caller of a
lookup that found no match may ask again with `RECHECK_AFTER_S` (an engine pod restarted with a new
address).
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import time

RESOLVED_FOR_S = 60.0
RECHECK_AFTER_S = 5.0
_resolved: dict[str, tuple[float, frozenset[str]]] = {}  # per worker: host name -> (when, its addresses)


def normal(address: str) -> str:
    """An IP address in one spelling (an IPv4 address mapped into IPv6 as IPv4); '' for a name."""
    try:
        ip = ipaddress.ip_address(address.strip("[]"))
    except ValueError:
        return ""
    mapped = getattr(ip, "ipv4_mapped", None)
    return str(mapped or ip)


async def addresses(host: str, max_age_s: float = RESOLVED_FOR_S) -> frozenset[str]:
    """The IP addresses `host` (an IP address or a name) stands for; empty for a name that does not resolve."""
    ip = normal(host)
    if ip:
        return frozenset((ip,))
    now = time.monotonic()
    cached = _resolved.get(host)
    if cached is not None and now - cached[0] < max_age_s:
        return cached[1]
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM)
        found = frozenset(normal(info[4][0]) for info in infos)
    except (OSError, UnicodeError):  # unknown, or not a valid name (an empty or over-long label)
        found = frozenset()
    _resolved[host] = (now, found)
    return found
