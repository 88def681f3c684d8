"""The SLO admission queue under saturation: higher x-priority classes first, within a class tenants by weighted
tokens served (VTC, scheduling/fairness.py), a tenant that idled lifted so it banks no credit; and the headroom a
batch request leaves to the higher classes. The scheduler runs on real shared state, as tests/test_scheduling.py's."""

from __future__ import annotations

import asyncio

import pytest

from scheduling.admission import OverBudget
from scheduling.fairness import BATCH, INTERACTIVE, STANDARD, FairShare
from state.shared import MAX_FAIR_TENANTS, SharedState
from tests.test_scheduling import admit, job, queue_work, scheduler, slots, teach_decode, teach_prefill


def test_a_tenant_that_was_idle_is_lifted_to_the_least_active_counter():
    fair = FairShare(SharedState.create())
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
    assert fair.requests("b") == 2 and fair.counter("b") == 1500


def test_the_counters_are_the_workers_together():
    """Two workers' views of one shared table: what one serves the other reads; a tenant active in one worker is
    active for the other (no lift); a dead worker's requests stop counting as active, its tokens served do not."""
    shared = SharedState.create()
    one, two = FairShare(shared, 0, 2), FairShare(shared, 1, 2)
    one.arrive("a", STANDARD)
    two.arrive("b", STANDARD)
    one.charge("a", 900, 1.0)
    two.charge("b", 300, 3.0)  # weight 3: 100
    assert (two.counter("a"), one.counter("b")) == (900, 100)
    two.arrive("a", STANDARD)  # a is active (in worker one): its counter stands
    two.charge("a", 100, 1.0)
    assert one.counter("a") == 1000 and one.requests("a") == two.requests("a") == 2
    one.leave("a", 0, 1.0)
    two.leave("a", 0, 1.0)
    one.arrive("c", STANDARD)  # new: lifted to the least active counter, b's 100 (served by the other worker)
    assert two.counter("c") == 100
    one.arrive("a", STANDARD)  # back from idle above the least: its counter stands
    assert two.counter("a") == 1000
    shared.clear_worker(0)  # worker one died: a's and c's requests there are gone, what they were served is not
    assert two.requests("a") == two.requests("c") == 0 and two.counter("a") == 1000
    one.arrive("d", INTERACTIVE)
    assert two.higher_class_seen(STANDARD) and not two.higher_class_seen(INTERACTIVE)


def test_tenants_beyond_the_table_share_its_last_row():
    fair = FairShare(SharedState.create())
    rows = {fair.row(f"t{i}") for i in range(MAX_FAIR_TENANTS + 5)}
    assert len(rows) == MAX_FAIR_TENANTS
    fair.charge(f"t{MAX_FAIR_TENANTS + 3}", 7, 1.0)
    assert fair.counter(f"t{MAX_FAIR_TENANTS - 1}") == fair.counter(f"t{MAX_FAIR_TENANTS + 1}") == 7
    assert fair.counter("t0") == 0


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
