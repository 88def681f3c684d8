"""The SLO admission queue under saturation: higher x-priority classes first, within a class tenants by weighted
tokens served (VTC, scheduling/fairness.py), a tenant that idled lifted so it banks no credit; and the headroom a
batch request leaves to the higher classes. The scheduler runs on real shared state, as tests/test_scheduling.py's."""

from __future__ import annotations

import asyncio

import pytest

from scheduling.admission import OverBudget
from scheduling.fairness import BATCH, INTERACTIVE, STANDARD, FairShare
from tests.test_scheduling import admit, job, queue_work, scheduler, slots, teach_decode, teach_prefill


def test_a_tenant_that_was_idle_is_lifted_to_the_least_active_counter():
    fair = FairShare()
    fair.arrive("a", STANDARD)
    fair.arrive("b", STANDARD)
    fair.charge("a", 500, 1.0)
    fair.charge("b", 3000, 2.0)  # weight 2: 1,500
    assert (fair.counter("a"), fair.counter("b")) == (500, 1500)
    fair.arrive("c", STANDARD)  # never served: it starts level with the least active, not with nothing
    assert fair.counter("c") == 500
    fair.leave("a", 100, 1.0)  # its output counts; a has nothing in flight now
    assert fair.counter("a") == 600
    fair.charge("c", 2000, 1.0)  # while a idles, b and c are served
    fair.arrive("a", STANDARD)  # back: lifted to the least of b (1,500) and c (2,500)
    assert fair.counter("a") == 1500
    fair.leave("b", 0, 2.0)
    fair.arrive("b", STANDARD)  # a counter above the least active one is kept (its debt stands)
    assert fair.counter("b") == 1500
    fair.arrive("b", BATCH)  # b is active already: nothing lifted
    assert fair.active["b"] == 2


def loaded(admission: str, queue_size: int = 16):
    """A P/D pair whose prefill engine (1,000 tokens/s) has 4.5 s of work: a 400-token request with a 5 s TTFT budget
    is over it (4.9 s against 85 % of 5 s) until that work ends."""
    sched, w = scheduler("slo_aware", admission, queue_size)
    p, d = slots(sched)
    teach_prefill(w.predictor, p, 1000.0)
    teach_decode(w.predictor, d, 0.02, 0.005)
    return sched, w, p, queue_work(w, p, 4500)


def request(priority: int, tenant: str, weight: float = 1.0, tokens: int = 400):
    info = job(tokens, ttft_ms=5000)
    info.priority, info.tenant, info.weight = priority, tenant, weight
    return info


def test_the_queue_serves_higher_classes_first_then_the_tenant_served_least():
    async def scenario() -> list[str]:
        sched, w, p, busy = loaded("queue")
        sched.fair.charge("heavy", 10_000, 1.0)  # heavy was served much more than light
        sched.fair.charge("light", 1_000, 1.0)
        order: list[str] = []
        waits = []
        for name, info in (
            ("batch-light", request(BATCH, "light")),
            ("standard-heavy", request(STANDARD, "heavy")),
            ("standard-light", request(STANDARD, "light")),
            ("interactive-heavy", request(INTERACTIVE, "heavy")),
        ):
            task = asyncio.ensure_future(admit(sched, info))
            task.add_done_callback(lambda _, name=name: order.append(name))
            waits.append(task)
            await asyncio.sleep(0.01)
        assert not order and len(sched.queue) == 4
        busy.release()  # capacity for all of them at once: the order is the queue's
        sched.queue.poke()
        await asyncio.wait_for(asyncio.gather(*waits), 2.0)
        # Each admission charged its prompt to its tenant.
        assert sched.fair.counter("heavy") == 10_800 and sched.fair.counter("light") == 1_800
        return order

    assert asyncio.run(scenario()) == ["interactive-heavy", "standard-light", "standard-heavy", "batch-light"]


def test_a_weight_is_a_share_and_an_arrival_does_not_pass_the_requests_waiting_before_it():
    async def scenario() -> list[str]:
        sched, w, p, busy = loaded("queue")
        sched.fair.charge("big", 4_000, 4.0)  # weight 4: 1,000, less than small's 1,500
        sched.fair.charge("small", 1_500, 1.0)
        order: list[str] = []
        first = asyncio.ensure_future(admit(sched, request(STANDARD, "small")))
        first.add_done_callback(lambda _: order.append("small"))
        await asyncio.sleep(0.01)
        busy.release()
        # Capacity is free, but a request of its class waits: it joins the queue rather than pass it...
        info = request(STANDARD, "big")
        assert sched.try_admit(info) is None
        late = asyncio.ensure_future(sched.queued(info))
        late.add_done_callback(lambda _: order.append("big"))
        # ... where the tenant with the smaller share of its weight goes first.
        await asyncio.wait_for(asyncio.gather(first, late), 2.0)
        # A batch request with nothing of its class or above waiting is not held back by the queue.
        assert sched.try_admit(request(BATCH, "small")) is not None
        return order

    assert asyncio.run(scenario()) == ["big", "small"]


def test_a_batch_request_is_refused_first_while_higher_classes_come():
    sched, w = scheduler("slo_aware", "reject")
    p, d = slots(sched)
    teach_prefill(w.predictor, p, 1000.0)
    teach_decode(w.predictor, d, 0.02, 0.005)
    busy = queue_work(w, p, 2500)  # a 400-token request: 2.9 s predicted, within 85 % of 5 s, beyond 60 % of that
    assert asyncio.run(admit(sched, request(BATCH, "t"))) is not None  # no higher class seen: all of the budget
    sched.fair.arrive("u", INTERACTIVE)
    with pytest.raises(OverBudget, match="batch share saturated"):
        asyncio.run(admit(sched, request(BATCH, "t")))
    assert asyncio.run(admit(sched, request(STANDARD, "t"))) is not None
    assert asyncio.run(admit(sched, request(INTERACTIVE, "u"))) is not None
    busy.release()
    assert asyncio.run(admit(sched, request(BATCH, "t"))) is not None  # idle enough again
