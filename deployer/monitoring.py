"""The bundle's Grafana dashboard: its panels and their PromQL over the Coordinator's /metrics.

`dashboard()` is the dashboard's JSON model (schema 39); templates/monitoring.yaml.j2 puts it in a ConfigMap with
Grafana's sidecar discovery label (`grafana_dashboard: "1"`), beside the PrometheusRule of alerts. Every metric
the panels and the rules query is one serving/metrics.py exports (tests/test_monitoring.py checks it against a
live Coordinator's /metrics).

SLO attainment is read from the TTFT and TPOT histograms: the share of requests in the bucket at the target. The
targets are dashboard variables holding bucket bounds (the default SLOs, 1 s and 50 ms, are bounds).
"""

from __future__ import annotations

from typing import Any

UID = "motor-coordinator"
RATE = "$__rate_interval"


def _panel(pid: int, title: str, exprs: dict[str, str], unit: str, x: int, y: int, w: int = 12) -> dict[str, Any]:
    return {
        "id": pid,
        "type": "timeseries",
        "title": title,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"x": x, "y": y, "w": w, "h": 8},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}},
        "targets": [
            {"refId": chr(ord("A") + i), "expr": expr, "legendFormat": legend}
            for i, (legend, expr) in enumerate(exprs.items())
        ],
    }


def _quantiles(metric: str, by: str, legend: str) -> dict[str, str]:
    return {
        f"p{int(q * 100)} {legend}": f"histogram_quantile({q}, sum by ({by}, le) (rate({metric}_bucket[{RATE}])))"
        for q in (0.5, 0.99)
    }


def _attainment(metric: str, target: str) -> str:
    return (
        f'sum by (model) (rate({metric}_bucket{{le="${target}"}}[{RATE}])) '
        f"/ sum by (model) (rate({metric}_count[{RATE}]))"
    )


PANELS = [
    ("Requests per second, by model", {"{{model}}": f"sum by (model) (rate(motor_requests_total[{RATE}]))"}, "reqps"),
    (
        "Errors per second, by model and status",
        {"{{model}} {{status}}": f'sum by (model, status) (rate(motor_requests_total{{status=~"4..|5.."}}[{RATE}]))'},
        "reqps",
    ),
    ("Time to first token", _quantiles("motor_ttft_seconds", "model", "{{model}}"), "s"),
    ("Time per output token", _quantiles("motor_tpot_seconds", "model", "{{model}}"), "s"),
    (
        "SLO attainment (TTFT within $ttft_slo s, TPOT within $tpot_slo s)",
        {
            "TTFT {{model}}": _attainment("motor_ttft_seconds", "ttft_slo"),
            "TPOT {{model}}": _attainment("motor_tpot_seconds", "tpot_slo"),
        },
        "percentunit",
    ),
    ("Per-leg latency (prefill, decode)", _quantiles("motor_leg_seconds", "leg, model", "{{leg}} {{model}}"), "s"),
    (
        "Missed handoffs and retries per second",
        {
            "missed {{model}}": f"sum by (model) (rate(motor_missed_handoffs_total[{RATE}]))",
            "retry {{model}} {{reason}}": f"sum by (model, reason) (rate(motor_retries_total[{RATE}]))",
        },
        "reqps",
    ),
    (
        "Breakers (0 closed, 1 open, 2 half-open) and healthy endpoints",
        {
            "breaker {{instance}}/{{endpoint}}": "max by (instance, endpoint) (motor_instance_breaker_state)",
            "healthy {{model}} {{role}}": "sum by (model, role) (motor_instance_healthy)",
        },
        "short",
    ),
    (
        "Queue and admission",
        {
            "in flight": "sum(motor_inflight_requests)",
            "queued (SLO admission)": "sum(motor_queued_requests)",
            "refused {{reason}}": f"sum by (reason) (rate(motor_rejections_total[{RATE}]))",
        },
        "short",
    ),
    (
        "Engine load",
        {
            "running {{instance}}/{{endpoint}}": "max by (instance, endpoint) (motor_engine_num_requests_running)",
            "waiting {{instance}}/{{endpoint}}": "max by (instance, endpoint) (motor_engine_num_requests_waiting)",
            "Coordinator's legs {{instance}}/{{endpoint}}": "max by (instance, endpoint) "
            "(motor_instance_inflight_requests)",
        },
        "short",
    ),
    (
        "Engine KV cache usage",
        {"{{instance}}/{{endpoint}}": "max by (instance, endpoint) (motor_engine_kv_cache_usage_perc)"},
        "percentunit",
    ),
    (
        "Tokens per second",
        {
            "prompt {{model}}": f"sum by (model) (rate(motor_prompt_tokens_total[{RATE}]))",
            "generated {{model}}": f"sum by (model) (rate(motor_generation_tokens_total[{RATE}]))",
        },
        "short",
    ),
]


def _bucket_variable(name: str, label: str, default: str, bounds: tuple[str, ...]) -> dict[str, Any]:
    return {
        "name": name,
        "label": label,
        "type": "custom",
        "query": ",".join(bounds),
        "current": {"text": default, "value": default},
        "options": [{"text": b, "value": b, "selected": b == default} for b in bounds],
    }


def dashboard() -> dict[str, Any]:
    """The Grafana dashboard of the Coordinator's metrics."""
    panels = [_panel(i + 1, t, e, u, x=12 * (i % 2), y=8 * (i // 2)) for i, (t, e, u) in enumerate(PANELS)]
    return {
        "uid": UID,
        "title": "MindIE Motor Coordinator",
        "tags": ["motor", "vllm"],
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {
            "list": [
                {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus"},
                # Bucket bounds of motor_ttft_seconds / motor_tpot_seconds, as prometheus_client writes them.
                _bucket_variable("ttft_slo", "TTFT target (s)", "1.0", ("0.25", "0.5", "1.0", "2.5", "5.0")),
                _bucket_variable("tpot_slo", "TPOT target (s)", "0.05", ("0.02", "0.03", "0.05", "0.075", "0.1")),
            ]
        },
        "panels": panels,
    }
