"""Cluster mode: this replica's side of what the replicas share through the store (state/cluster.py).

Nothing here is on a request's path except the one round trip a request makes when a cluster-wide limit
(`max_inflight_requests`, the rate limit) is configured or its tenant has a quota (tenant_config's rpm, tpm,
max_inflight; serving/tenants.py asks, serving/cluster_quotas.py keeps the worker's books): `admit`. The rest runs
on a timer every `sync_interval_ms`:

- every worker tells the store its requests ended (and its tenants' ended requests and tokens served, in one
  batch) when there are any, and at least every third of `replica_ttl_s` so that its keys live; after the store
  lost its data it writes its counts and its last word on its tenants' buckets again (no tenant's quota is
  decided until every worker of the live replicas has, or one silent would count as gone: `settling_ms`);
- the sync owner (worker 0) publishes this replica's report (load and its streams' tightest TPOT budget per
  endpoint address; the endpoints its breakers or health checks found broken; what slo_aware learned) and reads
  the others' in the same round trip: their load and budgets become the ledger's remote row, their broken
  endpoints are avoided here until they say otherwise, a model learned from more samples than this replica's
  replaces it, and a newer stored instance set is adopted; when the store's epoch changed (it lost its data),
  every worker writes its count again and the stored set is adopted whatever its version (or, none stored, this
  one's seeds it);
- the sync owner also listens on the events channel: trigger-mode prefill usage and stored responses' homes
  that another replica saw, written here as if a local worker had.

When the store fails or is slow, every worker carries on: limits fall back to this replica's share of the
global value (`replicas` as last seen), the instance set stays as it was, and each timer tick tries again; the
sync owner logs each transition once and sets the gauge. A refresh needs the store (it must reach every
replica): without it, it is refused (503).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import socket
import time
import uuid

import ujson

from config import Live, address_key
from errors import RateLimited
from scheduling.affinity import PrefixIndex
from scheduling.ledger import LOAD_FIELDS, tightest_us
from scheduling.policies import PrefixSource
from scheduling.registry import RefreshError, RefreshResult, Registry
from serving.cluster_quotas import StoreQuotas
from serving.metrics import store_calls
from state.cluster import ClusterStore, StoreDown
from state.shared import BREAKER_OPEN, REMOTE_ROW, SharedState, worker_rows, write_replicas

log = logging.getLogger("coordinator.cluster")
SETTLING_TRIES = 4  # an admit that finds the store lost its data: written again and asked again, this many times
REFRESH_TRIES = 5  # a refresh that keeps losing the race to other replicas' refreshes is refused (409)
# What slo_aware learned about an endpoint (scheduling/predict.py): a replica that has learned less of an endpoint
# (fewer prefill plus decode samples) than another takes the other's whole model of it.
LEARNED = (
    "prefill_tps",
    "decode_step_s",
    "decode_per_seq_s",
    "queue_delay_s",
    "prefill_base_s",
    *("pf_n", "pf_sx", "pf_sy", "pf_sxx", "pf_sxy"),
    *("dc_n", "dc_sx", "dc_sy", "dc_sxx", "dc_sxy"),
    "late_share",
    "tpot_late_share",
)
COUNTS = LOAD_FIELDS  # a replica's load of an endpoint, in this order in its report


def replica_id() -> str:
    """This replica's name in the store: the pod's host name, made unique per start (a restarted pod is a new
    replica; the old one's entries expire)."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def read_password(path: str) -> str | None:
    if not path:
        return None
    with open(path, encoding="utf-8") as f:
        return f.read().strip()


class Cluster:
    """One worker's part in cluster mode (see the module docstring)."""

    def __init__(
        self,
        live: Live,
        shared: SharedState,
        worker: int,
        replica: str,
        registry: Registry,
        on_event=None,
    ):
        c = live.s.cluster
        self.live, self.shared, self.worker, self.replica, self.registry = live, shared, worker, replica, registry
        registry.store = self  # a change of the instance set reaches every replica (`refresh`)
        self.on_event = on_event  # (kind, payload dict): an event another replica published
        password = read_password(c.redis_password_file)
        self.store = ClusterStore(c.redis_url, password, c.key_prefix, c.redis_timeout_ms / 1000, replica, worker)
        self.interval_s = c.sync_interval_ms / 1000
        self.ttl_ms = int(c.replica_ttl_s * 1000)
        # After the store lost its data, no tenant's quota is decided until every worker of the live replicas wrote
        # its part again (the store counts them), or for at most this: a worker silent longer would count as gone.
        self.settling_ms = self.ttl_ms + 2 * c.sync_interval_ms
        if not shared.globals.cluster_workers:  # before the first sync: this replica's (a fresh store holds nothing)
            shared.globals.cluster_workers = live.s.num_workers
        self.connected = True  # until a round trip says otherwise
        self.owner = worker == 0
        self.rows = worker_rows(self.shared, worker, live.s.num_workers)  # as the door's
        self.tasks: list[asyncio.Task] = []
        # This worker's requests the store counted: in flight, ended and not yet taken off there, and the admit
        # calls under way; `recount`: the store may have lost or mistaken the count (it was away), set it again.
        self.admitted = self.ended = self.calls = 0
        self.recount = True  # (at start too: after a loss the store waits for every worker's part, this one's too)
        self.quotas = StoreQuotas()  # its tenants' quotas (serving/tenants.py charges them here)
        self.written_epoch = ""  # the store's epoch when this worker last wrote its part (`_rewrite`)
        self._rewriting: asyncio.Future | None = None
        self._told_at = 0.0
        self._refused_version: int | None = None  # the stored set this replica cannot apply: said once, not each tick
        self.losses_seen = self.shared.globals.store_losses
        self.epoch: bytes | None = None  # the sync owner's: the store's epoch as its last sync saw it
        self._lost_at_ms = 0  # the sync owner's: when it found the store had lost its data (wall-clock ms)
        self.prefixes: list[tuple[str, list[int]]] = []  # (engine address, block hashes) prefilled, to publish
        self._publishing: set[asyncio.Task] = set()

    @property
    def replicas(self) -> int:
        """Live replicas, this one included, as the last sync saw them."""
        return max(1, int(self.shared.globals.replicas))

    # -- the request path -------------------------------------------------------------------------------

    async def admit(self, place, cap: int, rate: float, burst_milli: int) -> None:
        """The cluster-wide cap and rate for one request (its door `place`), and its tenant's quota when it has
        one (`place.tenant`, serving/tenants.py's Ask); RateLimited if refused. Without the store: this replica's
        share of the cap and of the tenant's quota."""
        ask = place.tenant
        ended, self.ended = self.ended, 0
        settle = self.quotas.batch()
        self.calls += 1
        try:
            tenant = ask.args(self.written_epoch) if ask is not None else ()
            reply = await self.store.admit(ended, cap, self.ttl_ms, rate, burst_milli, tenant, settle)
            rewrites = 0
            while reply[0] in (3, 5):
                if reply[0] == 3:  # the store lost its data since this worker wrote its part: written again first
                    rewrites += 1
                    if rewrites > SETTLING_TRIES:
                        raise StoreDown("the store lost its data again while the workers wrote their part")
                    self.quotas.restore(settle)
                    settle = ()
                    await self._rewrite()
                else:  # the workers are writing their part again: asked again at each tick until all have
                    await asyncio.sleep(min(reply[1], self.interval_s))
                reply = await self.store.admit(0, cap, self.ttl_ms, rate, burst_milli, ask.args(self.written_epoch))
        except StoreDown as e:
            self.ended += ended
            self.quotas.restore(settle)
            self._down(e)
            self.share_check(cap)
            if ask is not None:
                ask.fallback()
            return
        finally:
            self.calls -= 1
        self._up()
        self._told_at = time.monotonic()
        verdict, wait_s = reply[0], reply[1]
        if ask is not None and len(reply) > 3:
            self.quotas.seen(ask.key, reply[3:], ask.rpm, ask.tpm)
        if verdict == 0:
            self.admitted += 1
            place.clustered = True
            if ask is not None:
                self.quotas.admit(ask.key)
                ask.answer("", 0.0, reply[3:])
        elif verdict == 1:
            raise RateLimited(f"too many requests in flight (limit {cap} across the cluster)", reason="inflight_cap")
        elif verdict == 2:
            raise RateLimited.by_rate(self.live.s.error_message, self.live.s.error_status_code, wait_s)
        else:
            ask.answer(reply[2].decode(), wait_s, reply[3:])

    def left(self) -> None:
        """A request the store counted ended: taken off at the next call or tick."""
        self.admitted -= 1
        self.ended += 1

    async def _rewrite(self) -> None:
        """After the store lost its data (or this worker's first call): its count, its tenants' counts and its views
        of their buckets written again (the pending ended requests are in the counts), and the epoch noted."""
        if self._rewriting is None:
            self._rewriting = asyncio.ensure_future(self._write_again())
        task = self._rewriting
        try:
            await asyncio.shield(task)
        finally:
            if task.done():
                self._rewriting = None

    async def _write_again(self) -> None:
        self.ended = 0
        # The workers the store waits for: the live replicas' before the loss (0: unknown). A worker may write before
        # its sync owner found the loss: then the replicas as last seen are still those before it.
        g = self.shared.globals
        workers, tenants = int(max(g.cluster_workers, g.workers_at_loss)), self.quotas.written()
        epoch = await self.store.rewrite(self.admitted, self.ttl_ms, self.settling_ms, workers, tenants)
        self.written_epoch = epoch.decode() if isinstance(epoch, bytes) else str(epoch)
        self.recount = False

    def share(self, cap: int) -> int:
        """This replica's share of a cluster-wide cap while the store is away (at least one)."""
        return max(1, math.ceil(cap / self.replicas))

    def share_check(self, cap: int) -> None:
        if not cap:
            return
        if sum(row.inflight for row in self.rows) > self.share(cap):
            raise RateLimited(
                f"too many requests in flight (this replica's share {self.share(cap)} of {cap}: the cluster store is"
                " unreachable)",
                reason="inflight_cap",
            )

    # -- the management plane ---------------------------------------------------------------------------

    async def refresh(self, event: str, items: list) -> RefreshResult:
        """A refresh for every replica: applied here on top of the stored set, then stored if nobody stored
        another meanwhile (else again); the other replicas adopt it at their next sync."""
        for _ in range(REFRESH_TRIES):
            try:
                version, doc = await self.store.instances()
            except StoreDown as e:
                self._down(e)
                raise RefreshError(
                    "the cluster store is unreachable: a refresh now would reach this replica only; retry when"
                    " GET /instances says the store is connected",
                    503,
                ) from None
            if doc is not None and version != self.shared.globals.cluster_version:
                self._adopt(version, doc)
            result = self.registry.apply(event, items)
            # The version stays the one read while the store below runs: a sync meanwhile then adopts only a set
            # another replica stored after it (this one's store then fails and is tried again on top of it), never
            # the set this refresh changed.
            try:
                stored = await self.store.store_instances(version, ujson.dumps(self.registry.export()).encode())
            except StoreDown as e:
                self._unstored()
                self._down(e)
                raise RefreshError("the cluster store failed while storing the refresh: retry", 503) from None
            if stored >= 0:
                self.shared.globals.cluster_version = stored
                return result
        self._unstored()
        raise RefreshError("other replicas' refreshes kept coming first: retry", 409)

    def _unstored(self) -> None:
        """This replica's set is a refresh the store did not take: the next sync adopts the stored one, whatever
        its version."""
        self.shared.globals.cluster_version = -1

    def status(self) -> dict:
        return {
            "replica": self.replica,
            "store": "connected" if self.shared.globals.store_up == 1 else "disconnected",
            "replicas": self.replicas,
            "instances_version": int(self.shared.globals.cluster_version),
        }

    # -- the timer ---------------------------------------------------------------------------------------

    def start(self) -> None:
        self.tasks.append(asyncio.create_task(self._every_tick()))
        if self.owner:
            self.tasks.append(asyncio.create_task(self._listen()))

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.store.leave()
        await self.store.close()

    async def _every_tick(self) -> None:
        if self.owner:
            await self._first_sync()
        while True:
            await asyncio.sleep(self.interval_s)
            self.store.check()
            try:
                await self._publish_count()
                if self.prefixes:
                    entries, self.prefixes = self.prefixes, []
                    await self.store.publish_event(
                        ujson.dumps({"kind": "prefix", "from": self.replica, "entries": entries}).encode()
                    )
                if self.owner:
                    await self._sync()
                self._up()
            except StoreDown as e:
                self._down(e)
            except Exception:  # a bug here must not stop the timer
                log.exception("cluster sync failed")
            store_calls(self.store)

    async def _publish_count(self) -> None:
        now = time.monotonic()
        if self.losses_seen != self.shared.globals.store_losses:  # (a connection may reconnect without an error)
            self.losses_seen, self.recount = self.shared.globals.store_losses, True
        if self.recount:
            if not self.calls:  # (an admit under way would be counted twice)
                await self._rewrite()
                self._told_at = now
        elif self.ended or self.quotas.pending or now - self._told_at > self.ttl_ms / 3000:
            ended, self.ended = self.ended, 0
            settle = self.quotas.batch()
            try:
                if settle:
                    self.quotas.settled(await self.store.settle(ended, self.ttl_ms, settle))
                else:
                    await self.store.ended(ended, self.ttl_ms)
            except StoreDown:
                self.ended += ended
                self.quotas.restore(settle)
                raise
            self._told_at = now

    async def _first_sync(self) -> None:
        """At start: the stored instance set if there is one (it wins over the static config), else this one's."""
        try:
            version, doc = await self.store.instances()
            if doc is not None:
                self._adopt(version, doc)
            else:
                stored = await self.store.store_instances("seed", ujson.dumps(self.registry.export()).encode())
                if stored >= 0:
                    self.shared.globals.cluster_version = stored
            self._up()
        except StoreDown as e:
            self._down(e)
        finally:
            self.shared.globals.first_synced = 1  # (readiness waits for it: handlers/management.py)

    async def _sync(self) -> None:
        version, reports, epoch = await self.store.sync(self._report(), self.ttl_ms, self.settling_ms)
        g = self.shared.globals
        g.synced_at_ms = now_ms = int(time.time() * 1000)
        if epoch != self.epoch:  # (before the reports: those of replicas that have not written since are gone)
            if self.epoch is not None:
                self._lost()
                g.workers_at_loss, self._lost_at_ms = g.cluster_workers, now_ms
            self.epoch = epoch
        elif g.workers_at_loss and now_ms - self._lost_at_ms > self.settling_ms:
            g.workers_at_loss = 0
        g.replicas = len(reports) + 1
        self._apply_reports(reports)
        if version == 0:  # nothing stored (the store was emptied, or unreachable at start)
            await self._first_sync()
        elif version > self.shared.globals.cluster_version:
            stored, doc = await self.store.instances()
            if doc is not None:
                self._adopt(stored, doc)

    def _lost(self) -> None:
        """The store lost its data: every worker re-publishes its count, and the stored instance set (which
        another replica may have re-seeded, at a version below this one's) is adopted whatever its version."""
        log.warning(
            "the cluster store lost its data (restarted empty, failed over or flushed): counts and the instance set"
            " go back"
        )
        self.shared.globals.store_losses += 1
        self.shared.globals.cluster_version = -1
        self._refused_version = None

    def _adopt(self, version: int, doc: bytes) -> None:
        try:
            result = self.registry.adopt(ujson.loads(doc))
        except (ValueError, RefreshError) as e:
            if version != self._refused_version:
                log.error("the stored instance set (version %d) cannot be applied here: %s", version, e)
                self._refused_version = version
            return
        self.shared.globals.cluster_version = version
        log.info("instances from the cluster store (version %d): %s", version, result.message)

    def _report(self) -> bytes:
        """This replica's load per endpoint address (its workers' rows), and the endpoints it finds broken."""
        ledger, now = self.shared.ledger, time.time()
        rows = [ledger[row].slots for row in range(self.live.s.num_workers)]
        load, avoid, learned, floors = {}, {}, {}, {}
        for t in self.registry.view().targets:
            mine = [row[t.slot] for row in rows]
            counts = [sum(getattr(c, f) for c in mine) for f in COUNTS]
            if any(counts):
                load[address_key(t.address)] = counts
            if floor := tightest_us(c.tpot_floor_us for c in mine):
                floors[address_key(t.address)] = floor
            e = self.shared.endpoints[t.slot]
            if e.healthy < 0.5:
                avoid[address_key(t.address)] = now + self.ttl_ms / 1000
            elif e.breaker == BREAKER_OPEN and e.open_until > now:
                avoid[address_key(t.address)] = e.open_until
            if e.pf_n or e.dc_n:
                learned[address_key(t.address)] = [getattr(e, f) for f in LEARNED]
        started = self.shared.globals.started_ms
        report = {"load": load, "avoid": avoid, "learned": learned, "started": started, "at": int(now * 1000)}
        report["tpot_floor_us"] = floors
        report["workers"] = self.live.s.num_workers  # (what the store waits for after a loss: `_write_again`)
        return ujson.dumps(report).encode()

    def _apply_reports(self, reports: dict[str, bytes]) -> None:
        """The other replicas' load into the remote row, and their broken endpoints into `avoid_until`."""
        load: dict[str, list[int]] = {}
        avoid: dict[str, float] = {}
        learned: dict[str, list[float]] = {}  # the most samples another replica has of each endpoint
        floors: dict[str, int] = {}  # the tightest TPOT budget of another replica's streams on each endpoint
        n_pf, n_dc = LEARNED.index("pf_n"), LEARNED.index("dc_n")
        replicas = [(self.replica, self.shared.globals.started_ms, int(time.time() * 1000))]
        workers = self.live.s.num_workers  # the live replicas' (0 once one does not say: unknown)
        for replica, raw in reports.items():
            try:
                report = ujson.loads(raw)
                replicas.append((replica, int(report.get("started", 0)), int(report.get("at", 0))))
                told = report.get("workers")
                workers = workers + told if workers and isinstance(told, int) and told > 0 else 0
                for addr, model in report.get("learned", {}).items():
                    if len(model) == len(LEARNED) and (
                        addr not in learned or model[n_pf] + model[n_dc] > learned[addr][n_pf] + learned[addr][n_dc]
                    ):
                        learned[addr] = [float(v) for v in model]
                for addr, counts in report.get("load", {}).items():
                    total = load.setdefault(addr, [0] * len(COUNTS))
                    for f, v in enumerate(counts[: len(COUNTS)]):
                        total[f] += int(v)
                for addr, until in report.get("avoid", {}).items():
                    avoid[addr] = max(avoid.get(addr, 0.0), float(until))
                for addr, us in report.get("tpot_floor_us", {}).items():
                    floors[addr] = tightest_us([floors.get(addr, 0), int(us)])
            except (ValueError, TypeError, AttributeError):
                workers = 0
                continue  # a report this version cannot read
        write_replicas(self.shared, replicas)
        self.shared.globals.cluster_workers = workers
        remote = self.shared.ledger[REMOTE_ROW].slots
        for t in self.registry.view().targets:
            addr, theirs = address_key(t.address), remote[t.slot]
            counts = load.get(addr)
            for f, name in enumerate(COUNTS):
                setattr(theirs, name, counts[f] if counts else 0)
            theirs.tpot_floor_us = floors.get(addr, 0)
            e = self.shared.endpoints[t.slot]
            e.avoid_until = avoid.get(addr, 0.0)
            model = learned.get(addr)
            if model is not None and model[n_pf] + model[n_dc] > e.pf_n + e.dc_n + 1:
                with self.shared.lock:  # the predictor's multi-field updates take it too
                    for name, v in zip(LEARNED, model):
                        setattr(e, name, v)

    # -- events between replicas ------------------------------------------------------------------------

    def publish(self, kind: str, payload: dict) -> None:
        """Tell the other replicas (fire and forget: a lost event costs what a local miss costs)."""
        event = ujson.dumps({"kind": kind, "from": self.replica, **payload}).encode()
        task = asyncio.get_running_loop().create_task(self._publish(event))
        self._publishing.add(task)  # (a task nobody holds may be collected before it runs)
        task.add_done_callback(self._publishing.discard)

    async def _publish(self, event: bytes) -> None:
        try:
            await self.store.publish_event(event)
        except StoreDown as e:
            self._down(e)

    async def _listen(self) -> None:
        while True:
            pubsub = self.store.pubsub()
            try:
                await pubsub.subscribe(self.store.k_events)
                async for message in pubsub.listen():
                    if message.get("type") != "message":
                        continue
                    try:
                        event = ujson.loads(message["data"])
                    except ValueError:
                        continue
                    if event.get("from") != self.replica and self.on_event is not None:
                        self.on_event(event.get("kind"), event)
            except asyncio.CancelledError:
                raise
            except Exception:  # the store went away: listen again once it is back
                await asyncio.sleep(self.interval_s * 4)
            finally:
                try:
                    await pubsub.aclose()
                except Exception:
                    pass

    # -- the store's state -------------------------------------------------------------------------------

    def _down(self, why: StoreDown) -> None:
        self.recount = True
        if self.connected:
            self.connected = False
            if self.owner:
                self.shared.globals.store_up = 0
                log.warning(
                    "cluster store unreachable (%s): serving on the last instance set, limits at this replica's"
                    " share (1/%d)",
                    why,
                    self.replicas,
                )

    def _up(self) -> None:
        if not self.connected or (self.owner and self.shared.globals.store_up != 1):
            was = self.connected
            self.connected = True
            if self.owner:
                self.shared.globals.store_up = 1
                if not was:
                    log.warning("cluster store reachable again: cluster-wide state and limits resume")


class ClusterResponseHomes:
    """ResponseHomes for replicas: this replica's table (`local`), told of every other replica's stored responses
    through the events channel (see `on_event`), so a follow-up turn may come to any replica."""

    def __init__(self, local, cluster: Cluster):
        self.local, self.cluster = local, cluster

    def remember(self, response_id: str, instance_id: int, endpoint_id: int, owner: int) -> None:
        self.local.remember(response_id, instance_id, endpoint_id, owner)
        event = {"id": response_id, "instance": instance_id, "endpoint": endpoint_id, "owner": owner}
        self.cluster.publish("home", event)

    def home(self, response_id: str, owner: int) -> tuple[int, int] | None:
        return self.local.home(response_id, owner)

    def forget(self, response_id: str) -> None:
        self.local.forget(response_id)
        self.cluster.publish("forget", {"id": response_id})


def shared_events(cluster: Cluster, usages, homes, prefixes: PrefixSource | None) -> None:
    """Wire trigger mode's prefill usage (serving/usage.py), the stored responses' homes and the scheduler's
    cached prefixes (`prefixes`, when they are the Coordinator's own estimate: engines that report their cache
    report it to every replica) to the other replicas: what this replica writes is published (the prefixes in
    one batch a tick), what another publishes is written here."""
    usages.share = lambda ticket, prompt, cached: cluster.publish(
        "usage", {"id": ticket, "prompt": prompt, "cached": cached}
    )
    index = prefixes if isinstance(prefixes, PrefixIndex) else None
    if index is not None:
        registry = cluster.registry

        def share_prefix(hashes: list[int], slot: int) -> None:
            t = registry.view().by_slot.get(slot)
            if hashes and t is not None:
                cluster.prefixes.append((t.address, hashes))

        index.share = share_prefix

    def on_event(kind: str, event: dict) -> None:
        if kind == "prefix" and index is not None:
            slots = {address_key(t.address): t.slot for t in cluster.registry.view().targets}
            for entry in event.get("entries") or ():
                try:
                    address, hashes = entry
                    slot = slots.get(address_key(address))
                    if slot is not None:
                        index.write([int(h) for h in hashes], slot)
                except (TypeError, ValueError):
                    continue
            return
        rid = event.get("id")
        if not isinstance(rid, str):
            return
        if kind == "usage" and isinstance(event.get("prompt"), int):
            cached = event.get("cached")
            usages.put_counts(rid, event["prompt"], cached if isinstance(cached, int) else None)
        elif kind == "home" and all(isinstance(event.get(k), int) for k in ("instance", "endpoint", "owner")):
            homes.local.remember(rid, event["instance"], event["endpoint"], event["owner"])
        elif kind == "forget":
            homes.local.forget(rid)

    cluster.on_event = on_event
