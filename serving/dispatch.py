"""The flows of one inference request: whole (one engine), PD handoff, PD trigger; retries and fallback.

`serve` and the flows that only hand over to `_attempts` (`_whole`, `_count_tokens`, `_prefill`,
`_decode`) are plain functions returning the coroutine to await: every coroutine layer costs a loaded
worker on each resumption and teardown.

Retries happen only before the first byte reaches the client: connect errors, timeouts before the
first byte, and engine 408/429/5xx, each attempt with a fresh engine request id and on another instance
when one exists, backing off from `retry_delay`. After the first byte an error becomes one SSE error
event. Leases on the ledger are released in `finally`, so cancellation (a client disconnect: Sanic
cancels the handler) and errors both give the capacity back; the upstream `async with` blocks close the
engine connections, which aborts the engine requests.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

import ujson

from config import ModelConfig, Settings, split_address
from engines import EngineClient
from errors import (
    ANTHROPIC,
    EngineStatusError,
    Forbidden,
    InvalidRequest,
    NotFound,
    RateLimited,
    ServiceUnavailable,
    UpstreamError,
    UpstreamProtocolError,
    dumps,
)
from scheduling.admission import OverBudget
from scheduling.health import Health
from scheduling.ledger import DECODE, PREFILL, WHOLE
from scheduling.policies import JobInfo
from scheduling.registry import Target
from scheduling.scheduler import NoCapacity, Plan, Scheduler
from scheduling.tokens import (
    CHAT as CHAT_PROMPT,
    COMPLETION as COMPLETION_PROMPT,
    MESSAGES as MESSAGES_PROMPT,
    engine_uncached,
)
from serving.job import CHAT, COMPLETIONS, COUNT_TOKENS, MESSAGES, Job
from serving.legs import PREFILL_TICKET, decode_leg, prefill_body, prefill_leg
from serving.observe import MESSAGE_DELTA, Observer, RequestRecord
from serving.resolve import RECHECK_AFTER_S, RESOLVED_FOR_S, addresses
from serving.usage import (
    NO_CACHED_PROMPT,
    EventSplitter,
    PrefillUsages,
    fix_event,
    fix_events,
    fix_response,
    prefill_usage,
)

T = TypeVar("T")
log = logging.getLogger("coordinator.serving")

_DEFAULT_MODEL = ModelConfig("")  # a model served without a `models` entry has the default limits
MAX_OUTPUT_BUDGET = 1 << 31  # output tokens a request counts for in the ledger (beyond any model's context)
_PROMPT_KINDS = {
    CHAT: CHAT_PROMPT,
    COMPLETIONS: COMPLETION_PROMPT,
    MESSAGES: MESSAGES_PROMPT,
}  # how the scheduler reads a prompt


class Sink(Protocol):
    """Where the client's answer goes; implemented by the HTTP handler."""

    started: bool

    def json(self, status: int, body: bytes) -> None:
        """The whole JSON answer (sent when the handler returns: nothing here waits)."""

    async def start_stream(self) -> None: ...

    async def send(self, data: bytes, last: bool = False) -> None:
        """Relay stream bytes; `last` ends the response with them (one write fewer than a separate end)."""


def _can_pick(repick: Callable[[frozenset[int]], Target], exclude: set[int]) -> bool:
    """Is there an engine to retry on besides the excluded ones?"""
    try:
        repick(frozenset(exclude))
    except NoCapacity:
        return False
    return True


def _refusal(e: NoCapacity | OverBudget, settings: Settings) -> ServiceUnavailable | RateLimited:
    """Why a request gets no plan, as its answer: no usable instance (503) or over the SLO budget (429).

    With no usable instance, the client is told to come back when an open breaker lets a probe through or
    the next health check may have found an engine back.
    """
    if isinstance(e, OverBudget):
        return RateLimited(str(e), retry_after_s=e.retry_after_s, reason="slo_budget")
    return ServiceUnavailable(str(e), retry_after_s=max(settings.breaker_open_s, settings.health_check_interval_s))


