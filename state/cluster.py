"""The cluster store: what Coordinator replicas share through Redis, as keys, scripts and round trips.

Each worker process of each replica has one `ClusterStore` (one Redis connection). Every key starts with
`key_prefix`:

  replicas                  the ids of the replicas that published lately (the sync script prunes the silent)
  replica:<id>              that replica's report (JSON: its load per endpoint, endpoints it avoids, what it
                            learned), expiring after `replica_ttl_s`: a replica that dies stops counting
  inflight                  the set of the per-worker in-flight keys
  inflight:<id>:<worker>    that worker's requests in flight (admitted by the script, taken off as they end),
                            expiring as above; `...:t` beside it, its requests in flight per tenant with a quota
  tenant:<hash>             a tenant's rpm and tpm buckets (tenant_config; the hash is state.shared.tenant_hash),
                            expiring once both are full again
  rate                      the cluster's token bucket (milli-tokens, its stamp in µs of Redis's clock)
  instances, instances:v    the instance set (JSON) and its version
  events                    a channel: trigger-mode prefill usage and stored responses' homes, for every replica
  settling                  set for a while when the epoch is new: the workers writing their part again, during
                            which a tenant's quota is not decided (ADMIT) until every worker expected has
  rewritten, expected       the workers that wrote their part under this epoch (their keys), and how many the live
                            replicas have, as the writers saw them before the loss (REWRITE)
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

# A token bucket in milli-units, as state/quotas.py's `refill`: its (level, stamp) at `now` (µs), filled at `per_s` a
# second up to `cap`. A missing bucket is full.
REFILL = """
local function refill(level, stamp, now, per_s, cap)
  if not level or not stamp then return cap, now end
  if now < stamp then stamp = now end
  local gained = math.floor((now - stamp) * per_s / 1000)
  if level + gained >= cap then return cap, now end
  if gained > 0 then return level + gained, stamp + math.floor(gained * 1000 / per_s) end
  return level, stamp
end
"""

# A tenant's buckets (`tenant:<hash>`, a hash): rq/rq_at (rpm's), tk/tk_at (tpm's), `seen` (µs of the latest change),
# `born` (when the key was made), `base` (the `seen` of the view it was rebuilt from after a loss, see REWRITE) and
# `post_rq`/`post_tk` (what was taken from it since it was made). It expires once both buckets are full again (then
# a missing one is the same) plus the workers' expiry. Every worker's tenants' requests in flight are a hash of its
# own (`<its key>:t`, tenant hash -> count) that expires with its key. `settle` applies a worker's batch of ended
# requests and tokens served beyond what was taken (ARGV from `at`: hash, ended, tokens, tpm; each four).
TENANT = """
local function bucket_key(h) return ARGV[6] .. 'tenant:' .. h end
local function load(key)
  local b = redis.call('HMGET', key, 'rq', 'rq_at', 'tk', 'tk_at', 'born', 'post_rq', 'post_tk')
  return {tonumber(b[1]), tonumber(b[2]), tonumber(b[3]), tonumber(b[4]), tonumber(b[5]), tonumber(b[6]) or 0,
          tonumber(b[7]) or 0}
end
local function store(key, b, now, rpm, tpm, ttl)
  redis.call('HSET', key, 'rq', b[1], 'rq_at', b[2], 'tk', b[3], 'tk_at', b[4], 'seen', now, 'born', b[5] or now,
             'post_rq', b[6], 'post_tk', b[7])
  local full_ms = 0
  if rpm > 0 then full_ms = math.max(full_ms, (rpm * 1000 - b[1]) * 60 / rpm) end
  if tpm > 0 then full_ms = math.max(full_ms, (tpm * 1000 - b[3]) * 60 / tpm) end
  redis.call('PEXPIRE', key, math.max(redis.call('PTTL', key), math.ceil(full_ms) + ttl))
