"""Prometheus text exposition of a sim server, named and labelled like vLLM's /metrics."""

from __future__ import annotations


def _esc(v: str) -> str:
    return str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render(server) -> str:
    eng = server.engine
    eng.expire_tickets()
    lab = f'engine="0",model_name="{_esc(server.cfg.model)}"'
    out = []

    def metric(name, typ, help_, samples):
        out.append(f"# HELP {name} {help_}")
        out.append(f"# TYPE {name} {typ}")
        out.extend(samples)

    metric(
        "vllm:num_requests_running",
        "gauge",
        "Number of requests in model execution batches.",
        [f"vllm:num_requests_running{{{lab}}} {float(len(eng.running))}"],
    )
    metric(
        "vllm:num_requests_waiting",
        "gauge",
        "Number of requests waiting to be processed.",
        [f"vllm:num_requests_waiting{{{lab}}} {float(len(eng.waiting))}"],
    )
    metric(  # every waiting request here waits for a place in the batch (its KV is pulled before it queues)
        "vllm:num_requests_waiting_by_reason",
        "gauge",
        "Number of waiting requests by reason. Sum of all reasons equals vllm:num_requests_waiting.",
        [
            f'vllm:num_requests_waiting_by_reason{{{lab},reason="capacity"}} {float(len(eng.waiting))}',
            f'vllm:num_requests_waiting_by_reason{{{lab},reason="deferred"}} 0.0',
        ],
    )
    metric(
        "vllm:kv_cache_usage_perc",
        "gauge",
        "KV-cache usage. 1 means 100 percent usage.",
        [f"vllm:kv_cache_usage_perc{{{lab}}} {eng.kv_usage()}"],
    )
    metric(
        "vllm:cache_config_info",
        "gauge",
        "Information of the LLMEngine CacheConfig",
        [
            f'vllm:cache_config_info{{block_size="{server.cfg.block_size}",enable_prefix_caching="True",'
            f'engine="0",num_gpu_blocks="{eng.prefix_cap}"}} 1.0'
        ],
    )
    metric(
        "vllm:prefix_cache_queries_total",
        "counter",
        "Prefix cache queries, in terms of number of queried tokens.",
        [f"vllm:prefix_cache_queries_total{{{lab}}} {float(eng.prefix_queries)}"],
    )
    metric(
        "vllm:prefix_cache_hits_total",
        "counter",
        "Prefix cache hits, in terms of number of cached tokens.",
        [f"vllm:prefix_cache_hits_total{{{lab}}} {float(eng.prefix_hits)}"],
    )
    metric(
        "vllm:prompt_tokens_total",
        "counter",
        "Number of prefill tokens processed.",
        [f"vllm:prompt_tokens_total{{{lab}}} {float(eng.stats['prompt_tokens'])}"],
    )
    metric(
        "vllm:prompt_tokens_by_source_total",
        "counter",
        "Number of prompt tokens by source.",
        [f'vllm:prompt_tokens_by_source_total{{{lab},source="{src}"}} {float(v)}' for src, v in eng.by_source.items()],
    )
    metric(
        "vllm:generation_tokens_total",
        "counter",
        "Number of generation tokens processed.",
        [f"vllm:generation_tokens_total{{{lab}}} {float(eng.stats['generation_tokens'])}"],
    )
    reasons = ("stop", "length", "abort")
    succ = [
        f'vllm:request_success_total{{{lab},finished_reason="{r}"}} {float(eng.success.get(r, 0))}' for r in reasons
    ]
    succ += [
        f'vllm:request_success_total{{{lab},finished_reason="{r}"}} {float(v)}'
        for r, v in eng.success.items()
        if r not in reasons
    ]
    metric("vllm:request_success_total", "counter", "Count of successfully processed requests.", succ)
    metric(
        "vllm:time_to_first_token_seconds",
        "histogram",
        "Histogram of time to first token in seconds.",
        eng.ttft.render("vllm:time_to_first_token_seconds", lab),
    )
    metric(
        "vllm:inter_token_latency_seconds",
        "histogram",
        "Histogram of inter-token latency in seconds.",
        eng.itl.render("vllm:inter_token_latency_seconds", lab),
    )
    metric(
        "vllm:e2e_request_latency_seconds",
        "histogram",
        "Histogram of e2e request latency in seconds.",
        eng.e2e.render("vllm:e2e_request_latency_seconds", lab),
    )
    if server.cfg.role in ("decode", "prefill"):
        metric(
            "vllm:nixl_xfer_time_seconds",
            "histogram",
            "Histogram of transfer duration for NIXL KV Cache transfers.",
            eng.xfer.render("vllm:nixl_xfer_time_seconds", lab),
        )
    return "\n".join(out) + "\n"
