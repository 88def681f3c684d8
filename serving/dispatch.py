"""The Dispatcher: which flow serves an inference request, and the plan it starts from.

Flows, by concern: whole.py (one engine, count_tokens), handoff.py (PD: P's ticket to D), trigger.py (PD
with D first, and the metaserver calls D makes), each leg tried by retries.py, every stream relayed by
relay.py. The scheduler places each leg once (scheduling.scheduler.Leg); the leg leases its engine and
re-picks one for a retry.

`serve` and the flows that only hand over return the coroutine to await instead of awaiting it: every
coroutine layer costs a loaded worker on each resumption and teardown.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import TYPE_CHECKING

from config import Live, ModelConfig
from engines import EngineClient
from errors import InvalidRequest, NotFound, clip
from scheduling.admission import OverBudget
from scheduling.health import Health
from scheduling.ledger import WHOLE
from scheduling.policies import JobInfo
from scheduling.scheduler import NoCapacity, Plan, Scheduler
from serving.call import Sink, Upstream
from serving.handoff import Handoff
from serving.job import Job
from serving.observe import DECODE_ALONE, PD, WHOLE_PLACEMENT, Observer, RequestRecord
from serving.resolve import InstanceAddresses
from serving.responses import StoredResponses
from serving.retries import Retries, refusal
from serving.trigger import Trigger
from serving.usage import PrefillUsages
from serving.whole import OneEngineCall, WholeCall
from state.response_homes import ResponseHomes

if TYPE_CHECKING:  # imported only when tracing is on (it loads the OpenTelemetry SDK)
    from serving.tracing import Tracing

_DEFAULT_MODEL = ModelConfig("")  # a model served without a `models` entry has the default limits
MAX_OUTPUT_BUDGET = 1 << 31  # output tokens a request counts for in the ledger (beyond any model's context)
_COUNT_ROLES = ("union", "prefill", "decode")  # any engine of the model counts or tokenizes a prompt


class Dispatcher:
    """What the HTTP handler calls: `serve` one inference request (a Job) to its sink; `job_info` is what
    the scheduler reads of it."""

    def __init__(
        self,
        live: Live,
        scheduler: Scheduler,
        health: Health,
        client: EngineClient,
        observer: Observer,
        prefill_usages: PrefillUsages,
        response_homes: ResponseHomes,
    ):
        self.live, self.scheduler = live, scheduler
        self.up = Upstream(client, live, observer, prefill_usages)
        self.retries = Retries(live, health, observer)
        self.handoff = Handoff(self.up, self.retries)
        # The registered instances' addresses, which /v1/metaserver knows engines by (its handler asks too).
        self.addresses = InstanceAddresses(scheduler.registry)
        self.trigger = Trigger(self.up, scheduler, self.retries, self.handoff, self.addresses)
        self.responses = StoredResponses(response_homes, scheduler, self.up, self.retries)
        self.tracing: Tracing | None = None

    def trace(self, tracing: Tracing) -> None:
        """Tracing on (tracer_config): the admission queue's waits and every engine attempt become spans."""
        self.tracing = self.retries.tracing = tracing

    # -- entry points ----------------------------------------------------------------------------

    def job_info(self, job: Job) -> tuple[JobInfo, Awaitable[None] | None]:
        """What the scheduler reads of the request, and what to await before planning it (its exact token
        count, made off the loop: Scheduler.prepare), or None."""
        limits, family = self.live.s.model(job.model) or _DEFAULT_MODEL, job.family
        info = JobInfo(
            model=job.model,
            prompt_tokens=0,  # counted by prepare() for the prompt routes
            # The budget a request takes in the shared ledger's int64 counters: a client's 10**30 (which the
            # engine refuses) would wrap them round while the request lives.
            max_tokens=min(job.max_tokens, MAX_OUTPUT_BUDGET),
            slo_ttft_ms=job.slo_ttft_ms or limits.slo_ttft_ms,
            slo_tpot_ms=job.slo_tpot_ms or limits.slo_tpot_ms,
            engine_type="vllm" if family.vllm_only else None,
            priority=job.priority,
            teaches=job.stream,
            tenant=job.tenant,
            weight=job.weight,
        )
        exact = None
        if family.prompt_kind is not None:  # how the scheduler reads its prompt
            try:
                exact = self.scheduler.prepare(info, family.prompt_kind, job.prompt_body, job.salt)
            except RecursionError:  # counting walks the body's nesting, which JSON lets go 1,000 deep
                raise InvalidRequest("the request body is nested too deeply") from None
        return info, exact

    def check(self, job: Job, rec: RequestRecord) -> None:
        """The client's errors its model makes (none named where one is needed, one not served, a vLLM-only route
        on other engines), raised before admission: they cost its tenant's quota nothing."""
        if not job.model:  # a /tokenize or /detokenize body may name none, as vLLM's: the one model served
            job.model = rec.model = self._only_model()
        if self.live.s.model(job.model) is None and job.model not in self.scheduler.registry.view().model_names:
            raise NotFound(f"The model `{clip(job.model)}` does not exist.", param="model")
        if job.family.vllm_only:
            self._require_vllm(job)

    def serve(self, job: Job, sink: Sink, rec: RequestRecord) -> Awaitable[None]:
        """The request's flow, to await (`check` has passed). The first plan happens here, so a refusal raises at
        once; a request let in at once gets its flow's own coroutine, with no layer of this function's."""
        info, exact = self.job_info(job)
        if exact is not None:
            return self._serve_counted(exact, job, info, sink, rec)
        return self._serve_info(job, info, sink, rec)

    async def _serve_counted(self, exact: Awaitable[None], job: Job, info: JobInfo, sink: Sink, rec: RequestRecord):
        """Planned once the prompt's exact count is in (or its bound has passed)."""
        await exact
        await self._serve_info(job, info, sink, rec)

    def _serve_info(self, job: Job, info: JobInfo, sink: Sink, rec: RequestRecord) -> Awaitable[None]:
        rec.prompt_tokens, family = info.prompt_tokens, job.family
        if info.kv_predicted:  # the engines' KV events predict its cached tokens: the line says how well
            rec.info = info
        if family.counts_only:
            try:
                leg = self.scheduler.pick(info, _COUNT_ROLES)
            except NoCapacity as e:
                raise refusal(e, self.live.s) from None
            return self.retries.run(OneEngineCall(self.up, job, leg, sink, rec, job.raw))
        if job.metaserver is not None:
            return self.trigger.forward(job, info, sink, rec)
        if family.stored and job.request.previous_response_id is not None:
            return self.responses.continue_on(job, info, sink, rec)
        try:
            plan = self.scheduler.try_admit(info)  # None: SLO admission (`scheduler_config.admission`) makes it wait
        except (NoCapacity, OverBudget) as e:
            raise refusal(e, self.live.s) from None
        if plan is None:
            return self._serve_queued(job, info, sink, rec)
        return self._serve_plan(job, plan, sink, rec)

    def _serve_plan(self, job: Job, plan: Plan, sink: Sink, rec: RequestRecord) -> Awaitable[None]:
        if job.family.stored:  # remembered where it is served (serving/responses.py)
            return self.responses.recorded(job, plan.target, self._flow(job, plan, sink, rec), rec)
        return self._flow(job, plan, sink, rec)

    def _flow(self, job: Job, plan: Plan, sink: Sink, rec: RequestRecord) -> Awaitable[None]:
        if plan.disaggregated:
            # D alone, no prefill leg: a request the handoff cannot serve (see Job), or one the scheduler
            # predicts sooner there (conditional disaggregation)
            if job.decode_computes_prompt or plan.alone:
                rec.placement = DECODE_ALONE
                return self.handoff.decode_alone(job, plan, sink, rec)
            rec.placement = PD
            # Trigger mode is MindIE's metaserver protocol, for the families it serves; the others use the handoff.
            if self.live.s.pd_dispatch == "trigger" and job.family.trigger:
                return self.trigger.serve(job, plan, sink, rec)
            return self.handoff.serve(job, plan, sink, rec)
        rec.placement = WHOLE_PLACEMENT
        return self.retries.run(WholeCall(self.up, job, plan.leg(WHOLE, learn=job.stream), sink, rec, job.raw))

    async def _serve_queued(self, job: Job, info: JobInfo, sink: Sink, rec: RequestRecord) -> None:
        """The first plan after a wait in the admission queue (`scheduler_config.admission: queue`)."""
        try:
            wait = self.scheduler.queued(info)
            plan = await (wait if self.tracing is None else self.tracing.queued(wait))
        except (NoCapacity, OverBudget) as e:
            raise refusal(e, self.live.s) from None
        await self._serve_plan(job, plan, sink, rec)

    # -- checks --------------------------------------------------------------------------------------

    def _only_model(self) -> str:
        models = self.scheduler.registry.view().models()
        if len(models) != 1:
            raise InvalidRequest(f"'model' is required: {len(models)} models are served here", param="model")
        return models[0]

    def _require_vllm(self, job: Job) -> None:
        """Anthropic routes and vLLM's own (/tokenize) exist only on vLLM engines: a model without any is the
        client's error, not a 5xx."""
        view = self.scheduler.registry.view()
        kinds = {t.engine_type for t in view.targets if t.model == job.model}
        model = self.live.s.model(job.model)
        if (model and model.engine_type != "vllm") or (kinds and "vllm" not in kinds):
            kind = model.engine_type if model and model.engine_type != "vllm" else "/".join(sorted(kinds))
            raise InvalidRequest(
                f"model `{job.model}` is served by {kind} engines; {job.family.route} is available only with vLLM engines",
                param="model",
            )
