"""The cluster store's own client (state/pipelined_redis.py, state/cluster.py) against a real redis-server: pipelined replies
in order, error replies, a password and a database from the URL or a file, the admit script's cap and bucket, and
a Redis that restarted (its scripts forgotten)."""

from __future__ import annotations

import asyncio
import socket

import pytest

from harness.redis import RedisServer
from state.cluster import ClusterStore, StoreDown
from state.pipelined_redis import Resp, RespError, encode


@pytest.fixture(scope="module")
def redis():
    server = RedisServer(password="s3cret pass")
    yield server
    server.stop()


def run(coro):
    return asyncio.run(coro)


def test_replies_come_back_in_order_and_errors_are_replies(redis):
    async def go():
        r = Resp(f"redis://127.0.0.1:{redis.port}/3", "s3cret pass", 1.0)
        replies = await r.call(
            encode("SET", "k", "v"),
            encode("GET", "k"),
            encode("INCRBY", "n", 5),
            encode("LRANGE", "missing", 0, -1),
            encode("GET", "missing"),
            encode("NOSUCHCOMMAND"),
        )
        many = await asyncio.gather(*(r.call(encode("INCR", "c")) for _ in range(50)))
        r.close()
        db0 = Resp(f"redis://:s3cret%20pass@127.0.0.1:{redis.port}", None, 1.0)  # the password from the URL
        elsewhere = await db0.call(encode("GET", "k"))
        db0.close()
        return replies, many, elsewhere

    replies, many, elsewhere = run(go())
    assert replies[:5] == [b"OK", b"v", 5, [], None]
    assert isinstance(replies[5], RespError) and "unknown command" in str(replies[5])
    assert sorted(reply for (reply,) in many) == list(range(1, 51))  # each INCR answered once, none lost
    assert elsewhere == [None]  # db 3 holds them: the URL's path chose it


def test_a_wrong_password_and_an_absent_server_are_errors_not_hangs(redis):
    async def go(url, password):
        with pytest.raises(RespError):
            await Resp(url, password, 0.5).call(encode("PING"))

    run(go(f"redis://127.0.0.1:{redis.port}/0", "wrong"))
    run(go(f"redis://:s3cret%20pass@127.0.0.1:{redis.port + 1}/0", None))  # nothing listens there


def test_the_admit_script_holds_the_cap_and_the_bucket_and_survives_a_restart(redis):
    url = f"redis://:s3cret%20pass@127.0.0.1:{redis.port}/0"

    async def go():
        a = ClusterStore(url, None, "t1:", 1.0, "ra", 0)
        b = ClusterStore(url, None, "t1:", 1.0, "rb", 0)
        verdicts = [(await s.admit(0, 3, 5000, 0.0, 0))[0] for s in (a, b, a, b)]
        after_end = (await a.admit(1, 3, 5000, 0.0, 0))[0]  # one of a's ended: its place is free again
        redis.command(b"SCRIPT", b"FLUSH")  # what a restarted Redis has forgotten
        refused = (await b.admit(0, 3, 5000, 0.0, 0))[0]
        rate = [await a.admit(0, 0, 5000, 2.0, 2000) for _ in range(3)]  # 2 a second, a bucket of 2
        await a.close()
        await b.close()
        return verdicts, after_end, refused, rate

    verdicts, after_end, refused, rate = run(go())
    assert verdicts == [0, 0, 0, 1]  # cap 3 across both stores
    assert after_end == 0 and refused == 1
    assert [v for v, _ in rate] == [0, 0, 2] and 0 < rate[2][1] <= 0.5


def test_a_store_that_is_away_raises_store_down():
    async def go():
        store = ClusterStore("redis://127.0.0.1:9/0", None, "t2:", 0.3, "r", 0)  # the discard port: refused
        with pytest.raises(StoreDown):
            await store.admit(0, 1, 1000, 0.0, 0)
        with pytest.raises(StoreDown):
            await store.sync(b"{}", 1000, 100)
        await store.close()

    run(go())


