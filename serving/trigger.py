"""Trigger mode (MindIE's metaserver protocol): D first, and D asks this Coordinator for the prefill.

The client request goes to D with a ticket naming P and this Coordinator's /v1/metaserver; D calls
that route, and the call is forwarded to the registered instance it names (or one the scheduler picks,
where it names none). P's answer goes back to D, and its usage is kept for the client request's decode
leg, whose worker may be another (serving/usage.py PrefillUsages), under the ticket's id: random bits
this Coordinator chose, which D's call carries back (`trigger_ticket_id`).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Awaitable
from secrets import token_hex
from urllib.parse import quote

from config import Settings, split_address
from errors import Forbidden, json_bytes
from scheduling.ledger import DECODE, Lease
from scheduling.policies import JobInfo
from scheduling.registry import Target
from scheduling.scheduler import NoCapacity, Plan, Scheduler
from serving.call import Sink, Upstream
from serving.handoff import Handoff
from serving.job import Job
from serving.legs import PREFILL_TICKET, decode_wire, prefill_body
from serving.observe import RequestRecord
from serving.resolve import InstanceAddresses, host_port, normal
from serving.retries import Retries, refusal
from serving.usage import UsageFix
from serving.whole import WholeCall


class KeptPrefillCall(WholeCall):
    """A metaserver call's prefill: P's answer goes back to D, and its usage is kept for the client request's
    decode leg (Upstream.usages)."""

    __slots__ = ()

    def answer(self, data: bytes, lease: Lease) -> None:
        self.up.usages.put(self.job.request_id, data)
        WholeCall.answer(self, data, lease)


class Trigger:
    """The client request's side (`serve`: D with the ticket) and the engine's (`forward`: its metaserver call)."""

    def __init__(
        self, up: Upstream, scheduler: Scheduler, retries: Retries, handoff: Handoff, addresses: InstanceAddresses
    ):
        self.up, self.live, self.scheduler, self.retries, self.handoff = up, up.live, scheduler, retries, handoff
        self.addresses = addresses
        # Made only in trigger mode: it may look up this host's address.
        self.url = metaserver_url(up.live.s) if up.live.s.pd_dispatch == "trigger" else ""

    def serve(self, job: Job, plan: Plan, sink: Sink, rec: RequestRecord) -> Awaitable[None]:
        """D first: D asks this Coordinator's /v1/metaserver for the prefill on the P named here."""
        self.addresses.prime()  # D calls back with P's address: its table is made before that, off this path
        p = plan.prefill
        host, port = split_address(p.address)  # an IPv6 host without its brackets
        ticket_id = trigger_ticket_id(job.request_id)
        ticket = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "request_id": ticket_id,
            "remote_engine_id": str(p.instance_id),
            "remote_host": host,
            "remote_port": str(port),
            "metaserver": self.url if job.cache_salt is None else salted_url(self.url, job.cache_salt),
        }
        rec.prefill = p
        fix = UsageFix.from_trigger(self.up.usages, ticket_id, job.family)
        return self.handoff.decode(job, plan.leg(DECODE, learn=job.stream), sink, rec, decode_wire(job, ticket), fix)

    async def forward(self, job: Job, info: JobInfo, sink: Sink, rec: RequestRecord) -> None:
        """Forward an engine's metaserver call to the registered instance it names, or one the scheduler picks;
        the same engine takes its retries."""
        ktp = job.metaserver
        role = "prefill" if ktp.get("do_remote_prefill") else "decode"
        target = await self._named_target(job.model, role, ktp)
        if role == "prefill":
            ticket = {**PREFILL_TICKET, "request_id": job.request_id}
            job.body = prefill_body(job, ticket)
            job.stream = False
            job.raw = json_bytes(job.body)
        if target is not None:
            leg = self.scheduler.pin(target, info, learn=job.stream)
        else:
            try:
                leg = self.scheduler.pick(info, (role, "union"), pinned=True, learn=job.stream)
            except NoCapacity as e:
                raise refusal(e, self.live.s) from None
        call = (KeptPrefillCall if role == "prefill" else WholeCall)(self.up, job, leg, sink, rec, job.raw)
        await self.retries.run(call)

    async def _named_target(self, model: str, role: str, ktp: dict) -> Target | None:
        """The registered instance of `model` (role `role` or union) the ticket names by host and port, or by
        engine id; None when it names none. One named but not registered is refused (Forbidden).

        The host matches in the registered spelling, or as an IP address a registered name resolved to (the
        address an engine reports, where the deployer registered it by name; IPv4 mapped into IPv6); a name
        other than a registered one names none (what a caller sends is never resolved)."""
        host, port, engine_id = ktp.get("remote_host"), ktp.get("remote_port"), ktp.get("remote_engine_id")
        if host in (None, "") and engine_id in (None, ""):
            return None
        view = self.scheduler.registry.view()
        allowed = [t for t in view.targets if t.model == model and t.role in (role, "union")]
        bare = host.strip("[]").lower() if isinstance(host, str) else ""
        by_id = [t for t in allowed if engine_id not in (None, "") and str(t.instance_id) == str(engine_id)]
        if not bare:
            if by_id:
                return by_id[0]
        else:
            # The same engine: at the port named, or the instance named by id; at the port first.
            same = sorted(
                (t for t in allowed if host_port(t)[1] == str(port) or t in by_id),
                key=lambda t: host_port(t)[1] != str(port),
            )
            spelled = [t for t in same if host_port(t)[0] == bare]
            found = spelled or await self.addresses.at(normal(bare), same)
            if found:
                return found[0]
        raise Forbidden(
            f"metaserver target {shown(host)}:{shown(port)} (engine {shown(engine_id)}) is not a registered {role}"
            f" instance of model {shown(model)!r}"
        )


