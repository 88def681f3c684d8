"""The engine gauges and latency histograms the scheduler uses, out of a vLLM /metrics page.

One worker scrapes every engine once per `metrics_scrape_interval` for all workers (serving/background.py)
and writes what it read into the shared health table: the gauges as they are, the histograms as the
mean TTFT and inter-token latency of the requests that finished during the last interval.
"""

from __future__ import annotations

from scheduling.health import Health

WANTED = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_usage",
    "vllm:gpu_cache_usage_perc": "kv_usage",  # the name before vLLM 0.10
    "vllm:time_to_first_token_seconds_sum": "ttft_sum",
    "vllm:time_to_first_token_seconds_count": "ttft_count",
    "vllm:inter_token_latency_seconds_sum": "itl_sum",
    "vllm:inter_token_latency_seconds_count": "itl_count",
    "vllm:time_per_output_token_seconds_sum": "itl_sum",  # the name before vLLM 0.11
    "vllm:time_per_output_token_seconds_count": "itl_count",
}


# An info gauge: its labels are the engine's cache config, among them the KV cache's size in blocks.
CACHE_INFO = "vllm:cache_config_info"
# The waiting requests by reason (vLLM 0.32 writes it; older ones may not): "capacity" waits for a place in the
# batch, "deferred" for a transient cause such as its KV transfer.
WAITING_BY_REASON = "vllm:num_requests_waiting_by_reason"


def _label(line: str, name: str) -> str:
    start = line.find(f',{name}="')
    if start < 0:
        start = line.find(f'{{{name}="')
    if start < 0:
        return ""
    start += len(name) + 3
    return line[start : line.find('"', start)]


def parse_engine_metrics(text: str) -> dict[str, float]:
    """Sum each wanted sample over its label sets (one engine may report several model or engine labels)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name_end = len(line)
        for sep in ("{", " "):
            i = line.find(sep)
            if 0 < i < name_end:
                name_end = i
        name = line[:name_end]
        if name == CACHE_INFO:
            blocks = _label(line, "num_gpu_blocks")
            if blocks.isdigit():
                out["cache_blocks"] = out.get("cache_blocks", 0.0) + float(blocks)
            continue
        key = (
            "waiting_capacity"
            if name == WAITING_BY_REASON and _label(line, "reason") == "capacity"
            else WANTED.get(name)
        )
        if key is None:
            continue
        try:
            value = float(line.rsplit(" ", 1)[-1])
        except ValueError:
            continue
        out[key] = out.get(key, 0.0) + value
    return out


class EngineScrapes:
    """Turns successive scrapes of each slot into shared gauges and per-interval latency means."""

    def __init__(self, health: Health):
        self.health = health
        self.last: dict[int, dict[str, float]] = {}  # slot -> the previous scrape's histogram totals

    def update(self, slot: int, m: dict[str, float], decode: bool = False) -> None:
        """One scrape of `slot` (`decode`: a decode engine's, whose queue says how many sequences it runs at most)."""
        self.health.set_engine_load(slot, m.get("running", 0.0), m.get("waiting", 0.0), m.get("kv_usage", 0.0))
        self.health.put(slot, "cache_blocks", m.get("cache_blocks", 0.0))
        prev = self.last.get(slot)
        self.last[slot] = m
        if prev is None:
            return
        if decode:
            self._seq_cap(slot, prev, m)
        for name, field in (("ttft", "engine_ttft_s"), ("itl", "engine_itl_s")):
            count = m.get(f"{name}_count", 0.0) - prev.get(f"{name}_count", 0.0)
            total = m.get(f"{name}_sum", 0.0) - prev.get(f"{name}_sum", 0.0)
            if count > 0 and total >= 0:  # a counter reset (engine restart) gives a negative delta: skip it
                self.health.put(slot, field, total / count)
                if name == "itl":  # tokens came, so at least one sequence ran, whatever the gauges caught
                    batch = (prev.get("running", 0.0) + m.get("running", 0.0)) / 2.0
                    self.health.put(slot, "engine_itl_batch", max(batch, 1.0))

    def _seq_cap(self, slot: int, prev: dict[str, float], m: dict[str, float]) -> None:
        """A decode engine that ran as many sequences in two scrapes in a row while requests waited for a place
        both times runs no more than that at once (vLLM's max_num_seqs, or what its KV cache held): `seq_cap`, the
        most seen. Requests waiting for their KV transfer are no sign of it: without vLLM's reasons for waiting,
        two scrapes alike are what tells a steady queue from a transfer's moment."""
        running = m.get("running", 0.0)
        if running < 1.0 or running != prev.get("running") or running <= self.health.get(slot, "seq_cap"):
            return
        if min(s.get("waiting_capacity", s.get("waiting", 0.0)) for s in (prev, m)) >= 1.0:
            self.health.put(slot, "seq_cap", running)