end
local function settle(at, mine_t, now, ttl)
  local i = at
  while ARGV[i] do
    local h, ended, tokens, tpm = ARGV[i], tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2]), tonumber(ARGV[i + 3])
    if ended > 0 then redis.call('HINCRBY', mine_t, h, -ended) end
    if tokens ~= 0 and tpm > 0 then
      local key = bucket_key(h)
      local b = load(key)
      local cap = tpm * 1000
      b[3], b[4] = refill(b[3], b[4], now, tpm / 60, cap)
      b[3] = math.min(cap, b[3] - tokens * 1000)
      b[7] = b[7] + tokens * 1000
      b[1], b[2] = b[1] or 0, b[2] or now
      store(key, b, now, 0, tpm, ttl)
    end
    i = i + 4
  end
  redis.call('PEXPIRE', mine_t, ttl)
end
local function clock()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end
"""

# KEYS: the inflight set, this worker's key, the rate bucket, the epoch, this worker's tenants' key. ARGV: this
# worker's requests ended since its last call (taken off its count first), the cap (0: none), the key's expiry (ms),
# the rate (requests/s, 0: none), the bucket's size (milli-tokens), the key prefix; then the tenant's part: its hash
# ('': none), its rpm, tpm and max_inflight, the tokens it reserves, the epoch this worker wrote its part under; then
# its batch of settlements (TENANT's `settle`, from ARGV[13]). Returns {0}: admitted (counted), {1}: over the cap,
# {2, µs}: no rate token for that long, {3}: the store lost its data since this worker wrote its part (REWRITE first),
# {4, µs, why}: the tenant's quota refused it (why: requests, tokens or inflight) for that long, {5, µs}: the workers
# are still writing their part after a loss (`settling`, a key the first to find the store empty writes, ended early
# once the `expected` workers are `rewritten`): ask again within that long, for until every worker has, a tenant's
# quota could count only some of its requests; with a tenant's
# buckets, then their state: {verdict, µs, why, rq, rq_at, tk, tk_at, now}.
ADMIT = (
    REFILL
    + TENANT
    + """
local ttl = tonumber(ARGV[3])
local h = ARGV[7]
if h ~= '' then
  if redis.call('GET', KEYS[4]) ~= ARGV[12] then return {3, 0} end
  local settling = redis.call('PTTL', ARGV[6] .. 'settling')
  if settling > 0 then
    local expected = tonumber(redis.call('GET', ARGV[6] .. 'expected') or '0')
    if expected == 0 or redis.call('SCARD', ARGV[6] .. 'rewritten') < expected then return {5, settling * 1000} end
    redis.call('DEL', ARGV[6] .. 'settling')
  end
end
local now = clock()
local ended = tonumber(ARGV[1])
if ended > 0 then redis.call('DECRBY', KEYS[2], ended) end
redis.call('PEXPIRE', KEYS[2], ttl)
if ARGV[13] then settle(13, KEYS[5], now, ttl) end
local cap = tonumber(ARGV[2])
local t_cap = h ~= '' and tonumber(ARGV[10]) or 0
if cap > 0 or t_cap > 0 then
  local total, mine = 0, 0
  for _, k in ipairs(redis.call('SMEMBERS', KEYS[1])) do
    local v = redis.call('GET', k)
    if v then
      total = total + tonumber(v)
      if t_cap > 0 then mine = mine + tonumber(redis.call('HGET', k .. ':t', h) or '0') end
    else
      redis.call('SREM', KEYS[1], k)
    end
  end
  if cap > 0 and total >= cap then return {1, 0} end
  if t_cap > 0 and mine >= t_cap then return {4, 1000000, 'inflight'} end
end
local rate = tonumber(ARGV[4])
local rate_b
if rate > 0 then
  local burst = tonumber(ARGV[5])
  local b = redis.call('HMGET', KEYS[3], 'tokens', 'stamp')
  local tokens, stamp = refill(tonumber(b[1]), tonumber(b[2]), now, rate, burst)
  if tokens < 1000 then
    redis.call('HSET', KEYS[3], 'tokens', tokens, 'stamp', stamp)
    return {2, math.ceil((1000 - tokens) * 1000 / rate)}
  end
  rate_b = {tokens - 1000, stamp}
