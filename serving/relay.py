"""The one stream relay: an engine's SSE stream to the client, for every streamed leg (whole, decode, metaserver).

It is the coroutine of one try itself (`Call.attempt` returns it), not a layer under one: every coroutine
layer costs a loaded worker on each chunk's resumption. Only whole events go out: a keep-alive comment
or an error event must never land inside one that the network cut in two. A decode leg's events pass
through its `UsageFix` (P's counts in D's usage, P's ticket taken out); other streams pass as they came, and
the first prompt count in their usage (a Messages stream's message_start, an OpenAI stream's usage chunk
when the client asked for one, a Responses stream's response.completed) calibrates the model's estimate.
The lease is released as soon as the engine's answer is whole, before the client has read the end of it
(a slow reader holds its connection, not the engine: the sink bounds what waits for it), and otherwise in
`finally`, so cancellation (a client disconnect: Sanic cancels the handler) and errors both give the
capacity back; leaving the `async with` early closes the engine connection, which aborts the engine
request.
"""

from __future__ import annotations

import time

from errors import UpstreamProtocolError
from scheduling.ledger import DECODE, Lease
from serving.call import Call
from serving.continuation import Continuation
from serving.legs import engine_body
from serving.observe import RequestRecord, answer_prompt_tokens
from serving.usage import EventSplitter, UsageFix

KEEPALIVE = b": keep-alive\n\n"  # an SSE comment: the engine is silent, and proxies and clients must not time out
END_GRACE_S = 1.0  # how long the end of an engine's body may follow its last event (it usually takes microseconds)


async def relay(call: Call[None], rid: str, fix: UsageFix | None, cont: Continuation | None) -> None:
    """One try of `call` as a stream; `fix`: the decode leg's usage fix-up (None: relayed as it came); `cont`:
    the stream's token ids and shape, kept for a continuation (serving/continuation.py), or None."""
    sink, rec, job, target, up = call.sink, call.rec, call.job, call.leg.target, call.up
    family = job.family
    final_usage = family.final_usage_event  # a Messages or Responses stream's output count is in it
    # The client's stream ends with its family's last event, not with the engine's EOF, which may come later: a
    # client that closes once it has the end (the SDKs do) has had its whole answer.
    last_event = family.last_event
    fix_block = fix.events if fix is not None else None
    route, body = (family.route, call.body) if cont is None else cont.request(family.route, call.body)
    body = engine_body(body, job, target)
    # The stream carries a usage, and in it the cached count: in its last event or the one before it (chat's and
    # completions' usage chunk before `[DONE]`, Messages' message_delta before message_stop, Responses'
    # response.completed), so only the last two blocks relayed are read for it, once, not every block.
    usage = family.usage_in_stream or job.include_usage
    before = held = b""  # the last two blocks relayed
    # The engine computed this prompt and will say its count (a decode leg's is P's, unless D computed it; a
    # continuation's prompt is token ids): the blocks are searched for it until it is found.
    learn = (
        (fix is None or fix.own_counts)
        and call.leg.job.prompt_bytes > 0
        and (cont is None or not cont.resuming)
        and usage
    )
    lease = call.leg.lease()
    try:
        splitter = EventSplitter()
        async with up.client.stream(target.url + route, body, rid) as es:
            async for chunk in es.chunks(up.live.s.stream_keepalive_interval_s):
                if not chunk:
                    if sink.started:
                        await sink.send(KEEPALIVE)
                    continue
                if not sink.started:
                    lease.first_token()
                    rec.first_token()
                    await sink.start_stream()
                block = splitter.complete(chunk)
                if block and cont is not None:
                    block = cont.relay(block)  # ids kept (and stripped), a continuation's in the client's shape
                    if cont.broken is not None:  # an in-band 5xx: what came before it goes out, then the failure
                        if block:
                            await sink.send(block)
                        raise cont.broken
                if block:
                    events = block.count(b"data:")
                    lease.events += events
                    rec.events += events
                    if fix_block is not None:
                        block = fix_block(block)
                    if final_usage is not None and final_usage in block:
                        rec.message_delta(block)
                    before, held = held, block
                    if learn and (prompt := answer_prompt_tokens(block, family)) > 0:
                        call.leg.calibrate(prompt)
                        learn = False
                    # (a continuation's end may come before its engine's last bytes: the client has it all then)
                    last = (
                        es.finished or (cont is not None and cont.complete) or _ends_with(block, last_event)
                    ) and not splitter.tail
                    if last:
                        _engine_done(lease, rec)
                    await sink.send(block, last)
                    if last:
                        break
            await es.rest(END_GRACE_S)
        if not sink.started:
            raise UpstreamProtocolError(f"{call.engine} ended the stream without sending anything", detail=target.url)
        _engine_done(lease, rec)
        tail = b""
        if splitter.tail.strip():  # the engine ended without the last event's blank line
            tail = splitter.tail if cont is None else cont.relay(splitter.tail + b"\n\n").removesuffix(b"\n\n")
            rec.events += tail.count(b"data:")
            tail = (tail if fix is None else fix.event(tail)) + b"\n\n"
            if cont is not None and cont.broken is not None:
                await sink.send(tail)
                raise cont.broken
        await sink.send(tail, True)  # (nothing when the last block ended the stream)
    finally:
        if usage:  # what the engine held (tenant metrics, KV events' prediction), however the stream ended
            rec.engine_cached(before + held)  # (its last count: the later block's, when both have one)
        if not lease.released:
            _decode_time(lease, rec)
            lease.release()


def _ends_with(block: bytes, first_line: bytes) -> bool:
    """Whether the last event of a block of whole events starts with `first_line`."""
    i = block.rfind(b"\n\n", 0, len(block) - 2)
    return block.startswith(first_line, i + 2 if i >= 0 else 0)


def _engine_done(lease: Lease, rec: RequestRecord) -> None:
    """The engine's answer is whole: its share of the engine is given back now, not when a slow client has
    read what is still buffered for it (the engine is free; only the client's connection still waits)."""
    if not lease.released:
        lease.succeed()
        _decode_time(lease, rec)
        lease.release()


def _decode_time(lease: Lease, rec: RequestRecord) -> None:
    if lease.kind == DECODE:  # the decode leg's time, for its histogram (serving/metrics.py)
        rec.decode_s = time.monotonic() - lease.started
