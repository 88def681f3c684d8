"""The registered instances' addresses in one spelling: what `/v1/metaserver` recognises an engine by (its
caller, the instance a ticket names), however it is written (an IP address, a name, IPv4 mapped into IPv6).

Only the registered instances' host names are ever resolved: once per worker when the registered set
changes (trigger mode starts it as it hands D a ticket, before D calls back), again after `RESOLVED_FOR_S`,
and after `RECHECK_AFTER_S` when a caller matched nothing (an engine pod restarted with a new address).
Resolution runs in one task at a time that callers share, so no lookup blocks the loop or runs twice, and
the table holds the current set's names alone. What a caller sends is compared, never resolved nor kept:
a name reaches no resolver, and a million distinct ones leave the table as it was.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import time

from config import split_address
from scheduling.registry import Registry, Target, Topology

RESOLVED_FOR_S = 60.0
RECHECK_AFTER_S = 5.0
RESOLVE_TIMEOUT_S = 5.0  # one name's lookup; a name the resolver does not answer for keeps what it had


def normal(address: str) -> str:
    """An IP address in one spelling (an IPv4 address mapped into IPv6 as IPv4); '' for a name."""
    if len(address) > 64:  # longer than an IPv6 address with brackets and a zone id: a caller's, not parsed
        return ""
    try:
        ip = ipaddress.ip_address(address.strip("[]"))
    except ValueError:
        return ""
    mapped = getattr(ip, "ipv4_mapped", None)
    return str(mapped or ip)


def host_port(t: Target) -> tuple[str, str]:
    """A registered endpoint's host as split_address gives it (lowercase, an IPv6 address without brackets),
    and its port."""
    host, port = split_address(t.address)
    return host, str(port)


class InstanceAddresses:
    """This worker's table of the registered instances' hosts and the IP addresses they stand for."""

    __slots__ = ("_task", "_task_version", "by_host", "registry", "resolved_at", "version")

    def __init__(self, registry: Registry):
        self.registry = registry
        self.by_host: dict[str, frozenset[str]] = {}  # registered host -> its addresses (empty: unresolved)
        self.version, self.resolved_at = -1, 0.0  # the registry version the table is of, and when it was made
        self._task: asyncio.Task | None = None
        self._task_version = -1

    def prime(self) -> None:
        """Start resolving the registered set if it changed since the table was made (no wait: the hot path)."""
        view = self.registry.view()
        if view.version != self.version:
            self._resolving(view)

    async def table(self, max_age_s: float = RESOLVED_FOR_S) -> dict[str, frozenset[str]]:
        """The table for the registered set now, made again if older than `max_age_s`."""
        view = self.registry.view()
        if view.version != self.version or time.monotonic() - self.resolved_at >= max_age_s:
            # Shielded: a caller that goes away (a client disconnect cancels it) leaves the lookup to the others.
            await asyncio.shield(self._resolving(view))
        return self.by_host

    async def knows(self, caller: str) -> bool:
        """Is `caller` (the connection's IP address) a registered instance's?"""
        return bool(await self.at(normal(caller), self.registry.view().targets))

    async def at(self, ip: str, targets: list[Target]) -> list[Target]:
        """The `targets` whose registered host stands for `ip` (an IP address as `normal` spells it): an
        instance registered by name, named by its address, or one registered by IPv4 named by IPv6's form."""
        if not ip or not targets:
            return []
        for max_age_s in (RESOLVED_FOR_S, RECHECK_AFTER_S):
            by_host = await self.table(max_age_s)
            found = [t for t in targets if ip in by_host.get(host_port(t)[0], ())]
            if found:
                return found
        return []

    def _resolving(self, view: Topology) -> asyncio.Task:
        """The task making the table of `view` (one at a time per version, shared by every caller)."""
        task = self._task
        if task is None or task.done() or self._task_version != view.version:
            task = self._task = asyncio.get_running_loop().create_task(self._resolve(view))
            self._task_version = view.version
        return task

    async def _resolve(self, view: Topology) -> None:
        hosts = list(dict.fromkeys(host_port(t)[0] for t in view.targets))
        found = await asyncio.gather(*(self._addresses(h) for h in hosts))
        if view.version >= self.version:  # a lookup of an older set that ended late changes nothing
            self.by_host = dict(zip(hosts, found))
            self.version, self.resolved_at = view.version, time.monotonic()

    async def _addresses(self, host: str) -> frozenset[str]:
        ip = normal(host)
        if ip:
            return frozenset((ip,))
        try:
            async with asyncio.timeout(RESOLVE_TIMEOUT_S):
                infos = await asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM)
            return frozenset(normal(info[4][0]) for info in infos)
        except TimeoutError:
            return self.by_host.get(host, frozenset())
        except (OSError, UnicodeError):  # unknown, or not a valid name (an empty or over-long label)
            return frozenset()