end
local out = {0, 0}
if h ~= '' then
  local rpm, tpm, reserve = tonumber(ARGV[8]), tonumber(ARGV[9]), tonumber(ARGV[11])
  local key = bucket_key(h)
  local b = load(key)
  local why, wait = '', 0
  if rpm > 0 then
    b[1], b[2] = refill(b[1], b[2], now, rpm / 60, rpm * 1000)
    if b[1] < 1000 then why, wait = 'requests', math.ceil((1000 - b[1]) * 60000 / rpm) end
  else
    b[1], b[2] = b[1] or 0, b[2] or now
  end
  if why == '' and tpm > 0 then
    b[3], b[4] = refill(b[3], b[4], now, tpm / 60, tpm * 1000)
    if b[3] < 1000 then why, wait = 'tokens', math.ceil((1000 - b[3]) * 60000 / tpm) end
  else
    b[3], b[4] = b[3] or 0, b[4] or now
  end
  if why == '' then
    if rpm > 0 then b[1], b[6] = b[1] - 1000, b[6] + 1000 end
    if tpm > 0 then b[3], b[7] = b[3] - reserve * 1000, b[7] + reserve * 1000 end
  end
  if rpm > 0 or tpm > 0 then store(key, b, now, rpm, tpm, ttl) end
  if why ~= '' then return {4, wait, why, b[1], b[2], b[3], b[4], now} end
  redis.call('HINCRBY', KEYS[5], h, 1)
  redis.call('PEXPIRE', KEYS[5], ttl)
  out = {0, 0, '', b[1], b[2], b[3], b[4], now}
end
if rate_b then redis.call('HSET', KEYS[3], 'tokens', rate_b[1], 'stamp', rate_b[2]) end
redis.call('INCR', KEYS[2])
redis.call('PEXPIRE', KEYS[2], ttl)
redis.call('SADD', KEYS[1], KEYS[2])
return out
"""
)

# KEYS: this worker's key, its tenants' key. ARGV: its requests ended since its last call, the keys' expiry (ms),
# (unused), (unused), (unused), the key prefix, then its settlements (TENANT's `settle`, from ARGV[7]). Returns
# {now, hash, tk, tk_at, ...} for each tenant settled with tokens: the worker's views.
SETTLE = (
    REFILL
    + TENANT
    + """
local ttl = tonumber(ARGV[2])
local ended = tonumber(ARGV[1])
if ended > 0 then redis.call('DECRBY', KEYS[1], ended) end
redis.call('PEXPIRE', KEYS[1], ttl)
local now = clock()
settle(7, KEYS[2], now, ttl)
local out = {now}
local i = 7
while ARGV[i] do
  if tonumber(ARGV[i + 2]) ~= 0 then
    local b = redis.call('HMGET', bucket_key(ARGV[i]), 'tk', 'tk_at')
    table.insert(out, ARGV[i])
    table.insert(out, b[1] or '0')
    table.insert(out, b[2] or '0')
  end
  i = i + 4
end
return out
"""
)

# After the store lost its data: KEYS: the epoch, the inflight set, this worker's key, its tenants' key. ARGV: a new
# epoch (written if none is: then the workers have `settling` ms to write their part), this worker's count, the keys'
# expiry (ms), the settling time (ms), the workers of the live replicas as this one last saw them (0: unknown; the
# most any writer saw is `expected`), the key prefix, then per
# tenant nine values: hash, this worker's requests of it in flight, its view of the buckets (rq, rq_at, tk, tk_at and
# `at`, the store's time of that view: what the reply of its latest call said), rpm, tpm. Each bucket made since the
# loss is rebuilt from the latest view any worker had (refilled to now) less what was taken from it since it was made,
# so that the order in which the workers write does not matter and no restart gives a tenant a fresh minute. Returns
# the epoch.
REWRITE = (
    REFILL
    + TENANT
    + """
