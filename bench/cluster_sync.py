"""Cluster mode: how long a refresh on one replica takes to reach every replica.

    python bench/cluster_sync.py                  # 3 replicas of 2 workers, 20 refreshes
    python bench/cluster_sync.py --replicas 5 --refreshes 50 --sync-interval-ms 100

Starts a real redis-server and `--replicas` Coordinators (two workers each) on loopback, with two engine
simulators. Each round sends one refresh (alternately pausing and resuming instance 2) to a replica in turn,
then polls every replica's `GET /instances` until each shows it. Printed: the refresh's own answer time and the
time until the last replica showed it (median, 90th percentile, worst), beside the sync interval, which bounds
the wait when no process is starved of CPU. The tests only check that a refresh arrives everywhere: a bound in
seconds belongs here, where a loaded machine shows as a slower figure rather than a failed build.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine_sim import SimConfig, launch
from harness.configs import coordinator_config, instance
from harness.coordinator import Coordinator
from harness.redis import RedisServer

MODEL = "bench"


def paused(coord: Coordinator) -> list[int]:
    rows = coord.instances()["instances"]
    return sorted(i["id"] for i in rows if i.get("paused"))


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--refreshes", type=int, default=20)
    parser.add_argument("--sync-interval-ms", type=int, default=50)
    args = parser.parse_args()

    redis = RedisServer()
    engines = [launch(SimConfig(role="union", model=MODEL, speedup=50.0)) for _ in range(2)]
    replicas: list[Coordinator] = []
    try:

        def config() -> dict:  # (each replica its own ports)
            return coordinator_config(
                [instance(i + 1, "union", MODEL, e.address) for i, e in enumerate(engines)],
                inference_workers_config={"num_workers": 2},
                cluster_config={
                    "redis_url": redis.url,
                    "key_prefix": "motor:bench-sync:",
                    "sync_interval_ms": args.sync_interval_ms,
                },
            )

        with ThreadPoolExecutor(args.replicas) as pool:
            replicas = list(pool.map(lambda _: Coordinator(config()), range(args.replicas)))
        answered, arrived = [], []
        for n in range(args.refreshes):
            event, want = ("pause", [2]) if n % 2 == 0 else ("resume", [])
            start = time.monotonic()
            reply = replicas[n % len(replicas)].refresh(event, [2])
            answered.append(time.monotonic() - start)
            if reply.status_code != 200:
                raise SystemExit(f"refresh {n} answered {reply.status_code}: {reply.text}")
            waiting = set(range(len(replicas)))
            while waiting:
                waiting = {r for r in waiting if paused(replicas[r]) != want}
                if time.monotonic() - start > 30:
                    raise SystemExit(f"refresh {n} did not reach replicas {sorted(waiting)} in 30 s")
                time.sleep(0.005)
            arrived.append(time.monotonic() - start)
        print(
            f"{args.replicas} replicas x 2 workers, sync every {args.sync_interval_ms} ms, {args.refreshes} refreshes"
            f" (load average {os.getloadavg()[0]:.1f})"
        )
        for name, values in (("refresh answered", answered), ("every replica shows it", arrived)):
            print(
                f"  {name:<24} median {statistics.median(values) * 1000:7.1f} ms"
                f"  p90 {quantile(values, 0.9) * 1000:7.1f} ms  worst {max(values) * 1000:7.1f} ms"
            )
    finally:
        for coord in replicas:
            coord.stop()
        for e in engines:
            e.stop()
        redis.stop()


if __name__ == "__main__":
    main()