def trigger_ticket_id(request_id: str) -> str:
    """The id of D's ticket, which D's metaserver call carries back and P's usage is kept under: the client's
    request id (its start, for the logs) and 128 bits only this Coordinator chose, from the OS (request ids
    come from a generator whose state their outputs give away). Clients choose their request ids and may
    send one twice at once: keyed by it, each would be billed the other's prompt."""
    return f"{request_id[:64]}.{token_hex(16)}"


SHOWN_CHARS = 256


def shown(value: object) -> str:
    """A caller's value as an answer or a log line may show it: its first SHOWN_CHARS characters, and how
    many more there were (a 1 MB host name is not echoed whole into each 403 and its log line)."""
    text = str(value)
    return text if len(text) <= SHOWN_CHARS else f"{text[:SHOWN_CHARS]}...[{len(text) - SHOWN_CHARS} more characters]"


def salted_url(url: str, salt: str) -> str:
    """The metaserver URL of a tenant's ticket: D calls it as it is, and its query gives P's leg the request's
    `cache_salt` (D's call is the engine's own rewrite of the body, which need not carry it)."""
    return f"{url}{'&' if '?' in url else '?'}cache_salt={quote(salt, safe='')}"


def metaserver_url(s: Settings) -> str:
    """Where decode engines call back in trigger mode: cluster_config.metaserver_url, else an address of this host
    that they can reach."""
    if s.cluster.metaserver_url:
        return s.cluster.metaserver_url
    host = s.host
    if host in ("0.0.0.0", "::"):
        # Listening on every interface (as in Kubernetes, where the deployer binds 0.0.0.0): the pod's own
        # address, which the manifest gives as POD_IP, else the host name's; loopback only when neither is
        # known (engines on this host alone can call it then).
        host = os.environ.get("POD_IP") or _own_address() or "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    scheme = "https" if s.infer_tls.enable_tls else "http"
    return f"{scheme}://{host}:{s.infer_port}/v1/metaserver"


def _own_address() -> str:
    """This host's address by its name; '' if the name does not resolve."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return ""
