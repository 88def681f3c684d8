"""Single-engine calls: a whole request on one engine (streamed or JSON), and Anthropic's count_tokens."""

from __future__ import annotations

from collections.abc import Awaitable

from serving.call import Call
from serving.relay import relay


class WholeCall(Call[None]):
    """The client's own body to one engine, its answer relayed as it came."""

    __slots__ = ()

    def attempt(self, rid: str) -> Awaitable[None]:
        self.rec.target = self.leg.target
        if self.job.stream:
            return relay(self, self.job.raw, rid, None)
        return self._json(rid)

    async def _json(self, rid: str) -> None:
        job, rec = self.job, self.rec
        lease = self.leg.lease()
        try:
            _, data = await self.client.post(
                self.leg.target.url + job.route, job.raw, rid, timeout_s=self.settings.infer_timeout_s
            )
            rec.first_token()
            lease.succeed()  # the prefix is cached there now, and the prefill was done by now
            self.answer(data)
        finally:
            lease.release()

    def answer(self, data: bytes) -> None:
        """The engine's JSON answer, to the client."""
        self.sink.json(200, data)


class CountTokensCall(Call[None]):
    """/v1/messages/count_tokens: the engine counts; nothing is leased (it generates nothing)."""

    __slots__ = ()

    async def attempt(self, rid: str) -> None:
        job = self.job
        self.rec.target = self.leg.target
        _, data = await self.client.post(
            self.leg.target.url + job.route, job.raw, rid, timeout_s=self.settings.first_token_timeout_s
        )
        self.sink.json(200, data)
