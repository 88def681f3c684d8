"""Single-engine calls: a whole request on one engine (streamed or JSON), and the calls one engine answers at once
(Anthropic's count_tokens, vLLM's /tokenize and /detokenize)."""

from __future__ import annotations

from collections.abc import Awaitable

from scheduling.ledger import Lease
from serving.call import Call
from serving.observe import answer_prompt_tokens
from serving.relay import relay


class WholeCall(Call[None]):
    """The client's own body to one engine, its answer relayed as it came."""

    __slots__ = ()

    def attempt(self, rid: str) -> Awaitable[None]:
        self.rec.target = self.leg.target
        if self.job.stream:
            return relay(self, rid, None, self.continuation())
        return self.exchange(rid)

    def answer(self, data: bytes, lease: Lease) -> None:
        lease.succeed()  # the prefix is cached there now, and the prefill was done by now
        self.leg.calibrate(answer_prompt_tokens(data, self.job.family))  # the model's estimate learns
        self.sink.json(200, data)


class OneEngineCall(Call[None]):
    """The client's body to the same route of one engine, its answer returned (a family that `counts_only`); nothing is
    leased (it generates nothing)."""

    __slots__ = ()

    async def attempt(self, rid: str) -> None:
        up = self.up
        self.rec.target = self.leg.target
        _, data = await up.client.post(
            self.leg.target.url + self.job.family.route, self.body, rid, timeout_s=up.live.s.first_token_timeout_s
        )
        self.sink.json(200, data)
