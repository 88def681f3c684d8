"""The cluster store: what Coordinator replicas share through Redis, as keys, scripts and round trips.

Each worker process of each replica has one `ClusterStore` (one Redis connection). Every key starts with
`key_prefix`:

  replicas                  the ids of the replicas that published lately (the sync script prunes the silent)
  replica:<id>              that replica's report (JSON: its load per endpoint, endpoints it avoids, what it
                            learned), expiring after `replica_ttl_s`: a replica that dies stops counting
  inflight                  the set of the per-worker in-flight keys
  inflight:<id>:<worker>    that worker's requests in flight (admitted by the script, taken off as they end),
                            expiring as above
  rate                      the cluster's token bucket (milli-tokens, its stamp in µs of Redis's clock)
  instances, instances:v    the instance set (JSON) and its version
  events                    a channel: trigger-mode prefill usage and stored responses' homes, for every replica
  epoch                     a random token, written by the first sync to find none: a store that lost its data
                            (restarted empty, failed over to an empty replica, FLUSHALL) has another, and every
                            replica puts its part back. A key, not INFO's run_id: it goes exactly when the data goes
                            (FLUSHALL keeps the run_id; a failover to a replica that kept the data changes it)

A call that fails or outlasts `redis_timeout_ms` raises `StoreDown`; the caller falls back (serving/cluster.py).
"""

from __future__ import annotations

import os

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError, RedisError

from state.pipelined_redis import Resp, RespError, encode

# KEYS: the inflight set, this worker's key, the rate bucket. ARGV: this worker's requests ended since its last
# call (taken off its count first), the cap (0: none), the key's expiry (ms), the rate (requests/s, 0: none), the
# bucket's size (milli-tokens). Returns {0}: admitted (counted), {1}: over the cap, {2, µs}: no rate token for
# that long.
ADMIT = """
local ended = tonumber(ARGV[1])
if ended > 0 then redis.call('DECRBY', KEYS[2], ended) end
redis.call('PEXPIRE', KEYS[2], ARGV[3])
local cap = tonumber(ARGV[2])
if cap > 0 then
  local total = 0
  for _, k in ipairs(redis.call('SMEMBERS', KEYS[1])) do
    local v = redis.call('GET', k)
    if v then total = total + tonumber(v) else redis.call('SREM', KEYS[1], k) end
  end
  if total >= cap then return {1, 0} end
end
local rate = tonumber(ARGV[4])
if rate > 0 then
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
  local burst = tonumber(ARGV[5])
  local b = redis.call('HMGET', KEYS[3], 'tokens', 'stamp')
  local tokens, stamp = tonumber(b[1]), tonumber(b[2])
  if not stamp or not tokens then tokens, stamp = burst, now end
  if now < stamp then stamp = now end
  local gained = math.floor((now - stamp) * rate / 1000)
  if tokens + gained >= burst then
    tokens, stamp = burst, now
  elseif gained > 0 then
    tokens = tokens + gained
    stamp = stamp + math.floor(gained * 1000 / rate)
  end
  if tokens < 1000 then
    redis.call('HSET', KEYS[3], 'tokens', tokens, 'stamp', stamp)
    return {2, math.ceil((1000 - tokens) * 1000 / rate)}
  end
  redis.call('HSET', KEYS[3], 'tokens', tokens - 1000, 'stamp', stamp)
end
redis.call('INCR', KEYS[2])
redis.call('PEXPIRE', KEYS[2], ARGV[3])
redis.call('SADD', KEYS[1], KEYS[2])
return {0, 0}
"""

# KEYS: the replicas set, this replica's key, the instance set's version, the epoch. ARGV: this replica's id, its
# report, the report's expiry (ms), the key prefix, a new epoch (written if none is). Returns {the instance set's
# version, {id, report, id, report, ...}, the epoch}.
SYNC = """
redis.call('SET', KEYS[4], ARGV[5], 'NX')
redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
redis.call('SADD', KEYS[1], ARGV[1])
local out = {}
for _, id in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  if id ~= ARGV[1] then
    local v = redis.call('GET', ARGV[4] .. 'replica:' .. id)
    if v then
      table.insert(out, id)
      table.insert(out, v)
    else
      redis.call('SREM', KEYS[1], id)
    end
  end
end
return {tonumber(redis.call('GET', KEYS[3]) or '0'), out, redis.call('GET', KEYS[4])}
"""

# KEYS: the instance set, its version. ARGV: the version the writer read, the new set (or '' to write only if
# none is stored yet). Returns the new version, or -1 when another writer came first.
STORE_INSTANCES = """
local v = tonumber(redis.call('GET', KEYS[2]) or '0')
if ARGV[2] == '' then return v end
if ARGV[1] == 'seed' then
  if redis.call('EXISTS', KEYS[1]) == 1 then return -1 end
elseif tonumber(ARGV[1]) ~= v then
  return -1
end
redis.call('SET', KEYS[1], ARGV[2])
return redis.call('INCR', KEYS[2])
"""


class StoreDown(Exception):
    """The store did not answer (unreachable, failing or slower than `redis_timeout_ms`)."""


def redis_client(url: str, password: str | None, timeout_s: float, read_timeout_s: float | None) -> aioredis.Redis:
    """One connection to `url`. A command is tried again, at once and once, only when its connection was found
    closed (the store restarted: the connection it closed fails the next command, and only that one), never after
    a timeout (a caller falls back at once instead). A subscriber's reads wait for the next message as long as it
    takes (`read_timeout_s` None)."""
    return aioredis.Redis.from_url(
        url,
        password=password or None,
        socket_timeout=read_timeout_s,
        socket_connect_timeout=timeout_s,
        single_connection_client=True,
        retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
        health_check_interval=0,
    )