def test_a_store_that_never_answers_fails_its_calls_after_the_timeout():
    """A Redis that accepts and then says nothing (a stopped VM, a full disk): a request's call is failed by the
    owner's timer check, an awaited call by its own timeout; neither waits longer."""
    silent = socket.create_server(("127.0.0.1", 0))
    port = silent.getsockname()[1]

    async def go():
        r = Resp(f"redis://127.0.0.1:{port}/0", None, 0.2)
        await r.connect()
        (fut,) = r.send(encode("PING"))
        await asyncio.sleep(0.3)
        r.check()
        with pytest.raises(RespError):
            await asyncio.wait_for(fut, 1)
        with pytest.raises(RespError, match="no reply within"):
            await r.call(encode("PING"))
        r.close()

    try:
        run(go())
    finally:
        silent.close()


def _two_replicas(redis, prefix: str, role: str, **settings):
    """Two replicas' sync owners (their shared memory, their registries: one engine of `role`) on the real store,
    as (Cluster, SharedState) pairs; `settings` beside the cluster section."""
    from dataclasses import replace

    from config import ClusterConfig, Endpoint, Instance, Live, Settings
    from scheduling.registry import Registry
    from serving.cluster import Cluster
    from state.shared import SharedState

    url = f"redis://:s3cret%20pass@127.0.0.1:{redis.port}/0"
    config = replace(Settings(), cluster=ClusterConfig(redis_url=url, key_prefix=prefix), **settings)
    engine = Instance(1, role, "m", (Endpoint(0, "127.0.0.1:8000"),))

    def replica(name: str):
        shared = SharedState.create()
        registry = Registry(shared)
        registry.apply("set", [engine])
        return Cluster(Live(config), shared, 0, name, registry), shared

    return replica("A"), replica("B")


def test_what_one_replica_learned_of_an_engine_reaches_a_replica_that_has_not(redis):
    """Two replicas' sync owners (their shared memory, their registries) through the real store: B, which has
    learned nothing of the engine, takes A's model of it; A, which knows more, keeps its own."""
    from serving.cluster import LEARNED

    (a, sa), (b, sb) = _two_replicas(redis, "t3:", "union")
    slot = a.registry.view().targets[0].slot
    ea = sa.endpoints[slot]
    for f in LEARNED:
        setattr(ea, f, 0.5)
    ea.pf_n, ea.dc_n, ea.prefill_tps = 12.0, 9.0, 4321.0

    async def go():
        await a._sync()
        await b._sync()
        await a._sync()
        for c in (a, b):
            await c.store.close()

    run(go())
    bslot = b.registry.view().targets[0].slot
    assert [getattr(sb.endpoints[bslot], f) for f in LEARNED] == [getattr(ea, f) for f in LEARNED]
    assert ea.prefill_tps == 4321.0  # A kept its own


def test_the_tightest_tpot_budget_decoding_on_an_engine_reaches_the_other_replicas(redis):
    """A plan is judged against the tightest TPOT budget decoding where it joins (scheduling/ledger.py
    `tpot_floor_s`), another replica's streams included: A's workers' tightest budget on the engine reaches B's
    remote row through the real store, and goes when A's streams end."""
    from scheduling.ledger import DECODE, Ledger

    (a, sa), (b, sb) = _two_replicas(redis, "t4:", "decode", num_workers=2)
    slot, bslot = a.registry.view().targets[0].slot, b.registry.view().targets[0].slot
    a0, a1 = Ledger(sa, 0, 2), Ledger(sa, 1, 2)  # A's two workers
    seen = Ledger(sb, 0, 2, remote=True)  # what B's worker 0 judges against

    async def floor_at_b(*leases_to_end) -> float:
        for lease in leases_to_end:
            lease.release()
        await a._sync()
        await b._sync()
        return seen.tpot_floor_s(bslot)

    async def go():
        loose = a0.lease(slot, 0, 50, prefilling=False, kind=DECODE, tpot_budget_s=0.200)
        tight = a1.lease(slot, 0, 50, prefilling=False, kind=DECODE, tpot_budget_s=0.040)
        assert await floor_at_b() == pytest.approx(0.040)
        assert await floor_at_b(tight) == pytest.approx(0.200)
        assert await floor_at_b(loose) == float("inf")
        for c in (a, b):
            await c.store.close()

    run(go())
