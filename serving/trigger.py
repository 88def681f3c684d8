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

from config import Settings, split_address
from errors import ANTHROPIC, Forbidden, dumps
from scheduling.ledger import DECODE, Lease
from scheduling.policies import JobInfo
from scheduling.registry import Target
from scheduling.scheduler import NoCapacity, Plan, Scheduler
from serving.call import Sink, Upstream
from serving.handoff import Handoff
from serving.job import Job
from serving.legs import PREFILL_TICKET, decode_leg, prefill_body
from serving.observe import RequestRecord
from serving.resolve import RECHECK_AFTER_S, RESOLVED_FOR_S, addresses
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

    def __init__(self, up: Upstream, scheduler: Scheduler, retries: Retries, handoff: Handoff):
        self.up, self.s, self.scheduler, self.retries, self.handoff = up, up.settings, scheduler, retries, handoff
        # Made only in trigger mode: it may look up this host's address.
        self.url = metaserver_url(self.s) if self.s.pd_dispatch == "trigger" else ""

    def serve(self, job: Job, plan: Plan, sink: Sink, rec: RequestRecord) -> Awaitable[None]:
        """D first: D asks this Coordinator's /v1/metaserver for the prefill on the P named here."""
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
            "metaserver": self.url,
        }
        rec.prefill = p
        fix = UsageFix.from_trigger(self.up.usages, ticket_id, job.api == ANTHROPIC)
        return self.handoff.decode(job, plan.leg(DECODE, learn=job.stream), sink, rec, decode_leg(job, ticket), fix)

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
            job.raw = dumps(job.body)
        if target is not None:
            leg = self.scheduler.pin(target, info, learn=job.stream)
        else:
            try:
                leg = self.scheduler.pick(info, (role, "union"), pinned=True, learn=job.stream)
            except NoCapacity as e:
                raise refusal(e, self.s) from None
        call = (KeptPrefillCall if role == "prefill" else WholeCall)(self.up, job, leg, sink, rec, job.raw)
        await self.retries.run(call)

    async def _named_target(self, model: str, role: str, ktp: dict) -> Target | None:
        """The registered instance of `model` (role `role` or union) the ticket names by host and port, or by
        engine id; None when it names none. One named but not registered is refused (Forbidden)."""
        host, port, engine_id = ktp.get("remote_host"), ktp.get("remote_port"), ktp.get("remote_engine_id")
        if host in (None, "") and engine_id in (None, ""):
            return None
        view = self.scheduler.registry.view()
        allowed = [t for t in view.targets if t.model == model and t.role in (role, "union")]
        # Hosts compared as split_address gives them: lowercase, an IPv6 address without its brackets.
        named = [(t, h, str(p)) for t in allowed for h, p in [split_address(t.address)]]  # (target, host, port)
        bare = host.strip("[]").lower() if isinstance(host, str) else host
        for t, t_host, t_port in named:
            if bare not in (None, "") and (t_host, t_port) == (bare, str(port)):
                return t
        for t, t_host, _ in named:
            if engine_id not in (None, "") and str(t.instance_id) == str(engine_id) and bare in (None, "", t_host):
                return t
        if host not in (None, "") and isinstance(host, str):
            # The same engine in another spelling: by its IP address where it is registered by name (or the
            # reverse, or IPv4 mapped into IPv6).
            for max_age_s in (RESOLVED_FOR_S, RECHECK_AFTER_S):
                wanted = await addresses(host, max_age_s)
                for t, t_host, t_port in named if wanted else ():
                    same_engine = t_port == str(port) or (
                        engine_id not in (None, "") and str(t.instance_id) == str(engine_id)
                    )
                    if same_engine and wanted & await addresses(t_host, max_age_s):
                        return t
        raise Forbidden(
            f"metaserver target {host}:{port} (engine {engine_id}) is not a registered {role} instance of model {model!r}"
        )


def trigger_ticket_id(request_id: str) -> str:
    """The id of D's ticket, which D's metaserver call carries back and P's usage is kept under: the client's
    request id (its start, for the logs) and 128 bits only this Coordinator chose, from the OS (request ids
    come from a generator whose state their outputs give away). Clients choose their request ids and may
    send one twice at once: keyed by it, each would be billed the other's prompt."""
    return f"{request_id[:64]}.{token_hex(16)}"


def metaserver_url(s: Settings) -> str:
    """Where decode engines call back in trigger mode: an address of this host that they can reach."""
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