class Dispatcher:
    def __init__(
        self,
        settings: Settings,
        scheduler: Scheduler,
        health: Health,
        client: EngineClient,
        observer: Observer,
        prefill_usages: PrefillUsages,
    ):
        self.s = settings
        self.scheduler, self.health, self.client, self.obs = scheduler, health, client, observer
        self.prefill_usages = prefill_usages  # P's usage in trigger mode, between workers
        self._detached: set[asyncio.Task] = set()  # fire-and-forget engine calls, referenced until done
        self.metaserver_url = metaserver_url(settings) if settings.pd_dispatch == "trigger" else ""

    # -- entry points ----------------------------------------------------------------------------

    def job_info(self, job: Job) -> JobInfo:
        model = self.s.model(job.model)
        view = self.scheduler.registry.view()
        if model is None and job.model not in view.model_names:
            raise NotFound(f"The model `{job.model}` does not exist.", param="model")
        limits = model or _DEFAULT_MODEL
        info = JobInfo(
            model=job.model,
            prompt_tokens=0,  # counted by prepare() for the prompt routes
            # The budget a request takes in the shared ledger's int64 counters: a client's 10**30 (which the
            # engine refuses) would wrap them round while the request lives.
            max_tokens=min(job.max_tokens, MAX_OUTPUT_BUDGET),
            slo_ttft_ms=job.slo_ttft_ms or limits.slo_ttft_ms,
            slo_tpot_ms=job.slo_tpot_ms or limits.slo_tpot_ms,
            engine_type="vllm" if job.route in (MESSAGES, COUNT_TOKENS) else None,
        )
        if job.route in _PROMPT_KINDS:
            try:
                self.scheduler.prepare(info, _PROMPT_KINDS[job.route], job.body)
            except RecursionError:  # counting walks the body's nesting, which JSON lets go 1,000 deep
                raise InvalidRequest("the request body is nested too deeply") from None
        return info

    def serve(self, job: Job, sink: Sink, rec: RequestRecord) -> Awaitable[None]:
        """The request's flow, to await. Checks and the first plan happen here, so a refusal raises at once;
        a request let in at once gets its flow's own coroutine, with no layer of this function's."""
        info = self.job_info(job)
        rec.prompt_tokens = info.prompt_tokens
        if job.route in (MESSAGES, COUNT_TOKENS):
            self._require_vllm(job)
        if job.route == COUNT_TOKENS:
            return self._count_tokens(job, info, sink, rec)
        if job.metaserver is not None:
            return self._metaserver(job, info, sink, rec)
        plan = self._first_plan(info)
        if plan is None:
            return self._serve_queued(job, info, sink, rec)
        return self._serve_plan(job, info, plan, sink, rec)

    def _serve_plan(self, job: Job, info: JobInfo, plan: Plan, sink: Sink, rec: RequestRecord) -> Awaitable[None]:
        if plan.disaggregated:
            if job.decode_computes_prompt:  # (see Job): no prefill leg, D alone
                return self._decode(job, info, plan.target, sink, rec, decode_leg(job, None), None, ticket=False)
            # Trigger mode is MindIE's metaserver protocol for OpenAI routes; Messages always use the handoff.
            if self.s.pd_dispatch == "trigger" and job.route != MESSAGES:
                return self._trigger(job, info, plan, sink, rec)
            return self._handoff(job, info, plan, sink, rec)
        return self._whole(job, info, plan.target, sink, rec)

    async def _serve_queued(self, job: Job, info: JobInfo, sink: Sink, rec: RequestRecord) -> None:
        await self._serve_plan(job, info, await self._queued_plan(info), sink, rec)

    # -- planning and retries --------------------------------------------------------------------

    def _require_vllm(self, job: Job) -> None:
        """Anthropic routes exist only on vLLM engines: a model without any is the client's error, not a 5xx."""
        view = self.scheduler.registry.view()
        kinds = {t.engine_type for t in view.targets if t.model == job.model}
        model = self.s.model(job.model)
        if (model and model.engine_type != "vllm") or (kinds and "vllm" not in kinds):
            kind = model.engine_type if model and model.engine_type != "vllm" else "/".join(sorted(kinds))
            raise InvalidRequest(
                f"model `{job.model}` is served by {kind} engines; {job.route} is available only with vLLM engines",
                param="model",
            )

    def _pick_one(self, job: Job, info: JobInfo, roles: tuple[str, ...]) -> Target:
        """The first engine of a single-engine call (count_tokens, metaserver); none left is a 503."""
        try:
            return self.scheduler.pick_one(job.model, info, roles)
        except NoCapacity as e:
            raise _refusal(e, self.s) from None

    def _first_plan(self, info: JobInfo) -> Plan | None:
        """The first plan, if SLO admission (`scheduler_config.admission`) lets the request in now (None: it waits)."""
        try:
            return self.scheduler.try_admit(info)
        except (NoCapacity, OverBudget) as e:
            raise _refusal(e, self.s) from None

    async def _queued_plan(self, info: JobInfo) -> Plan:
        """The first plan after a wait in the admission queue (`scheduler_config.admission: queue`)."""
        try:
            return await self.scheduler.queued(info)
        except (NoCapacity, OverBudget) as e:
            raise _refusal(e, self.s) from None

    def _record(self, target: Target, err: Exception | None) -> None:
        """Feed the breaker: transport errors and 5xx count, 4xx (a prompt too long among them) and 501 do not."""
        if err is None:
            self.health.record_success(target.slot)
        elif isinstance(err, EngineStatusError):
            if not err.relayed:
                self.health.record_failure(target.slot)
            else:
                self.health.record_success(target.slot)
        elif isinstance(err, UpstreamError):
            self.health.record_failure(target.slot)

    async def _attempts(
        self,
        job: Job,
        sink: Sink,
        rec: RequestRecord,
        first: Target,
        repick: Callable[[frozenset[int]], Target],
        call: Callable[[Target, str], Awaitable[T]],
    ) -> T:
        target, attempt, exclude = first, 0, set()
        while True:
            rid = job.request_id if attempt == 0 else f"{job.request_id}-{attempt}"
            self.health.attempt(target.slot)
            try:
                result = await call(target, rid)
            except UpstreamError as e:
                if target.slot not in exclude:  # one request retried on one engine is one failure to its breaker
                    self._record(target, e)
                if not e.retryable or sink.started or attempt >= self.s.max_retry:
                    raise
                failed = target
                exclude.add(target.slot)
                if getattr(e, "retry_after", None) not in (None, "0") and not _can_pick(repick, exclude):
                    raise  # no other engine, and this one asked for time (429/503 with Retry-After): the client waits it
                await asyncio.sleep(self.s.backoff_s(attempt))
                try:
                    target = repick(frozenset(exclude))
                except NoCapacity:
                    try:  # no other instance: the same one again
                        target = repick(frozenset())
                    except NoCapacity:  # (an open breaker): no retry happens, so none is counted
                        raise e from None
                attempt += 1
                rec.retries += 1
                self.obs.retry(job, failed, e)
                continue
            self._record(target, None)
            return result

    # -- whole requests --------------------------------------------------------------------------

    def _whole(
        self, job: Job, info: JobInfo, target: Target, sink: Sink, rec: RequestRecord, retry: bool = True
    ) -> Awaitable[None]:
        def repick(exclude: frozenset[int]) -> Target:
            return self.scheduler.plan(info, exclude, allow_pd=False).target if retry else target

        async def call(t: Target, rid: str) -> None:
            rec.target = t
            lease = self.scheduler.lease(t, info, WHOLE, learn=job.stream)
            try:
                if job.stream:
                    # Whole events only: a keep-alive comment or an error event must never land inside one
                    # that the network cut in two.
                    splitter = EventSplitter()
                    messages = job.route == MESSAGES
                    async with self.client.stream(t.url + job.route, job.raw, rid) as es:
                        async for chunk in es.chunks(self.s.stream_keepalive_interval_s):
                            if not chunk:
                                await self._keepalive(sink)
                                continue
                            if not sink.started:
                                lease.first_token()
                                rec.first_token()
                                await sink.start_stream()
                            block = splitter.complete(chunk)
                            if block:
                                events = block.count(b"data:")
                                lease.events += events
                                rec.events += events
                                if messages and MESSAGE_DELTA in block:
                                    rec.message_delta(block)
                                await sink.send(block, es.finished and not splitter.tail)
                        if splitter.tail.strip():  # the engine ended without the last event's blank line
                            rec.events += splitter.tail.count(b"data:")
                            await sink.send(splitter.tail + b"\n\n")
                    if not sink.started:
                        raise UpstreamProtocolError("engine ended the stream without sending anything", detail=t.url)
                    lease.succeed()
                else:
                    _, data = await self.client.post(t.url + job.route, job.raw, rid, timeout_s=self.s.infer_timeout_s)
                    rec.first_token()
                    lease.succeed()  # the prefix is cached there now, and the prefill was done by now
                    sink.json(200, data)
            finally:
                lease.release()

        return self._attempts(job, sink, rec, target, repick, call)

    def _count_tokens(self, job: Job, info: JobInfo, sink: Sink, rec: RequestRecord) -> Awaitable[None]:
        roles = ("union", "prefill", "decode")

        def repick(exclude: frozenset[int]) -> Target:
            return self.scheduler.pick_one(job.model, info, roles, exclude)

        async def call(t: Target, rid: str) -> None:
            rec.target = t
            _, data = await self.client.post(t.url + job.route, job.raw, rid, timeout_s=self.s.first_token_timeout_s)
            sink.json(200, data)

        return self._attempts(job, sink, rec, self._pick_one(job, info, roles), repick, call)

    # -- disaggregated: handoff ------------------------------------------------------------------

    def _prefill(
        self, job: Job, info: JobInfo, target: Target, sink: Sink, rec: RequestRecord, body: bytes
    ) -> Awaitable[dict]:
        """Run the prefill leg (with retries on other prefill instances); returns P's parsed response."""

        def repick(exclude: frozenset[int]) -> Target:
            plan = self.scheduler.plan(info, exclude)
            if plan.prefill is None:
                raise NoCapacity("no prefill instance left")
            return plan.prefill

        async def call(t: Target, rid: str) -> dict:
            rec.prefill = t
            lease = self.scheduler.lease(t, info, PREFILL)
            started = time.monotonic()
            try:
                _, data = await self.client.post(t.url + job.route, body, rid, timeout_s=self.s.first_token_timeout_s)
                rec.prefill_s = time.monotonic() - started
                try:
                    resp = ujson.loads(data)
                except ValueError:
                    raise UpstreamProtocolError("prefill engine answered invalid JSON", detail=t.url) from None
                if not isinstance(resp, dict):
                    raise UpstreamProtocolError("prefill engine answered a non-object", detail=t.url)
                lease.succeed(engine_uncached(resp.get("usage")))
            finally:
                lease.release()
            return resp

        return self._attempts(job, sink, rec, target, repick, call)

    def _decode(
        self,
        job: Job,
        info: JobInfo,
        target: Target,
        sink: Sink,
        rec: RequestRecord,
        body: bytes,
        p_usage: dict | None,
        ticket: bool = True,
        triggered: bool = False,
    ) -> Awaitable[None]:
        """The decode leg (with retries on other decode instances); `ticket`: `body` carries one (P's, or
        trigger mode's), which a retry after D's 5xx leaves out. `triggered`: P's usage is not known yet (D
        asks for the prefill): it is looked up when D's usage comes."""
        anthropic = job.api == ANTHROPIC

        since_ns = time.monotonic_ns() if triggered else 0  # P's usage is written after this, by D's metaserver call

        def p_counts() -> dict | None:
            """P's usage: given (handoff), or in trigger mode kept by the worker that relayed P's answer to D
            (none of the prompt cached while not found). A D that computed the prompt itself reports its own."""
            nonlocal p_usage
            if p_usage is None and triggered and not recompute:
                p_usage = self.prefill_usages.get(job.request_id, since_ns)
                return p_usage or NO_CACHED_PROMPT
            return p_usage

        def repick(exclude: frozenset[int]) -> Target:
            # Another decode instance: the body carries P's ticket, which only a decode engine may take.
            return self.scheduler.pick_one(job.model, info, ("decode",), exclude)

        recompute = not ticket  # the next attempt leaves P's ticket out (or there is none)

        async def call(t: Target, rid: str) -> None:
            nonlocal body, recompute
            rec.target = t
            if recompute and ticket and not rec.missed_handoff:  # counted when the attempt without the ticket is made
                rec.missed_handoff = True
                self.obs.missed_handoff(job, rec, "a decode engine failed with P's ticket")
            lease = self.scheduler.lease(t, info, DECODE, learn=job.stream)
            started = time.monotonic()
            try:
                if job.stream:
                    splitter = EventSplitter()
                    async with self.client.stream(t.url + job.route, body, rid) as es:
                        async for chunk in es.chunks(self.s.stream_keepalive_interval_s):
                            if not chunk:
                                await self._keepalive(sink)
                                continue
                            if not sink.started:
                                lease.first_token()
                                rec.first_token()
                                await sink.start_stream()
                            block = splitter.complete(chunk)
                            if block:
                                events = block.count(b"data:")
                                lease.events += events
                                rec.events += events
                                block = fix_events(block, p_counts(), anthropic)
                                if anthropic and MESSAGE_DELTA in block:  # the usage the client gets
                                    rec.message_delta(block)
                                await sink.send(block, es.finished and not splitter.tail)
                        if splitter.tail.strip():
                            rec.events += splitter.tail.count(b"data:")
                            await sink.send(fix_event(splitter.tail, p_counts(), anthropic) + b"\n\n")
                    if not sink.started:
                        raise UpstreamProtocolError(
                            "decode engine ended the stream without sending anything", detail=t.url
                        )
                    lease.succeed()
                else:
                    _, data = await self.client.post(t.url + job.route, body, rid, timeout_s=self.s.infer_timeout_s)
                    rec.first_token()
                    try:
                        resp = ujson.loads(data)
                    except ValueError:
                        raise UpstreamProtocolError("decode engine answered invalid JSON", detail=t.url) from None
                    lease.succeed()
                    sink.json(200, dumps(fix_response(resp, p_counts(), anthropic)) if isinstance(resp, dict) else data)
            except EngineStatusError as e:
                # D answered 5xx and may not have been able to take P's KV (P died after answering, or its
                # KV expired): the retry leaves the ticket out and D computes the prompt itself, like a
                # missed handoff. (A body without a ticket is already what the retry would send.)
                if e.status >= 500 and not sink.started and not recompute and not rec.missed_handoff:
                    body = decode_leg(job, None)
                    recompute = True
                raise
            finally:
                lease.release()
                rec.decode_s = time.monotonic() - started

        return self._attempts(job, sink, rec, target, repick, call)

    async def _handoff(self, job: Job, info: JobInfo, plan: Plan, sink: Sink, rec: RequestRecord) -> None:
        hold = self.scheduler.hold(plan.target)  # D's batch counts this request while its prefill runs
        try:
            p_resp = await self._prefill(job, info, plan.prefill, sink, rec, prefill_leg(job))
        finally:
            hold.release()
        ticket = p_resp.get("kv_transfer_params")
        if not isinstance(ticket, dict):
            ticket = None
            rec.missed_handoff = True
            self.obs.missed_handoff(job, rec, "prefill returned no kv_transfer_params")
        try:
            await self._decode(job, info, plan.target, sink, rec, decode_leg(job, ticket), prefill_usage(p_resp))
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
        if not self.s.kv_release_path or p is None or not isinstance(rid, str):
            return
        task = asyncio.get_running_loop().create_task(
            self._post_release(job.request_id, p.url + self.s.kv_release_path, rid)
        )
        self._detached.add(task)
        task.add_done_callback(self._detached.discard)

    async def _post_release(self, request_id: str, url: str, remote_request_id: str) -> None:
        try:
            await self.client.post(
                url, dumps({"remote_request_id": remote_request_id}), request_id, timeout_s=self.s.connect_timeout_s
            )
            log.info("request_id=%s released prefill KV %r at %s", request_id, remote_request_id, url)
        except UpstreamError as e:  # already pulled or expired (404), or P is gone: nothing left to free
            log.info("request_id=%s prefill KV release at %s: %r", request_id, url, str(e))
        except RuntimeError as e:  # the worker is stopping and its engine client is closed
            log.info("request_id=%s prefill KV release at %s skipped: %s", request_id, url, e)

    async def _keepalive(self, sink: Sink) -> None:
        """The engine is silent: an SSE comment keeps proxies and clients from timing the stream out."""
        if sink.started:
            await sink.send(b": keep-alive\n\n")

    # -- disaggregated: trigger ------------------------------------------------------------------

    async def _trigger(self, job: Job, info: JobInfo, plan: Plan, sink: Sink, rec: RequestRecord) -> None:
        """D first: D asks this Coordinator's /v1/metaserver for the prefill on the P named here."""
        p = plan.prefill
        host, port = split_address(p.address)  # an IPv6 host without its brackets
        ticket = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "request_id": job.request_id,
            "remote_engine_id": str(p.instance_id),
            "remote_host": host,
            "remote_port": str(port),
            "metaserver": self.metaserver_url,
        }
        rec.prefill = p
        await self._decode(job, info, plan.target, sink, rec, decode_leg(job, ticket), None, triggered=True)

    async def _metaserver(self, job: Job, info: JobInfo, sink: Sink, rec: RequestRecord) -> None:
        """Forward an engine's metaserver call to the registered instance it names, or one the scheduler picks."""
        ktp = job.metaserver
        role = "prefill" if ktp.get("do_remote_prefill") else "decode"
        target = await self._named_target(job.model, role, ktp)
        if target is None:
            target = self._pick_one(job, info, (role, "union"))
        if role == "prefill":
            ticket = {**PREFILL_TICKET, "request_id": job.request_id}
            job.body = prefill_body(job, ticket)
            job.stream = False
            job.raw = dumps(job.body)
            sink = _UsageKeepingSink(sink, self.prefill_usages, job.request_id)
        await self._whole(job, info, target, sink, rec, retry=False)

    async def _named_target(self, model: str, role: str, ktp: dict) -> Target | None:
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


class _UsageKeepingSink:
    """P's answer to a metaserver prefill on its way back to D: its usage is kept for the client request's
    decode leg, whose worker may be another (PrefillUsages)."""

    def __init__(self, sink: Sink, usages: PrefillUsages, request_id: str):
        self.sink, self.usages, self.request_id = sink, usages, request_id

    @property
    def started(self) -> bool:
        return self.sink.started

    def json(self, status: int, body: bytes) -> None:
        self.usages.put(self.request_id, body)
        self.sink.json(status, body)

    async def start_stream(self) -> None:
        await self.sink.start_stream()

    async def send(self, data: bytes, last: bool = False) -> None:
        await self.sink.send(data, last)


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
