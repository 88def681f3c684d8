"""Stored Responses API responses behind the Coordinator: which engine holds each one, and the calls that must
go there.

vLLM keeps a stored response (`store`, the default, on an engine started with VLLM_ENABLE_RESPONSES_API_STORE=1)
in the memory of the instance that served it, and only that instance can continue it or answer for it. So a
stored request's response id (serving/job.py gives every request one of the Coordinator's: a client's
`request_id` is not kept, so no client names, or overwrites, another's response) is remembered, with the tenant
that owns it (to every other tenant it does not exist), with the engine that
serves it (`ResponseHomes`: state/response_homes.py), from the moment its leg is planned (a client's
follow-up may come as soon as the last event is out); a retry elsewhere moves it, a request that fails
forgets it. A follow-up turn (`previous_response_id`) is served whole by that engine: for a PD model that is
its decode instance, which computes the new prompt itself (the conversation so far is in its prefix cache,
and no other engine has it), so it skips the prefill leg and placement. GET, DELETE and cancel are relayed
to it as it answers them. An id the Coordinator never served, has evicted or forgot, or whose instance is no
longer registered, is a 404 here, rather than another instance's answer.

vLLM 0.32 has no DELETE route (it answers 405): then the Coordinator forgets the id (later calls get its
404) and answers OpenAI's deletion object, though the engine keeps the response in memory (vLLM never frees
stored responses).
"""

from __future__ import annotations

from collections.abc import Awaitable
from urllib.parse import parse_qsl, quote

from errors import InvalidRequest, NotFound, clip, json_bytes
from scheduling.policies import JobInfo
from scheduling.registry import Target
from scheduling.scheduler import Scheduler
from serving.call import Sink, Upstream
from serving.families import RESPONSES
from serving.job import Job
from serving.observe import RequestRecord
from serving.retries import Retries
from serving.whole import WholeCall
from state.response_homes import ResponseHomes
from state.shared import tenant_hash

NO_DELETE_ROUTE = 405  # vLLM 0.32's answer to DELETE /v1/responses/{id}
# The values of a query's `stream` that say no: pydantic's false spellings (vLLM's FastAPI reads the parameter as a
# bool), and a blank one.
_NOT_STREAMED = frozenset(("", "0", "f", "false", "n", "no", "off"))


def asks_for_stream(query: str) -> bool:
    """Whether a query has a `stream` parameter that is not a plain no, read as engines read a query (percent- and
    plus-decoded). Its name is matched in any case: vLLM matches `stream` exactly, but a refusal of `STREAM=true`
    costs a client nothing it could have had, and depends on no engine's parser."""
    return any(
        k.strip().lower() == "stream" and v.strip().lower() not in _NOT_STREAMED
        for k, v in parse_qsl(query, keep_blank_values=True)
    )


class StoredResponses:
    """Where stored responses are (`homes`), the follow-up turn's flow, and the calls about a stored response."""

    def __init__(self, homes: ResponseHomes, scheduler: Scheduler, up: Upstream, retries: Retries):
        self.homes, self.scheduler, self.up, self.retries = homes, scheduler, up, retries

    def home(self, response_id: str, param: str, tenant: str) -> Target:
        """The engine holding `response_id`, or the 404 (`param`: the field that named it); another tenant's
        response is not found, as one never served."""
        where = self.homes.home(response_id, tenant_hash(tenant))
        why = "this Coordinator did not serve it to you, or no longer remembers it"
        if where is not None:
            for t in self.scheduler.registry.view().targets:
                if (t.instance_id, t.endpoint_id) == where:
                    return t
            why = "the instance that served it is no longer registered"
        raise NotFound(f"Response with id '{clip(response_id)}' not found: {why}.", param=param, code="not_found")

    def continue_on(self, job: Job, info: JobInfo, sink: Sink, rec: RequestRecord) -> Awaitable[None]:
        """A follow-up turn: the whole request on the engine that holds the previous response."""
        target = self.home(job.request.previous_response_id, "previous_response_id", job.tenant)
        info.prompt_bytes = 0  # the engine's prompt holds the stored conversation too: its count teaches nothing
        call = WholeCall(self.up, job, self.scheduler.pin(target, info, learn=job.stream), sink, rec, job.raw)
        return self.recorded(job, target, self.retries.run(call), rec)

    def recorded(self, job: Job, target: Target, flow: Awaitable[None], rec: RequestRecord) -> Awaitable[None]:
        """`flow` (serving `job` on `target` first), its response remembered where it is served when stored."""
        return self._recorded(job, target, flow, rec) if job.request.stored else flow

    async def _recorded(self, job: Job, target: Target, flow: Awaitable[None], rec: RequestRecord) -> None:
        rid, homes, owner = job.response_id, self.homes, tenant_hash(job.tenant)
        homes.remember(rid, target.instance_id, target.endpoint_id, owner)
        try:
            await flow
        except BaseException:  # failed, or the client left: the engine stored nothing (or a cancelled stream)
            homes.forget(rid)
            raise
        served = rec.target
        if served is not None and served is not target:  # a retry served it elsewhere
            homes.remember(rid, served.instance_id, served.endpoint_id, owner)

    async def relay(
        self, method: str, response_id: str, query: str, request_id: str, rec: RequestRecord, tenant: str
    ) -> tuple[int, bytes]:
        """GET, DELETE or cancel (POST) of a stored response of `tenant`'s, on its engine: (status, body) as it
        answered."""
        if method == "GET" and asks_for_stream(query):
            raise InvalidRequest(
                "streaming a stored response (GET ?stream=true) is not served through the Coordinator", param="stream"
            )
        target = self.home(response_id, "response_id", tenant)
        rec.target = target
        path = f"{RESPONSES.route}/{quote(response_id, safe='')}" + ("/cancel" if method == "POST" else "")
        url = target.url + path + (f"?{query}" if query and method == "GET" else "")
        status, data = await self.up.client.call(
            method.encode(), url, request_id, timeout_s=self.up.live.s.first_token_timeout_s
        )
        if method == "DELETE" and (status < 300 or status in (NO_DELETE_ROUTE, 404)):
            self.homes.forget(response_id)
            if status == NO_DELETE_ROUTE:
                return 200, json_bytes({"id": response_id, "object": "response", "deleted": True})
        return status, data
