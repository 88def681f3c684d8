"""The PD handoff: P prefills the prompt and answers a ticket for its KV, D takes the ticket and generates.

The ticket is vLLM's `kv_transfer_params` (serving/legs.py): P's answer names the KV blocks it holds
for this request, and D's body carries them so that D pulls the KV instead of computing the prompt.
While P prefills, D's batch counts the request (a hold). P without a ticket, or D failing with one, is
a missed handoff: D computes the prompt itself. KV that no D will pull is released on P where the engine
has a route for it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable

from engines import Body
from errors import EngineStatusError, UpstreamError, UpstreamProtocolError, json_bytes
from scheduling.ledger import DECODE, PREFILL, Lease
from scheduling.registry import Target
from scheduling.scheduler import Leg, Plan
from scheduling.tokens import engine_cached, engine_prompt, engine_uncached
from serving.call import Call, Sink, Upstream
from serving.job import Job
from serving.legs import decode_wire, engine_body, prefill_wire
from serving.observe import RequestRecord, log_value
from serving.relay import relay
from serving.retries import Retries
from serving.usage import UsageFix, prefill_usage

log = logging.getLogger("coordinator.serving")


class PrefillCall(Call[dict]):
    """The prefill leg (`body`: serving/legs.py's prefill body); its result is P's parsed answer."""

    __slots__ = ()
    engine = "prefill engine"

    async def attempt(self, rid: str) -> dict:
        t, rec, up = self.leg.target, self.rec, self.up
        rec.prefill = t
        lease = self.leg.lease()
        started = time.monotonic()
        try:
            _, data = await up.client.post(
                t.url + self.job.family.route,
                engine_body(self.body, self.job, t),
                rid,
                timeout_s=up.live.s.first_token_timeout_s,
            )
            rec.prefill_s = time.monotonic() - started
            resp = self.parsed(data)
            if not isinstance(resp, dict):
                raise UpstreamProtocolError("prefill engine answered a non-object", detail=t.url)
            usage = resp.get("usage")
            lease.succeed(engine_uncached(usage))
            cached = engine_cached(usage)  # (from the usage parsed here, not another search of P's answer)
            if cached >= 0:
                rec.cached_tokens = cached
            self.leg.calibrate(engine_prompt(usage))  # P counted the whole prompt: the model's estimate learns
        finally:
            lease.release()
        return resp


class DecodeCall(Call[None]):
    """The decode leg: `body` is the client's with a ticket (P's, or trigger mode's) when `ticket`, and `fix`
    makes D's answer fit for the client. A retry after D's 5xx leaves the ticket out (`failed`)."""

    __slots__ = ("fix", "recompute", "ticket")
    engine = "decode engine"

    def __init__(
        self, up: Upstream, job: Job, leg: Leg, sink: Sink, rec: RequestRecord, body: Body, fix: UsageFix, ticket: bool
    ):
        Call.__init__(self, up, job, leg, sink, rec, body)
        self.fix, self.ticket = fix, ticket
        self.recompute = not ticket  # the next try leaves P's ticket out (or there is none)

    def attempt(self, rid: str) -> Awaitable[None]:
        rec = self.rec
        rec.target = self.leg.target
        if self.recompute and self.ticket and not rec.missed_handoff:  # counted when the try without it is made
            rec.missed_handoff = True
            self.up.obs.missed_handoff(self.job, rec, "a decode engine failed with P's ticket")
        if self.job.stream:
            return relay(self, rid, self.fix, self.continuation())
        return self.exchange(rid)

    def answer(self, data: bytes, lease: Lease) -> None:
        resp = self.parsed(data)
        lease.succeed()
        if self.fix.own_counts and isinstance(resp, dict):  # D computed the prompt itself
            self.leg.calibrate(engine_prompt(resp.get("usage")))
        self.sink.json(200, json_bytes(self.fix.response(resp)) if isinstance(resp, dict) else data)

    def failed(self, err: UpstreamError) -> None:
        # D answered 5xx and may not have been able to take P's KV (P died after answering, or its KV
        # expired): the retry leaves the ticket out and D computes the prompt itself, like a missed
        # handoff. (A body without a ticket is already what the retry would send.)
        if (
            isinstance(err, EngineStatusError)
            and err.status >= 500
            and not self.sink.started
            and not self.recompute
            and not self.rec.missed_handoff
        ):
            self.body = decode_wire(self.job, None)
            self.recompute = True
            self.fix.own_prompt()


class Handoff:
    """The handoff flow (`serve`), and the decode leg that trigger mode and D-only requests use too (`decode`)."""

    def __init__(self, up: Upstream, retries: Retries):
        self.up, self.live, self.retries = up, up.live, retries
        self._detached: set[asyncio.Task] = set()  # fire-and-forget KV releases, referenced until done

    def decode(
        self, job: Job, leg: Leg, sink: Sink, rec: RequestRecord, body: Body, fix: UsageFix, ticket: bool = True
    ) -> Awaitable[None]:
        """The decode leg, with retries on other decode instances (see DecodeCall)."""
        return self.retries.run(DecodeCall(self.up, job, leg, sink, rec, body, fix, ticket))

    def decode_alone(self, job: Job, plan: Plan, sink: Sink, rec: RequestRecord) -> Awaitable[None]:
        """A request that the handoff cannot serve (Job.decode_computes_prompt): D alone, no ticket."""
        leg, fix = plan.leg(DECODE, learn=job.stream), UsageFix(None, job.family)
        return self.decode(job, leg, sink, rec, decode_wire(job, None), fix, ticket=False)

    async def serve(self, job: Job, plan: Plan, sink: Sink, rec: RequestRecord) -> None:
        d_leg = plan.leg(DECODE, learn=job.stream)
        hold = d_leg.hold()  # D's batch counts this request while its prefill runs
        try:
            call = PrefillCall(self.up, job, plan.leg(PREFILL), sink, rec, prefill_wire(job))
            p_resp = await self.retries.run(call)
        finally:
            hold.release()
        ticket = p_resp.get("kv_transfer_params")
        if not isinstance(ticket, dict):
            ticket = None
            rec.missed_handoff = True
            self.up.obs.missed_handoff(job, rec, "prefill returned no kv_transfer_params")
        fix = UsageFix(prefill_usage(p_resp), job.family)
        try:
            await self.decode(job, d_leg, sink, rec, decode_wire(job, ticket), fix)
        except BaseException:  # an error or a client disconnect (cancellation) before D took the KV
            if ticket is not None and rec.ttft_s is None:
                self._release_kv(job, rec.prefill, ticket)
            raise
        if ticket is not None and rec.missed_handoff:  # D recomputed the prompt: nobody takes the KV now
            self._release_kv(job, rec.prefill, ticket)

    def _release_kv(self, job: Job, p: Target | None, ticket: dict) -> None:
        """Free the KV blocks P holds for a decode leg that will never pull them.

        Only engines with a release route (`exception_config.kv_release_path`, e.g. engine_sim's
        `/sim/kv/release`) can be told; vLLM has none and frees the blocks after its
        VLLM_NIXL_ABORT_REQUEST_TIMEOUT. Runs detached: the request may be ending by cancellation.
        """
        rid = ticket.get("remote_request_id")
        if not self.live.s.kv_release_path or p is None or not isinstance(rid, str):
            return
        task = asyncio.get_running_loop().create_task(
            self._post_release(job.request_id, p.url + self.live.s.kv_release_path, rid)
        )
        self._detached.add(task)
        task.add_done_callback(self._detached.discard)

    async def _post_release(self, request_id: str, url: str, remote_request_id: str) -> None:
        try:
            await self.up.client.post(
                url,
                json_bytes({"remote_request_id": remote_request_id}),
                request_id,
                timeout_s=self.live.s.connect_timeout_s,
            )
            log.info("request_id=%s released prefill KV %s at %s", log_value(request_id), remote_request_id, url)
        except UpstreamError as e:  # already pulled or expired (404), or P is gone: nothing left to free
            log.info("request_id=%s prefill KV release at %s: %s", log_value(request_id), url, log_value(str(e)))
        except RuntimeError as e:  # the worker is stopping and its engine client is closed
            log.info("request_id=%s prefill KV release at %s skipped: %s", log_value(request_id), url, e)
