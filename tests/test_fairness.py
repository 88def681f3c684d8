"""The SLO admission queue under saturation: higher x-priority classes first, within a class tenants by weighted
tokens served (VTC, scheduling/fairness.py), a tenant that idled lifted so it banks no credit; and the headroom a
batch request leaves to the higher classes. The scheduler runs on real shared state, as tests/test_scheduling.py's."""

from __future__ import annotations

import asyncio
import re
import sys
import time

import httpx
import openai
import pytest

from config.load import settings_from_dict
from config.settings import Live
from harness.configs import api_keys, coordinator_config, instance
from harness.coordinator import Coordinator
from harness.loopback import free_port, wait_until
from harness.processes import Proc
from scheduling.admission import OverBudget
from scheduling.fairness import BATCH, INTERACTIVE, STANDARD, FairShare
from serving.families.chat import CHAT
from serving.job import job_from_body, parse_body
from serving.observe import RequestRecord, Tick
from serving.tenants import Tenants
from state.quotas import TenantQuotas
from state.shared import MAX_FAIR_TENANTS, SharedState
from tests.conftest import MODEL
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


def test_without_admission_no_request_is_counted_in_the_fair_share():
    """Nothing reads the tenants' counters or the classes seen without admission: the scheduler keeps none, and a
    request, with a quota or without, is served its headers and settled without writing the shared fair table."""
    sched, w = scheduler("slo_aware", "off")
    config = {
        "api_key_config": {"enable_api_key": True, "valid_keys": ["sk-other"]},
        "tenant_config": {"tenants": [{"name": "q", "keys": ["sk-q"], "rpm": 60}]},
    }
    live = Live(settings_from_dict(config))
    quotas = TenantQuotas(w.shared, 0, 1)
    tenants = Tenants(live, quotas, sched.fair, Tick())
    for tenant in ("q", "default"):
        body = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}'
        one = job_from_body(CHAT, body, parse_body(body), "r")
        one.tenant = tenant
        tenants.classify(one, "interactive")
        headers: dict[str, str] = {}
        with tenants.admit(one, RequestRecord("r", "/v1/chat/completions", tenant=tenant), headers):
            pass
        assert ("x-ratelimit-limit-requests" in headers) is (tenant == "q")
    assert quotas.my_inflight[quotas.slot("q")] == 0  # the quota's place was given back
    fair, counts = w.shared.fair, w.shared.fair_counts[0]
    assert fair.used == 0 and not any(fair.seen) and not any(counts.active) and not any(counts.served)


# -- a two-worker Coordinator ------------------------------------------------------------------------------------

KEYS = {"a": "sk-fair-a", "b": "sk-fair-b", "probe": "sk-fair-probe"}
WEIGHTS = {"a": 1.0, "b": 3.0}  # a's weighted share: 1/4
LINE = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) INFO coordinator\.request\[(\d+)\]: request_id=(\S+) .*?"
    r" tenant=(\S+) .*? status=(\d+) .*? prompt_tokens=(\d+) output_tokens=(\d+)",
    re.M,
)


HI = [{"role": "user", "content": "hi"}]


def request_lines(coord) -> list[tuple[float, str, str, str, int, int]]:
    """(wall-clock time, worker pid, request id, tenant, status, tokens) of every request line logged so far."""
    out = []
    for stamp, ms, pid, rid, tenant, status, prompt, output in LINE.findall(coord.output()):
        t = time.mktime(time.strptime(stamp, "%Y-%m-%d %H:%M:%S")) + int(ms) / 1000
        out.append((t, pid, rid, tenant, int(status), int(prompt) + int(output)))
    return out


async def pinned_clients(coord, per_worker: int) -> dict[str, list[openai.AsyncOpenAI]]:
    """HTTP/1.1 connections (one per SDK client), `per_worker` on each of the two workers, grouped by the worker that
    accepted each: a keep-alive connection's requests are all its worker's. Each is asked once (a request line names
    its worker's pid). They are opened in small bursts until both workers have enough: a worker's loop accepts every
    connection pending when it wakes, so a whole burst goes to one worker, and on a loaded machine the same one can
    win many bursts in a row."""
    by_worker: dict[str, list[httpx.AsyncClient]] = {}
    opened = 0
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        fresh = [
            (f"probe-{opened + i}", httpx.AsyncClient(limits=httpx.Limits(max_connections=1, keepalive_expiry=None)))
            for i in range(8)
        ]
        opened += len(fresh)
        await asyncio.gather(
            *(
                http.post(
                    coord.url + "/v1/chat/completions",
                    json={"model": MODEL, "messages": HI, "max_tokens": 1},
                    headers={"Authorization": f"Bearer {KEYS['probe']}", "X-Request-Id": rid},
                    timeout=30,
                )
                for rid, http in fresh
            )
        )
        pids: dict[str, str] = {}
        for _ in range(50):  # the request lines are written within 50 ms, later on a loaded machine
            await asyncio.sleep(0.1)
            pids = {rid: pid for _, pid, rid, *_ in request_lines(coord)}
            if all(rid in pids for rid, _ in fresh):
                break
        for rid, http in fresh:
            mine = by_worker.setdefault(pids[rid], [])
            if len(mine) < per_worker:
                mine.append(http)
            else:
                await http.aclose()  # that worker has its share
        if len(by_worker) == 2 and all(len(v) == per_worker for v in by_worker.values()):
            break
    assert sorted(len(v) for v in by_worker.values()) == [per_worker, per_worker], {
        pid: len(v) for pid, v in by_worker.items()
    }
    return {
        pid: [openai.AsyncOpenAI(base_url=coord.url + "/v1", api_key="-", http_client=h, max_retries=0) for h in https]
        for pid, https in by_worker.items()
    }


