"""The bundle's dashboard and alerts: every metric they query is one a live Coordinator exports, every bucket
bound they name is one its histograms have, and the rules pass `promtool check rules`."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import httpx
import pytest
import yaml

from deployer import render as R
from deployer.settings import load
from harness import ROOT
from harness.bodies import chat_body
from harness.configs import coordinator_config, instance
from harness.coordinator import Coordinator
from harness.loopback import wait_until

MODEL = "mon"
METRIC = re.compile(r"\b(motor_[a-z_]+)")
LE = re.compile(r'(motor_[a-z_]+_bucket)\{[^}]*\ble="([^"$]+)"')  # a bucket bound, in a query or in /metrics


@pytest.fixture(scope="module")
def monitoring() -> tuple[dict, dict]:
    with open(f"{ROOT}/deployer/user_config.json") as f:
        files = R.render(load(json.load(f)))
    dash_map, rule = yaml.safe_load_all(files["monitoring.yaml"])
    return dash_map, rule


def queries(monitoring) -> list[str]:
    dash_map, rule = monitoring
    dash = json.loads(dash_map["data"]["motor-coordinator.json"])
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    return exprs + [r["expr"] for g in rule["spec"]["groups"] for r in g["rules"]]


def test_dashboard_is_found_by_grafanas_sidecar_and_alerts_cover_the_issue(monitoring):
    dash_map, rule = monitoring
    assert dash_map["kind"] == "ConfigMap" and dash_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    dash = json.loads(dash_map["data"]["motor-coordinator.json"])
    assert dash["uid"] == "motor-coordinator" and len(dash["panels"]) >= 10
    assert rule["kind"] == "PrometheusRule" and rule["apiVersion"] == "monitoring.coreos.com/v1"
    alerts = {r["alert"] for g in rule["spec"]["groups"] for r in g["rules"]}
    assert alerts >= {
        "MotorMissedHandoffsRising",
        "MotorNoHealthyPrefill",
        "MotorNoHealthyDecode",
        "MotorBreakerOpen",
        "MotorTTFTSLOAttainmentLow",
    }


def test_rules_pass_promtool(monitoring, tmp_path):
    promtool = shutil.which("promtool")
    assert promtool, "promtool is missing: apt-get install prometheus (.ci/run does)"
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": monitoring[1]["spec"]["groups"]}))
    out = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "SUCCESS" in out.stdout + out.stderr, out.stdout + out.stderr


def test_every_queried_metric_and_bucket_is_in_a_live_coordinators_metrics(monitoring, sims):
    p1, p2, d = sims("prefill", model=MODEL), sims("prefill", model=MODEL), sims("decode", model=MODEL)
    cfg = coordinator_config(
        [
            instance(1, "prefill", MODEL, p1.address),
            instance(2, "prefill", MODEL, p2.address),
            instance(3, "decode", MODEL, d.address),
        ],
        models=[{"id": MODEL}],
    )
    with Coordinator(cfg) as coord:
        url = coord.url + "/v1/chat/completions"
        stream = chat_body(MODEL, max_tokens=4, stream=True)
        assert httpx.post(url, json=stream, timeout=30).status_code == 200  # TTFT, TPOT, both legs, tokens
        for p in (p1, p2):
            p.set_faults(eos_on_prefill=True)  # P hands no KV over: a missed handoff
        assert httpx.post(url, json=stream, timeout=30).status_code == 200
        for p in (p1, p2):
            p.clear_faults()
        for p in (p1, p2):
            p.set_faults(fail_first_n=1)  # each P's next prefill fails (500): retried
        assert httpx.post(url, json=chat_body(MODEL, max_tokens=2), timeout=30).status_code == 200
        # A rate limit, set live: its refusals are counted.
        cfg["rate_limit_config"] = {"requests_per_second": 0.001}
        with open(coord.config_path, "w") as f:
            json.dump({"motor_coordinator_config": cfg}, f)
        assert wait_until(lambda: httpx.post(url, json=chat_body(MODEL), timeout=30).status_code == 429, timeout_s=10)
        text = httpx.get(coord.obs + "/metrics", timeout=10).text
    exported = {ln.split("{")[0].split(" ")[0] for ln in text.splitlines() if ln and not ln.startswith("#")}
    bounds = set(LE.findall(text))
    missing, bad_bounds = set(), set()
    for expr in queries(monitoring):
        for name in METRIC.findall(expr):
            if name not in exported and f"{name}_bucket" not in exported:
                missing.add(name)
        bad_bounds |= {b for b in LE.findall(expr) if b not in bounds}
    dash = json.loads(monitoring[0]["data"]["motor-coordinator.json"])
    for var in dash["templating"]["list"][1:]:  # the SLO targets: bucket bounds of their histogram
        metric = "motor_ttft_seconds_bucket" if var["name"] == "ttft_slo" else "motor_tpot_seconds_bucket"
        bad_bounds |= {(metric, o["value"]) for o in var["options"] if (metric, o["value"]) not in bounds}
    assert not missing, f"queried but not exported: {sorted(missing)}"
    assert not bad_bounds, f"bucket bounds the histograms lack: {sorted(bad_bounds)}"
