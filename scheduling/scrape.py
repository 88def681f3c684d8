"""Parsing the few engine gauges the scheduler uses out of a vLLM /metrics page (Prometheus text)."""

from __future__ import annotations

WANTED = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_usage",
    "vllm:gpu_cache_usage_perc": "kv_usage",  # the name before vLLM 0.10
}


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
        key = WANTED.get(line[:name_end])
        if key is None:
            continue
        try:
            value = float(line.rsplit(" ", 1)[-1])
        except ValueError:
            continue
        out[key] = out.get(key, 0.0) + value
    return out