def test_a_tenants_weighted_share_holds_across_two_workers(tmp_path):
    """Saturation through a two-worker Coordinator (`admission: queue`): tenant a (weight 1) sends only through
    worker one, tenant b (weight 3) floods through both; each keeps requests waiting (closed loops: a 8, b 8 through
    worker one and 16 through worker two). a's share of the tokens served is its weighted share, 1/4, within 0.06.

    Why it holds: worker one's queue serves a first whenever a's counter (every worker's tokens served to it) is the
    lower, and b when b's is; worker one, with half the connections, is let in about half of the requests, more
    than a's share, so a's share is what the counters allow. With each worker's own counters worker one sees only
    what it served b and splits its half 1:3: a gets about 1/8 (0.128 and 0.161 in two runs of main's tree; 0.235
    to 0.25 in four of this one). The bound: a backlogged VTC keeps the two counters within one request's tokens of
    each other (under 1 % of the ~360 requests measured); the window's edges cut through the ~12 requests the TPOT
    budget lets in at once, about 3 of them a's at each edge: 2 x 3 / 360 = 0.017. Measured on an idle 2-core
    machine: 0.223-0.268 in 25 runs, the bound over twice the worst; with a 12 s window (~180 requests) 0.219-0.304
    in 6, and 0.188 in one CI run.
    (a at half its share, the issue's case, cannot tell the two apart here: worker one's half of the engine, split
    1:3, is a's share of the whole, exactly a's demand.)"""
    # The engine in a process of its own: its steps keep their time while this process's clients are busy.
    port = free_port()
    engine = Proc(
        [sys.executable, "-m", "engine_sim", "--port", str(port), "--model", MODEL, "--prefill-tokens-per-s", "40000"]
        + ["--decode-step-ms", "10", "--decode-per-seq-ms", "2", "--max-num-seqs", "64"],
        str(tmp_path / "engine.log"),
    )
    try:
        assert wait_until(lambda: healthy(port), timeout_s=30), engine.output()
        share, served = saturated(port)
    finally:
        engine.stop()
    assert abs(share - 0.25) <= 0.06, (share, served)


def healthy(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def saturated(port: int) -> tuple[float, int]:
    """a's share of the tokens served in the measured window, and the requests served in it."""
    tenants = [{"name": name, "keys": [key], "weight": WEIGHTS.get(name, 1.0)} for name, key in KEYS.items()]
    cfg = coordinator_config(
        [instance(1, "union", MODEL, f"127.0.0.1:{port}")],
        models=[{"id": MODEL, "slo_ttft": 20000, "slo_tpot": 40}],  # the TPOT budget limits the batch to about 12
        inference_workers_config={"num_workers": 2},
        api_key_config=api_keys(),
        scheduler_config={"scheduler_type": "slo_aware", "admission": "queue"},
        tenant_config={"tenants": tenants},
    )
    warm_s, measured_s = 6.0, 24.0

    async def load(coord) -> tuple[float, float, str]:
        clients = await pinned_clients(coord, 16)
        one, two = sorted(clients, key=lambda pid: -len(clients[pid]))
        plan = [("a", c) for c in clients[one][:8]] + [("b", c) for c in clients[one][8:16] + clients[two][:16]]
        start = time.time()
        end = start + warm_s + measured_s

        async def loop(tenant: str, sdk: openai.AsyncOpenAI, k: int) -> None:
            n = 0
            while time.time() < end:
                n += 1
                text = f"{tenant} {k} {n} " + "lorem ipsum dolor sit amet " * 30  # ~200 tokens, each its own
                try:
                    stream = await sdk.chat.completions.create(
                        model=MODEL,
                        messages=[{"role": "user", "content": text}],
                        max_tokens=16,
                        stream=True,  # the scheduler learns the engine's TPOT from streams
                        extra_body={"ignore_eos": True},
                        extra_headers={"Authorization": f"Bearer {KEYS[tenant]}", "X-Request-Id": f"{tenant}-{k}-{n}"},
                    )
                    async for _ in stream:
                        pass
                except openai.RateLimitError:  # the queue gave up on it: ask again
                    await asyncio.sleep(0.05)

        await asyncio.gather(*(loop(tenant, sdk, k) for k, (tenant, sdk) in enumerate(plan)))
        return start + warm_s, end, one

    with Coordinator(cfg, workers=2) as coord:
        since, until, one = asyncio.run(load(coord))
        time.sleep(0.3)
        lines = [ln for ln in request_lines(coord) if since <= ln[0] <= until and ln[3] in ("a", "b")]
    served = [ln for ln in lines if ln[4] == 200]
    assert len(served) >= 200, len(served)
    # The scenario held: a's requests all came through worker one, b's through both (worker one serves few of b's:
    # b was served much more by worker two).
    assert {pid for _, pid, _, tenant, *_ in lines if tenant == "a"} == {one}
    assert len({pid for _, pid, _, tenant, *_ in lines if tenant == "b"}) == 2
    tokens = {t: sum(ln[5] for ln in served if ln[3] == t) for t in ("a", "b")}
    return tokens["a"] / (tokens["a"] + tokens["b"]), len(served)