if redis.call('SET', KEYS[1], ARGV[1], 'NX') then redis.call('SET', ARGV[6] .. 'settling', 1, 'PX', ARGV[4]) end
local ttl = tonumber(ARGV[3])
redis.call('SET', KEYS[3], ARGV[2], 'PX', ttl)
redis.call('SADD', KEYS[2], KEYS[3])
redis.call('SADD', ARGV[6] .. 'rewritten', KEYS[3])
redis.call('PEXPIRE', ARGV[6] .. 'rewritten', ARGV[4])
if tonumber(ARGV[5]) > tonumber(redis.call('GET', ARGV[6] .. 'expected') or '0') then
  redis.call('SET', ARGV[6] .. 'expected', ARGV[5], 'PX', ARGV[4])
end
redis.call('DEL', KEYS[4])
local now = clock()
local i = 7
while ARGV[i] do
  local h, n = ARGV[i], tonumber(ARGV[i + 1])
  if n > 0 then redis.call('HSET', KEYS[4], h, n) end
  local at, rpm, tpm = tonumber(ARGV[i + 6]), tonumber(ARGV[i + 7]), tonumber(ARGV[i + 8])
  if at > 0 and (rpm > 0 or tpm > 0) then
    local key = bucket_key(h)
    local b = load(key)
    local base = tonumber(redis.call('HGET', key, 'base') or '0')
    if (not b[5] or at < b[5]) and at > base then
      local rq, rq_at = tonumber(ARGV[i + 2]), tonumber(ARGV[i + 3])
      local tk, tk_at = tonumber(ARGV[i + 4]), tonumber(ARGV[i + 5])
      if rpm > 0 then
        rq, rq_at = refill(rq, rq_at, now, rpm / 60, rpm * 1000)
        b[1], b[2] = rq - b[6], now
      end
      if tpm > 0 then
        tk, tk_at = refill(tk, tk_at, now, tpm / 60, tpm * 1000)
        b[3], b[4] = tk - b[7], now
      end
      b[1], b[2], b[3], b[4] = b[1] or 0, b[2] or now, b[3] or 0, b[4] or now
      store(key, b, now, rpm, tpm, ttl)
      redis.call('HSET', key, 'base', at)
    end
  end
  i = i + 9
end
redis.call('PEXPIRE', KEYS[4], ttl)
return redis.call('GET', KEYS[1])
"""
)

# KEYS: the replicas set, this replica's key, the instance set's version, the epoch. ARGV: this replica's id, its
# report, the report's expiry (ms), the key prefix, a new epoch (written if none is), the time the workers have to
# write their part again when it is (ms: `settling`, see ADMIT). Returns {the instance set's
# version, {id, report, id, report, ...}, the epoch}.
SYNC = """
if redis.call('SET', KEYS[4], ARGV[5], 'NX') then redis.call('SET', ARGV[4] .. 'settling', 1, 'PX', ARGV[6]) end
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