class ClusterStore:
    """One worker's connection to the cluster store, and the store's counters (round trips, errors)."""

    def __init__(self, url: str, password: str | None, prefix: str, timeout_s: float, replica: str, worker: int):
        self.prefix, self.replica, self.worker = prefix, replica, worker
        self.r = redis_client(url, password, timeout_s, timeout_s)
        self.subscriber = redis_client(url, password, timeout_s, None)
        self.resp = Resp(url, password, timeout_s)
        self.round_trips = self.errors = 0
        self.k_inflight, self.k_rate = prefix + "inflight", prefix + "rate"
        self.k_mine = f"{prefix}inflight:{replica}:{worker}:{os.getpid()}"  # a restarted worker's is another
        self.k_replicas, self.k_replica = prefix + "replicas", f"{prefix}replica:{replica}"
        self.k_instances, self.k_version = prefix + "instances", prefix + "instances:v"
        self.k_events, self.k_epoch = prefix + "events", prefix + "epoch"
        self._admit = self.r.register_script(ADMIT)
        self._sync = self.r.register_script(SYNC)
        self._store_instances = self.r.register_script(STORE_INSTANCES)

    async def _call(self, coro):
        self.round_trips += 1
        try:
            return await coro
        except (RedisError, OSError) as e:
            self.errors += 1
            raise StoreDown(f"{type(e).__name__}: {e}") from None

    async def _counted(self, *commands: bytes) -> list:
        """This worker's count's commands, on its own connection (state/pipelined_redis.py), in the order they are sent."""
        self.round_trips += 1
        try:
            replies = await self.resp.call(*commands)
        except RespError as e:
            self.errors += 1
            raise StoreDown(str(e)) from None
        for reply in replies:
            if isinstance(reply, RespError) and not str(reply).startswith("NOSCRIPT"):
                self.errors += 1
                raise StoreDown(str(reply))
        return replies

    async def admit(self, ended: int, cap: int, ttl_ms: int, rate: float, burst_milli: int) -> tuple[int, float]:
        """(0, 0): admitted (this worker's count is one more, less `ended`); (1, 0): over the cap; (2, s): no
        rate token for s seconds."""
        args = (self.k_inflight, self.k_mine, self.k_rate, ended, cap, ttl_ms, rate, burst_milli)
        self.round_trips += 1
        try:
            if not self.resp.connected:  # (the first call, or the connection dropped since the last)
                await self.resp.connect()
            (fut,) = self.resp.send(encode("EVALSHA", self._admit.sha, 3, *args))  # no coroutine, no timer: `check`
            reply = await fut
        except RespError as e:
            self.errors += 1
            raise StoreDown(str(e)) from None
        if isinstance(reply, RespError):  # NOSCRIPT: a Redis that restarted has forgotten it
            (reply,) = await self._counted(encode("EVAL", ADMIT, 3, *args))
        verdict, wait_us = reply
        return int(verdict), int(wait_us) / 1e6

    async def ended(self, ended: int, ttl_ms: int) -> None:
        """`ended` of this worker's requests ended (and it lives: its key's expiry moves)."""
        if ended:
            await self._counted(encode("DECRBY", self.k_mine, ended), encode("PEXPIRE", self.k_mine, ttl_ms))
        else:
            await self._counted(encode("PEXPIRE", self.k_mine, ttl_ms))

    async def set_count(self, count: int, ttl_ms: int) -> None:
        """This worker's count as it is (after the store lost it)."""
        await self._counted(
            encode("SET", self.k_mine, count, "PX", ttl_ms), encode("SADD", self.k_inflight, self.k_mine)
        )

    async def sync(self, report: bytes, ttl_ms: int) -> tuple[int, dict[str, bytes], bytes]:
        """Publish this replica's report; (the instance set's version, the other live replicas' reports, the
        store's epoch)."""
        version, flat, epoch = await self._call(
            self._sync(
                keys=(self.k_replicas, self.k_replica, self.k_version, self.k_epoch),
                args=(self.replica, report, ttl_ms, self.prefix, os.urandom(8).hex()),
            )
        )
        return int(version), {flat[i].decode(): flat[i + 1] for i in range(0, len(flat), 2)}, epoch

    async def instances(self) -> tuple[int, bytes | None]:
        """(version, the stored instance set or None)."""
        pipe = self.r.pipeline(transaction=True)
        pipe.get(self.k_version)
        pipe.get(self.k_instances)
        version, doc = await self._call(pipe.execute())
        return int(version or 0), doc

    async def store_instances(self, read_version: int | str, doc: bytes) -> int:
        """Write the instance set if it is still at `read_version` ('seed': only if none is stored); the new
        version, or -1 when another replica wrote first."""
        return int(
            await self._call(self._store_instances(keys=(self.k_instances, self.k_version), args=(read_version, doc)))
        )

    async def publish_event(self, event: bytes) -> None:
        await self._call(self.r.publish(self.k_events, event))

    def pubsub(self):
        return self.subscriber.pubsub()

    async def leave(self) -> None:
        """A clean stop: this worker's count goes at once (a killed one's expires)."""
        try:
            await self._counted(encode("DEL", self.k_mine), encode("SREM", self.k_inflight, self.k_mine))
        except StoreDown:
            pass

    def check(self) -> None:
        """Give up on replies overdue by the timeout (the owner's timer calls it)."""
        self.resp.check()

    async def close(self) -> None:
        self.resp.close()
        try:
            await self.subscriber.aclose()
            await self.r.aclose()
        except (RedisError, OSError):
            pass