NO_TENANT = ("", 0, 0, 0, 0, "")  # ADMIT's tenant part for a request of no tenant with a quota


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
        self.k_tenants = self.k_mine + ":t"
        self._admit = self.r.register_script(ADMIT)
        self._settle = self.r.register_script(SETTLE)
        self._rewrite = self.r.register_script(REWRITE)
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

    async def _script(self, script, source: str, *args) -> object:
        """One of this worker's scripts on its own connection (run from its source when Redis has forgotten it)."""
        (reply,) = await self._counted(encode("EVALSHA", script.sha, *args))
        if isinstance(reply, RespError):
            (reply,) = await self._counted(encode("EVAL", source, *args))
        return reply

    async def admit(
        self, ended: int, cap: int, ttl_ms: int, rate: float, burst_milli: int, tenant: tuple = (), settle: tuple = ()
    ) -> tuple:
        """(0, 0): admitted (this worker's count is one more, less `ended`); (1, 0): over the cap; (2, s): no
        rate token for s seconds; (3, 0): the store lost its data since this worker's last `rewrite`; (4, s, why):
        the tenant's quota refused it; (5, s): ask again in s seconds (the workers are writing their part after a
        loss). `tenant`: (hash, rpm, tpm, max_inflight, tokens reserved, the epoch of this
        worker's last rewrite); then the reply ends with the tenant's buckets (rq, rq_at, tk, tk_at, the store's
        time). `settle`: this worker's batch of (hash, ended, tokens, tpm), flat."""
        args = (
            self.k_inflight,
            self.k_mine,
            self.k_rate,
            self.k_epoch,
            self.k_tenants,
            ended,
            cap,
            ttl_ms,
            rate,
            burst_milli,
            self.prefix,
            *(tenant or NO_TENANT),
            *settle,
        )
        self.round_trips += 1
        try:
            if not self.resp.connected:  # (the first call, or the connection dropped since the last)
                await self.resp.connect()
            (fut,) = self.resp.send(encode("EVALSHA", self._admit.sha, 5, *args))  # no coroutine, no timer: `check`
            reply = await fut
        except RespError as e:
            self.errors += 1
            raise StoreDown(str(e)) from None
        if isinstance(reply, RespError):  # NOSCRIPT: a Redis that restarted has forgotten it
            (reply,) = await self._counted(encode("EVAL", ADMIT, 5, *args))
        if isinstance(reply, RespError):
            self.errors += 1
            raise StoreDown(str(reply))
        verdict, wait_us, *rest = reply
        return (int(verdict), int(wait_us) / 1e6, *rest)

    async def settle(self, ended: int, ttl_ms: int, settle: tuple) -> list:
        """This worker's ended requests and its tenants' batch (as `admit`'s); [the store's time, then per tenant
        settled with tokens: hash, tk, tk_at]."""
        args = (2, self.k_mine, self.k_tenants, ended, ttl_ms, 0, 0, 0, self.prefix, *settle)
        return await self._script(self._settle, SETTLE, *args)

    async def ended(self, ended: int, ttl_ms: int) -> None:
        """`ended` of this worker's requests ended (and it lives: its keys' expiry moves)."""
        expire = (encode("PEXPIRE", self.k_mine, ttl_ms), encode("PEXPIRE", self.k_tenants, ttl_ms))
        if ended:
            await self._counted(encode("DECRBY", self.k_mine, ended), *expire)
        else:
            await self._counted(*expire)

    async def rewrite(self, count: int, ttl_ms: int, settling_ms: int, workers: int, tenants: tuple) -> bytes:
        """After the store lost its data: this worker's count, its tenants' counts and its views of their buckets
        (`tenants`: per tenant nine values, see REWRITE), and the workers it expects to write theirs (0: unknown);
        the store's epoch."""
        args = (4, self.k_epoch, self.k_inflight, self.k_mine, self.k_tenants, os.urandom(8).hex(), count, ttl_ms)
        return await self._script(self._rewrite, REWRITE, *args, settling_ms, workers, self.prefix, *tenants)

    async def sync(self, report: bytes, ttl_ms: int, settling_ms: int) -> tuple[int, dict[str, bytes], bytes]:
        """Publish this replica's report; (the instance set's version, the other live replicas' reports, the
        store's epoch)."""
        version, flat, epoch = await self._call(
            self._sync(
                keys=(self.k_replicas, self.k_replica, self.k_version, self.k_epoch),
                args=(self.replica, report, ttl_ms, self.prefix, os.urandom(8).hex(), settling_ms),
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
            await self._counted(
                encode("DEL", self.k_mine, self.k_tenants), encode("SREM", self.k_inflight, self.k_mine)
            )
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
