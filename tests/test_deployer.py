"""Tests of the Kubernetes deployer (`python -m deployer render`)."""

from __future__ import annotations

import copy
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

import config
from deployer import render as R
from deployer.sections import REDIS_AUTH_DIR
from deployer.settings import COORDINATOR_MOUNTS, ENGINE_MOUNTS, ConfigError, DeployConfig, EngineConfig, key_docs, load
from harness.loopback import free_port

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = ROOT / "deployer" / "user_config.json"
COMMITTED = ROOT / "deployer" / "deployment"
K8S_VERSIONS = ("1.28", kubernetes_validate.latest_version())


def base() -> dict:
    return json.loads(DEFAULT_CONFIG.read_text())


def with_changes(**sections) -> dict:
    """base() with some keys of some sections replaced: with_changes(motor_deploy_config={...})."""
    cfg = base()
    for section, values in sections.items():
        for key, val in values.items():
            target = cfg[section]
            *parents, leaf = key.split(".")
            for p in parents:
                target = target[p]
            target[leaf] = val
    return cfg


def bundle(cfg: dict) -> dict:
    """{file: text} plus parsed docs: {"docs": {file: [doc, ...]}, "config": rendered user_config}."""
    files = R.render(load(cfg))
    docs = {name: list(yaml.safe_load_all(text)) for name, text in files.items() if name.endswith(".yaml")}
    return {"files": files, "docs": docs, "config": json.loads(files["user_config.json"])}


def all_docs(b: dict) -> list:
    return [d for docs in b["docs"].values() for d in docs]


def find(b: dict, kind: str, name: str) -> dict:
    hits = [d for d in all_docs(b) if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(hits) == 1, f"expected one {kind}/{name}, found {len(hits)}"
    return hits[0]


def errors_of(cfg: dict) -> list:
    with pytest.raises(ConfigError) as info:
        load(cfg)
    return info.value.errors


TLS = {
    "enable_tls": True,
    "cert_file": "/etc/motor-tls/tls.crt",
    "key_file": "/etc/motor-tls/tls.key",
    "ca_file": "/etc/motor-tls/ca.crt",
}
EDGE_CONFIGS = {
    "default": base(),
    "tls_both": with_changes(motor_coordinator_config={"infer_tls_config": dict(TLS), "mgmt_tls_config": dict(TLS)}),
    "tls_infer_only": with_changes(motor_coordinator_config={"infer_tls_config": dict(TLS)}),
    "many_pd": with_changes(motor_deploy_config={"p_instances_num": 4, "d_instances_num": 7}),
    "custom_ns_ports": with_changes(
        motor_deploy_config={
            "job_id": "team-llm",
            "create_namespace": False,
            "coordinator_node_port": 30000,
            "cluster_domain": "corp.internal",
            "image_pull_secrets": ["regcred"],
            "service_account_name": "motor-sa",
            "coordinator_node_selector": {"pool": "cpu"},
            "coordinator_tolerations": [
                {"key": "dedicated", "operator": "Equal", "value": "motor", "effect": "NoSchedule"}
            ],
        },
        motor_coordinator_config={
            "api_config.coordinator_api_infer_port": 8080,
            "api_config.coordinator_api_mgmt_port": 9090,
            "api_config.coordinator_obs_port": 9100,
            "shutdown_config.drain_timeout": 120,
        },
        motor_engine_prefill_config={
            "port": 9000,
            "side_channel_port": 5601,
            "tensor_parallel_size": 2,
            "accelerator_num": 2,
            "env": {"UCX_TLS": "rc,cuda_copy"},
            "extra_args": ["--enforce-eager", "--max-num-seqs", "64"],
            "kv_connector_extra_config": {"backends": ["UCX"]},
            "node_selector": {"gpu": "h200"},
        },
        motor_engine_decode_config={"port": 9001, "side_channel_port": 5602},
    ),
    # Every form of toleration and node selector the API server accepts.
    "placement": with_changes(
        motor_deploy_config={
            "coordinator_node_selector": {
                "kubernetes.io/os": "linux",
                "node-role.example.com/cpu": "",
                "Zone_A.1": "Rack-7_b.2",
            },
            "coordinator_tolerations": [
                {"operator": "Exists"},
                {
                    "key": "example.com/maintenance",
                    "operator": "Exists",
                    "effect": "NoExecute",
                    "tolerationSeconds": 300,
                },
                {"key": "dedicated", "value": "motor", "effect": ""},
            ],
        },
        motor_engine_prefill_config={
            "node_selector": {"nvidia.com/gpu.product": "NVIDIA-H200"},
            "tolerations": [
                {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
                {"key": "pool", "operator": "Equal", "value": "a" * 63, "effect": "PreferNoSchedule"},
            ],
        },
    ),
    # Three Coordinator pods sharing the Redis the deployer renders, with a password and a storage class.
    "cluster_rendered_redis": with_changes(
        motor_deploy_config={
            "coordinator_replicas": 3,
            "redis_enabled": True,
            "redis_password_secret": "motor-redis-auth",
            "redis_storage_class": "fast-ssd",
            "coordinator_node_selector": {"pool": "cpu"},
        }
    ),
    # The rendered Redis on an emptyDir, no password.
    "cluster_redis_emptydir": with_changes(
        motor_deploy_config={"coordinator_replicas": 2, "redis_enabled": True, "redis_storage_size": ""}
    ),
    # Two Coordinator pods sharing a Redis of the operator's.
    "cluster_own_redis": with_changes(
        motor_deploy_config={"coordinator_replicas": 2},
        motor_coordinator_config={"cluster_config": {"redis_url": "rediss://redis.infra.svc.cluster.local:6380/2"}},
    ),
    "cpu_engines_no_weights": with_changes(
        motor_deploy_config={"weight_mount_path": ""},
        motor_engine_prefill_config={
            "accelerator_num": 0,
            "kv_buffer_device": "cpu",
            "model_path": "Qwen/Qwen3-0.6B",
            "served_model_name": "qwen3-small",
        },
        motor_engine_decode_config={
            "accelerator_num": 0,
            "kv_buffer_device": "cpu",
            "model_path": "Qwen/Qwen3-0.6B",
            "served_model_name": "qwen3-small",
        },
    ),
}


@pytest.fixture(scope="module", params=sorted(EDGE_CONFIGS))
def edge(request):
    cfg = EDGE_CONFIGS[request.param]
    return cfg, load(cfg), bundle(cfg)


# --------------------------------------------------------------------------- CLI and committed bundle


def test_cli_render_writes_every_file_and_says_so(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "deployer", "render", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    for name in R.OUTPUT_FILES:
        assert (tmp_path / name).is_file()
        assert f"wrote {tmp_path / name}" in proc.stdout
    # Same bytes as the committed bundle: the committed files cannot go stale.
    for name in R.OUTPUT_FILES:
        assert (tmp_path / name).read_text() == (COMMITTED / name).read_text(), (
            f"deployer/deployment/{name} is stale: run `python -m deployer render`"
        )


def test_committed_bundle_equals_fresh_render():
    fresh = R.render(load(base()))
    assert sorted(p.name for p in COMMITTED.iterdir()) == sorted(R.OUTPUT_FILES)
    for name, text in fresh.items():
        assert (COMMITTED / name).read_text() == text, f"{name} is stale: run `python -m deployer render`"


def test_cli_bad_node_port_exits_nonzero_naming_the_key(tmp_path):
    cfg = with_changes(motor_deploy_config={"coordinator_node_port": 80})
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(cfg))
    proc = subprocess.run(
        [sys.executable, "-m", "deployer", "render", "--config", str(path), "--out", str(tmp_path / "out")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    assert "motor_deploy_config.coordinator_node_port: must be 30000..32767" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_cli_unreadable_and_malformed_input(tmp_path):
    bad = tmp_path / "broken.json"
    bad.write_text("{not json")
    for path in (tmp_path / "missing.json", bad):
        proc = subprocess.run(
            [sys.executable, "-m", "deployer", "render", "--config", str(path), "--out", str(tmp_path / "o")],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode != 0 and str(path) in proc.stderr


def _cli_render(tmp_path, text=None, out=None):
    path = tmp_path / "in.json"
    if text is not None:
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
    args = ["--config", str(path)] if text is not None else []
    return subprocess.run(
        [sys.executable, "-m", "deployer", "render", *args, "--out", str(out or tmp_path / "o")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(
    "changes, expected",
    [
        (
            {"motor_coordinator_config": {"shutdown_config.drain_timeout": float("nan")}},
            "motor_coordinator_config.shutdown_config.drain_timeout: must be a number 0..86400 (got nan)",
        ),
        (
            {"motor_coordinator_config": {"shutdown_config.drain_timeout": float("inf")}},
            "motor_coordinator_config.shutdown_config.drain_timeout: must be a number 0..86400 (got inf)",
        ),
        ({"motor_coordinator_config": {"models": [{"id": ["x"]}]}}, "motor_coordinator_config.models[0].id:"),
        (
            {
                "motor_coordinator_config": {
                    "instances": [{"role": "union", "model_name": ["m"], "endpoints": [{"address": "e:8000"}]}]
                }
            },
            "motor_coordinator_config.instances[0].model_name:",
        ),
    ],
)
def test_cli_bad_values_are_one_clear_line_not_a_traceback(tmp_path, changes, expected):
    proc = _cli_render(tmp_path, json.dumps(with_changes(**changes)))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert any(line.startswith(f"  {expected}") for line in proc.stderr.splitlines()), proc.stderr
    assert not (tmp_path / "o").exists()


def test_a_config_saved_with_a_utf8_bom_renders_like_one_without(tmp_path):
    """Windows editors save UTF-8 with a BOM; the Coordinator's own loader (json on bytes) takes it too."""
    text = json.dumps(base()).encode()
    assert _cli_render(tmp_path, text, out=tmp_path / "plain").returncode == 0
    proc = _cli_render(tmp_path, b"\xef\xbb\xbf" + text, out=tmp_path / "bom")
    assert proc.returncode == 0, proc.stderr
    for f in (tmp_path / "plain").iterdir():
        assert (tmp_path / "bom" / f.name).read_bytes() == f.read_bytes()


def test_cli_non_utf8_input_and_an_out_that_is_a_file(tmp_path):
    text = json.dumps(base()).encode()
    for bom in (b"", b"\xef\xbb\xbf"):
        proc = _cli_render(tmp_path, bom + text.replace(b"mindie-motor", b"mindie-m\xf6tor", 1))  # Latin-1 o-umlaut
        assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
            f"error: {tmp_path / 'in.json'}: not UTF-8 text (byte {len(bom) + text.index(b'mindie-motor') + 8})"
        ]
    afile = tmp_path / "afile"
    afile.write_text("")
    proc = _cli_render(tmp_path, out=afile)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [f"error: cannot write {afile}: File exists"]


def test_input_nested_too_deeply_is_one_line_not_a_recursion_error(tmp_path):
    """json's decoder (100000 levels) and copy.deepcopy (500 levels under a key passed through) crashed."""
    from deployer.__main__ import MAX_NESTING

    def nested(levels: int) -> dict:
        """base() whose lists and objects nest `levels` deep, the extra levels under a key passed through."""
        cfg = base()
        cfg["motor_coordinator_config"]["x"] = json.loads("[" * (levels - 2) + "]" * (levels - 2))
        return cfg

    for text in ("[" * 100000 + "]" * 100000, json.dumps(nested(500)), json.dumps(nested(MAX_NESTING + 1))):
        proc = _cli_render(tmp_path, text)
        assert proc.returncode == 2 and proc.stderr.splitlines() == [
            f"error: {tmp_path / 'in.json'}: lists and objects nested more than {MAX_NESTING} levels deep"
        ], proc.stderr
        assert not (tmp_path / "o").exists()
    proc = _cli_render(tmp_path, json.dumps(nested(MAX_NESTING)))
    assert proc.returncode == 0, proc.stderr


def test_an_out_that_cannot_take_every_file_is_left_as_it_was(tmp_path):
    """The YAML files were written before user_config.json, a directory there, failed to be."""
    out = tmp_path / "out"
    (out / "user_config.json").mkdir(parents=True)
    (out / "coordinator_init.yaml").write_text("old")
    proc = _cli_render(tmp_path, out=out)
    assert proc.returncode == 2 and proc.stderr.splitlines() == [
        f"error: cannot write {out / 'user_config.json'}: Is a directory"
    ], proc.stderr
    assert sorted(p.name for p in out.iterdir()) == ["coordinator_init.yaml", "user_config.json"]
    assert (out / "coordinator_init.yaml").read_text() == "old"


def test_a_failed_write_removes_what_it_wrote_and_the_directories_it_made(tmp_path, monkeypatch):
    real = Path.write_text

    def full_disk(path, text, **kwargs):
        if path.name.startswith(".user_config.json"):
            raise OSError(28, "No space left on device", str(path))
        return real(path, text, **kwargs)

    monkeypatch.setattr(Path, "write_text", full_disk)
    with pytest.raises(OSError, match="No space left"):
        R.write(load(base()), tmp_path / "new" / "out")
    assert list(tmp_path.iterdir()) == []


def test_default_file_coordinator_section_is_the_agreed_shape():
    coord = base()["motor_coordinator_config"]
    assert coord["api_config"]["coordinator_api_host"] == "127.0.0.1"
    assert coord["instances"] == []  # `python app.py` starts the simulator
    assert coord["api_config"]["coordinator_api_infer_port"] == 1025
    assert set(coord) >= {
        "api_config",
        "inference_workers_config",
        "api_key_config",
        "mgmt_api_key_config",
        "infer_tls_config",
        "mgmt_tls_config",
        "scheduler_config",
        "exception_config",
        "rate_limit_config",
        "shutdown_config",
        "log_config",
        "models",
        "instances",
    }


def test_default_file_carries_every_deploy_key_with_its_default():
    cfg = base()
    for section, cls in (
        ("motor_deploy_config", DeployConfig),
        ("motor_engine_prefill_config", EngineConfig),
        ("motor_engine_decode_config", EngineConfig),
    ):
        for path, default, _doc in key_docs(cls, section):
            assert cfg[section][path.split(".")[-1]] == default, path


def test_docs_list_every_key():
    doc = (ROOT / "docs" / "deployer.md").read_text()
    for section, cls in (("motor_deploy_config", DeployConfig), ("motor_engine_prefill_config", EngineConfig)):
        for path, _default, _doc in key_docs(cls, section):
            assert f"`{path.split('.')[-1]}`" in doc, f"{path} undocumented in docs/deployer.md"


# --------------------------------------------------------------------------- schema validation


def test_every_document_passes_kubernetes_schemas_strictly_offline(edge, monkeypatch):
    _, _, b = edge

    def no_network(*args, **kwargs):
        raise AssertionError("kubernetes_validate tried to use the network")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    # The PrometheusRule is a CRD, which Kubernetes' own schemas do not hold (tests/test_monitoring.py checks it).
    docs = [d for d in all_docs(b) if not d["apiVersion"].startswith("monitoring.coreos.com/")]
    assert docs and all(isinstance(d, dict) for d in docs)
    for doc in docs:
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)


def test_strict_validation_really_rejects_unknown_fields():
    doc = copy.deepcopy(find(bundle(base()), "Deployment", R.COORDINATOR_NAME))
    doc["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, K8S_VERSIONS[-1], strict=True)


def test_the_coordinator_accepts_the_rendered_user_config(edge):
    cfg, s, b = edge
    coord = config.settings_from_dict(b["config"], on_this_host=False)  # the pod's TLS files are not here
    assert (coord.infer_port, coord.mgmt_port, coord.obs_port) == (
        s.coordinator.infer_port,
        s.coordinator.mgmt_port,
        s.coordinator.obs_port,
    )
    assert len(coord.instances) == s.deploy.p_instances_num + s.deploy.d_instances_num


def test_bundle_kinds(edge):
    cfg, s, b = edge
    kinds = sorted((d["kind"], d["metadata"]["name"]) for d in b["docs"]["coordinator_init.yaml"])
    expected = [
        ("Secret", R.CONFIG_SECRET_NAME),
        ("Deployment", R.COORDINATOR_NAME),
        ("Service", R.INFER_SERVICE),
        ("Service", R.MGMT_SERVICE),
        ("Service", R.METRICS_SERVICE),
    ]
    if s.deploy.create_namespace:
        expected.append(("Namespace", s.namespace))
    if s.deploy.coordinator_replicas > 1:
        expected.append(("PodDisruptionBudget", R.COORDINATOR_NAME))
    if s.deploy.redis_enabled:
        expected += [("StatefulSet", R.REDIS_NAME), ("Service", R.REDIS_NAME), ("PodDisruptionBudget", R.REDIS_NAME)]
    assert kinds == sorted(expected)
    for role in ("prefill", "decode"):
        kinds = sorted((d["kind"], d["metadata"]["name"]) for d in b["docs"][f"engine_{role}.yaml"])
        assert kinds == [("Service", R.ENGINE_NAME[role]), ("StatefulSet", R.ENGINE_NAME[role])]
    for d in all_docs(b):
        if d["kind"] != "Namespace":
            assert d["metadata"]["namespace"] == s.namespace


# --------------------------------------------------------------------------- cross references


def _pod_labels(workload: dict) -> dict:
    return workload["spec"]["template"]["metadata"]["labels"]


def test_service_selectors_match_exactly_one_workload(edge):
    _, _, b = edge
    workloads = [d for d in all_docs(b) if d["kind"] in ("Deployment", "StatefulSet")]
    for svc in (d for d in all_docs(b) if d["kind"] == "Service"):
        sel = svc["spec"]["selector"]
        matching = [w for w in workloads if sel.items() <= _pod_labels(w).items()]
        assert len(matching) == 1, f"Service {svc['metadata']['name']} selects {len(matching)} workloads"
        w = matching[0]
        assert w["spec"]["selector"]["matchLabels"].items() <= _pod_labels(w).items()
        named = {p["name"]: p["containerPort"] for c in w["spec"]["template"]["spec"]["containers"] for p in c["ports"]}
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in named, f"{svc['metadata']['name']}: targetPort {port['targetPort']}"
            assert port["port"] == named[port["targetPort"]]


def test_coordinator_ports_probes_and_service_ports_follow_the_config(edge):
    cfg, s, b = edge
    api = cfg["motor_coordinator_config"]["api_config"]
    dep = find(b, "Deployment", R.COORDINATOR_NAME)
    c = dep["spec"]["template"]["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {
        "infer": api["coordinator_api_infer_port"],
        "mgmt": api["coordinator_api_mgmt_port"],
        "metrics": api["coordinator_obs_port"],
    }
    for probe, path in (("startupProbe", "/startup"), ("livenessProbe", "/liveness"), ("readinessProbe", "/readiness")):
        assert c[probe]["httpGet"]["path"] == path
        assert ports[c[probe]["httpGet"]["port"]] == api["coordinator_api_mgmt_port"]
    infer = find(b, "Service", R.INFER_SERVICE)
    assert infer["spec"]["type"] == "NodePort"
    assert infer["spec"]["ports"][0]["nodePort"] == s.deploy.coordinator_node_port
    assert infer["spec"]["ports"][0]["port"] == api["coordinator_api_infer_port"]
    mgmt = find(b, "Service", R.MGMT_SERVICE)["spec"]
    # Not headless: the pods share their instance set through Redis, so any one of them takes a refresh.
    assert mgmt["type"] == "ClusterIP" and "clusterIP" not in mgmt
    metrics = find(b, "Service", R.METRICS_SERVICE)
    assert metrics["spec"]["ports"][0]["port"] == api["coordinator_obs_port"]
    assert metrics["metadata"]["annotations"]["prometheus.io/port"] == str(api["coordinator_obs_port"])


def test_default_node_port_is_31015_and_infer_port_1025():
    b = bundle(base())
    port = find(b, "Service", R.INFER_SERVICE)["spec"]["ports"][0]
    assert (port["nodePort"], port["port"]) == (31015, 1025)


def test_a_secret_holds_the_rendered_user_config_and_is_mounted(edge):
    _, s, b = edge
    secret = find(b, "Secret", R.CONFIG_SECRET_NAME)
    assert json.loads(secret["stringData"]["user_config.json"]) == b["config"]
    pod = find(b, "Deployment", R.COORDINATOR_NAME)["spec"]["template"]["spec"]
    c = pod["containers"][0]
    vols = {v["name"]: v for v in pod["volumes"]}
    cfg_mount = [
        m for m in c["volumeMounts"] if vols[m["name"]].get("secret", {}).get("secretName") == R.CONFIG_SECRET_NAME
    ]
    assert len(cfg_mount) == 1 and cfg_mount[0]["readOnly"] is True
    assert c["command"] == ["python", "app.py", "--config", cfg_mount[0]["mountPath"] + "/user_config.json"]
    assert {"name": "USER_CONFIG_PATH", "value": "/etc/motor/user_config.json"} in c["env"]
    annotations = find(b, "Deployment", R.COORDINATOR_NAME)["spec"]["template"]["metadata"]["annotations"]
    assert annotations["motor/config-hash"]


def test_api_keys_are_only_in_the_secret_never_in_a_configmap():
    keys = {
        "api_key_config.enable_api_key": True,
        "api_key_config.valid_keys": ["sk-infer-0123456789"],
        "mgmt_api_key_config.enable_api_key": True,
        "mgmt_api_key_config.valid_keys": ["sk-mgmt-0123456789"],
    }
    b = bundle(with_changes(motor_coordinator_config=keys))
    # The one ConfigMap is the Grafana dashboard's (monitoring.yaml), which holds no config.
    assert [d["metadata"]["name"] for d in all_docs(b) if d["kind"] == "ConfigMap"] == ["motor-coordinator-dashboard"]
    holding = [d["kind"] for d in all_docs(b) if "sk-infer-0123456789" in json.dumps(d) or "sk-mgmt" in json.dumps(d)]
    assert holding == ["Secret"]


def test_config_change_changes_the_pod_template_hash():
    a = find(bundle(base()), "Deployment", R.COORDINATOR_NAME)
    b = find(
        bundle(with_changes(motor_coordinator_config={"log_config.log_level": "DEBUG"})),
        "Deployment",
        R.COORDINATOR_NAME,
    )
    key = "motor/config-hash"
    assert (
        a["spec"]["template"]["metadata"]["annotations"][key] != b["spec"]["template"]["metadata"]["annotations"][key]
    )


def test_coordinator_pod_hardening_and_drain(edge):
    cfg, s, b = edge
    pod = find(b, "Deployment", R.COORDINATOR_NAME)["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] > 0
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["resources"]["requests"] and c["resources"]["limits"]
    drain = cfg["motor_coordinator_config"]["shutdown_config"]["drain_timeout"]
    sleep = int(c["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert sleep == s.deploy.prestop_sleep_seconds
    assert pod["terminationGracePeriodSeconds"] > sleep + drain
    assert pod["automountServiceAccountToken"] is False


def test_explicit_grace_period_must_exceed_prestop_plus_drain():
    errs = errors_of(with_changes(motor_deploy_config={"termination_grace_period_seconds": 30}))
    assert any(e.startswith("motor_deploy_config.termination_grace_period_seconds:") for e in errs)
    s = load(with_changes(motor_deploy_config={"termination_grace_period_seconds": 90}))
    pod = find(
        {"docs": {"x": list(yaml.safe_load_all(R.render(s)["coordinator_init.yaml"]))}},
        "Deployment",
        R.COORDINATOR_NAME,
    )["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == 90


def test_tls_mounts_secret_and_switches_probe_scheme(edge):
    cfg, s, b = edge
    coord = cfg["motor_coordinator_config"]
    infer_tls, mgmt_tls = coord["infer_tls_config"]["enable_tls"], coord["mgmt_tls_config"]["enable_tls"]
    pod = find(b, "Deployment", R.COORDINATOR_NAME)["spec"]["template"]["spec"]
    c = pod["containers"][0]
    others = (R.CONFIG_SECRET_NAME, s.deploy.redis_password_secret)
    secrets = [v for v in pod["volumes"] if "secret" in v and v["secret"]["secretName"] not in others]
    if infer_tls or mgmt_tls:
        assert [v["secret"]["secretName"] for v in secrets] == [s.deploy.tls_secret_name]
        mount = [m for m in c["volumeMounts"] if m["name"] == secrets[0]["name"]][0]
        assert mount["readOnly"] is True
        for key in ("infer_tls_config", "mgmt_tls_config"):
            if coord[key]["enable_tls"]:
                for f in ("cert_file", "key_file", "ca_file"):
                    assert coord[key][f].startswith(mount["mountPath"] + "/")
    else:
        assert secrets == []
    scheme = "HTTPS" if mgmt_tls else "HTTP"
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"]["scheme"] == scheme
    # app.py serves the metrics port with the management TLS settings.
    metrics = find(b, "Service", R.METRICS_SERVICE)["metadata"]["annotations"]
    assert metrics["prometheus.io/scheme"] == scheme.lower()


def test_no_two_volumes_share_a_mount_path(edge):
    """Kubernetes refuses a pod with two volumeMounts on one path; COORDINATOR_MOUNTS and ENGINE_MOUNTS,
    which tls_mount_path / weight_mount_path are checked against, are what the templates mount."""
    _, s, b = edge
    for kind, name, fixed in (
        ("Deployment", R.COORDINATOR_NAME, COORDINATOR_MOUNTS),
        ("StatefulSet", R.ENGINE_NAME["prefill"], ENGINE_MOUNTS),
    ):
        mounts = {
            m["name"]: m["mountPath"]
            for m in find(b, kind, name)["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
        }
        assert len(set(mounts.values())) == len(mounts)
        configurable = {
            "tls": s.deploy.tls_mount_path,
            "weights": s.deploy.weight_mount_path,
            "redis-auth": REDIS_AUTH_DIR,
        }
        assert sorted(p for n, p in mounts.items() if n not in configurable) == sorted(fixed)


@pytest.mark.parametrize("section", ["infer_tls_config", "mgmt_tls_config"])
def test_mindie_spelling_tls_enable_turns_tls_on(section):
    tls = {k: v for k, v in TLS.items() if k != "enable_tls"}
    b = bundle(with_changes(motor_coordinator_config={section: dict(tls, tls_enable=True)}))
    pod = find(b, "Deployment", R.COORDINATOR_NAME)["spec"]["template"]["spec"]
    assert [v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v] == [
        R.CONFIG_SECRET_NAME,
        "motor-coordinator-tls",
    ]
    coord = config.settings_from_dict(b["config"], on_this_host=False)  # the pod's TLS files are not here
    assert getattr(coord, section.replace("_config", "")).enable_tls is True
    errs = errors_of(with_changes(motor_coordinator_config={section: dict(tls, tls_enable=True, enable_tls=False)}))
    assert errs == [
        f"motor_coordinator_config.{section}.tls_enable: contradicts enable_tls (MindIE's spelling of the same switch)"
    ]
    with pytest.raises(config.ConfigError, match=f"{section}.tls_enable: contradicts enable_tls"):
        config.settings_from_dict({section: dict(tls, tls_enable=False, enable_tls=True)})


def test_tls_on_renders_https_probes():
    b = bundle(EDGE_CONFIGS["tls_both"])
    c = find(b, "Deployment", R.COORDINATOR_NAME)["spec"]["template"]["spec"]["containers"][0]
    assert c["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
    b = bundle(EDGE_CONFIGS["tls_infer_only"])
    pod = find(b, "Deployment", R.COORDINATOR_NAME)["spec"]["template"]["spec"]
    assert pod["containers"][0]["readinessProbe"]["httpGet"]["scheme"] == "HTTP"
    assert any(v.get("secret", {}).get("secretName") == "motor-coordinator-tls" for v in pod["volumes"])


# --------------------------------------------------------------------------- several Coordinator pods


def _matches(selector: dict, pod_labels: dict) -> bool:
    return bool(selector) and selector.items() <= pod_labels.items()


def test_three_replicas_with_redis_enabled_render_redis_pdbs_and_anti_affinity():
    cfg = with_changes(motor_deploy_config={"coordinator_replicas": 3, "redis_enabled": True})
    b = bundle(cfg)
    dep = find(b, "Deployment", R.COORDINATOR_NAME)
    assert dep["spec"]["replicas"] == 3
    coordinator_pods = _pod_labels(dep)
    spread = dep["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    [term] = spread["preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert term["podAffinityTerm"]["labelSelector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]

    sts = find(b, "StatefulSet", R.REDIS_NAME)
    redis_pods = _pod_labels(sts)
    assert sts["spec"]["replicas"] == 1 and not _matches(redis_pods, coordinator_pods)
    [c] = sts["spec"]["template"]["spec"]["containers"]
    assert c["image"] == "redis:7.2.5-alpine"
    assert c["command"] == ["redis-server"] and c["args"][c["args"].index("--appendonly") + 1] == "yes"
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert "redis-cli ping" in " ".join(c[probe]["exec"]["command"])
    [claim] = sts["spec"]["volumeClaimTemplates"]
    assert claim["spec"]["resources"]["requests"]["storage"] == "1Gi" and "storageClassName" not in claim["spec"]
    assert {m["name"]: m["mountPath"] for m in c["volumeMounts"]} == {claim["metadata"]["name"]: "/data"}

    pdbs = {d["metadata"]["name"]: d["spec"] for d in all_docs(b) if d["kind"] == "PodDisruptionBudget"}
    assert set(pdbs) == {R.COORDINATOR_NAME, R.REDIS_NAME}
    assert _matches(pdbs[R.COORDINATOR_NAME]["selector"]["matchLabels"], coordinator_pods)
    assert _matches(pdbs[R.REDIS_NAME]["selector"]["matchLabels"], redis_pods)
    assert pdbs[R.COORDINATOR_NAME]["maxUnavailable"] == 1

    # The Coordinator pods' redis_url names the Service in front of that StatefulSet.
    svc = find(b, "Service", R.REDIS_NAME)
    assert _matches(svc["spec"]["selector"], redis_pods)
    [port] = svc["spec"]["ports"]
    cluster = b["config"]["motor_coordinator_config"]["cluster_config"]
    assert cluster == {
        "redis_url": f"redis://{svc['metadata']['name']}.{svc['metadata']['namespace']}.svc.cluster.local:"
        f"{port['port']}/0",
        "key_prefix": "motor:mindie-motor:",
    }
    assert json.loads(find(b, "Secret", R.CONFIG_SECRET_NAME)["stringData"]["user_config.json"]) == b["config"]


def test_several_replicas_without_redis_are_refused_naming_the_keys(tmp_path):
    cfg = with_changes(motor_deploy_config={"coordinator_replicas": 2})
    assert errors_of(cfg) == [
        "motor_deploy_config.coordinator_replicas: 2 Coordinator pods share their state only through Redis: "
        "set motor_coordinator_config.cluster_config.redis_url or motor_deploy_config.redis_enabled"
    ]
    cfg["motor_coordinator_config"]["cluster_config"] = {"redis_url": ""}  # empty: no Redis
    assert len(errors_of(cfg)) == 1
    proc = _cli_render(tmp_path, json.dumps(cfg))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "  motor_deploy_config.coordinator_replicas: 2 Coordinator pods share" in proc.stderr.splitlines()[1]
    assert not (tmp_path / "o").exists()


def test_one_replica_renders_no_redis_no_pdb_and_no_cluster_config_by_default():
    b = bundle(base())
    assert not [d for d in all_docs(b) if d["kind"] == "PodDisruptionBudget" or "redis" in d["metadata"]["name"]]
    dep = find(b, "Deployment", R.COORDINATOR_NAME)
    assert dep["spec"]["replicas"] == 1 and "affinity" not in dep["spec"]["template"]["spec"]
    assert "cluster_config" not in b["config"]["motor_coordinator_config"]
    # One pod may still keep its state in the rendered Redis, across restarts.
    b = bundle(with_changes(motor_deploy_config={"redis_enabled": True}))
    find(b, "StatefulSet", R.REDIS_NAME)
    assert b["config"]["motor_coordinator_config"]["cluster_config"]["redis_url"].startswith("redis://")
    assert not [d for d in all_docs(b) if d["kind"] == "PodDisruptionBudget" and d["metadata"]["name"] != R.REDIS_NAME]


def test_an_operator_s_redis_url_is_kept_and_given_the_job_s_key_prefix():
    url = "rediss://:s3cret@redis.infra.svc.cluster.local:6380/2"
    cfg = with_changes(motor_deploy_config={"coordinator_replicas": 2})
    cfg["motor_coordinator_config"]["cluster_config"] = {"redis_url": url, "sync_interval_ms": 50}
    b = bundle(cfg)
    assert b["config"]["motor_coordinator_config"]["cluster_config"] == {
        "redis_url": url,
        "sync_interval_ms": 50,
        "key_prefix": "motor:mindie-motor:",
    }
    assert not [d for d in all_docs(b) if R.REDIS_NAME in d["metadata"]["name"]]
    find(b, "PodDisruptionBudget", R.COORDINATOR_NAME)
    cfg["motor_coordinator_config"]["cluster_config"]["key_prefix"] = "team-a:"
    assert bundle(cfg)["config"]["motor_coordinator_config"]["cluster_config"]["key_prefix"] == "team-a:"
    # Both a URL and the rendered Redis: refused, and the URL, which may hold a password, is not repeated.
    cfg["motor_deploy_config"]["redis_enabled"] = True
    errs = errors_of(cfg)
    assert [e.partition(":")[0] for e in errs] == ["motor_deploy_config.redis_enabled"]
    assert "s3cret" not in errs[0] and "cluster_config.redis_url" in errs[0]


def test_redis_password_secret_reaches_redis_and_the_coordinator_pods():
    b = bundle(EDGE_CONFIGS["cluster_rendered_redis"])
    [c] = find(b, "StatefulSet", R.REDIS_NAME)["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in c["env"]}
    assert env == {n: {"name": "motor-redis-auth", "key": "password"} for n in ("REDIS_PASSWORD", "REDISCLI_AUTH")}
    assert c["args"][c["args"].index("--requirepass") + 1] == "$(REDIS_PASSWORD)"
    claim = find(b, "StatefulSet", R.REDIS_NAME)["spec"]["volumeClaimTemplates"][0]
    assert claim["spec"]["storageClassName"] == "fast-ssd"
    pod = find(b, "Deployment", R.COORDINATOR_NAME)["spec"]["template"]["spec"]
    [vol] = [v for v in pod["volumes"] if v.get("secret", {}).get("secretName") == "motor-redis-auth"]
    [mount] = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == vol["name"]]
    [item] = vol["secret"]["items"]
    cluster = b["config"]["motor_coordinator_config"]["cluster_config"]
    assert cluster["redis_password_file"] == f"{mount['mountPath']}/{item['path']}" and mount["readOnly"] is True
    assert "s3cret" not in json.dumps(cluster) and "@" not in cluster["redis_url"]
    # Redis runs where the Coordinator pods may.
    assert find(b, "StatefulSet", R.REDIS_NAME)["spec"]["template"]["spec"]["nodeSelector"] == {"pool": "cpu"}
    cfg = copy.deepcopy(EDGE_CONFIGS["cluster_rendered_redis"])
    cfg["motor_coordinator_config"]["cluster_config"] = {"redis_password_file": "/elsewhere/pw"}
    assert [e.partition(":")[0] for e in errors_of(cfg)] == [
        "motor_coordinator_config.cluster_config.redis_password_file"
    ]


def test_redis_on_an_emptydir_has_no_claim():
    sts = find(bundle(EDGE_CONFIGS["cluster_redis_emptydir"]), "StatefulSet", R.REDIS_NAME)
    assert "volumeClaimTemplates" not in sts["spec"]
    assert sts["spec"]["template"]["spec"]["volumes"] == [{"name": "data", "emptyDir": {}}]
    [c] = sts["spec"]["template"]["spec"]["containers"]
    assert "--requirepass" not in c["args"] and "env" not in c


def test_the_rendered_redis_command_and_probes_work_on_a_real_redis_server(tmp_path):
    """The StatefulSet's own command line and probe, run against Debian's redis-server on loopback: the port
    and directory are the test's, and a redis-cli on PATH adds -p (the probe names no port: 6379 in the pod)."""
    [c] = find(bundle(EDGE_CONFIGS["cluster_rendered_redis"]), "StatefulSet", R.REDIS_NAME)["spec"]["template"]["spec"][
        "containers"
    ]
    port = free_port()
    args = [a.replace("$(REDIS_PASSWORD)", "pw-0123") for a in c["args"]]
    args[args.index("--port") + 1] = str(port)
    args[args.index("--dir") + 1] = str(tmp_path)
    wrapper = tmp_path / "bin" / "redis-cli"
    wrapper.parent.mkdir()
    wrapper.write_text(f'#!/bin/sh\nexec /usr/bin/redis-cli -h 127.0.0.1 -p {port} "$@"\n')
    wrapper.chmod(0o755)
    env = {"PATH": f"{wrapper.parent}:/usr/bin:/bin", "REDISCLI_AUTH": "pw-0123"}
    server = subprocess.Popen([c["command"][0], *args, "--bind", "127.0.0.1"], stdout=subprocess.DEVNULL)
    try:
        probe = c["readinessProbe"]["exec"]["command"]
        for _ in range(200):  # until it listens; a server that never does fails the assertion below
            if subprocess.run(probe, env=env).returncode == 0 or server.poll() is not None:
                break
            time.sleep(0.05)
        assert subprocess.run(probe, env=env).returncode == 0
        for other in ("livenessProbe", "startupProbe"):
            assert subprocess.run(c[other]["exec"]["command"], env=env).returncode == 0
        # Without the password the probe fails: the server requires it.
        assert subprocess.run(probe, env=dict(env, REDISCLI_AUTH="wrong"), stderr=subprocess.DEVNULL).returncode
        cli = [str(wrapper), "--no-auth-warning"]
        got = subprocess.run([*cli, "config", "get", "appendonly"], env=env, capture_output=True, text=True)
        assert got.stdout.split() == ["appendonly", "yes"]
        got = subprocess.run([*cli, "config", "get", "save"], env=env, capture_output=True, text=True)
        assert got.stdout.splitlines() == ["save", ""]
    finally:
        server.terminate()
        server.wait(timeout=30)
    assert (tmp_path / "appendonlydir").is_dir()


# --------------------------------------------------------------------------- engines


def test_engines_statefulsets_args_env_and_probes(edge):
    cfg, s, b = edge
    for role, eng, count in (
        ("prefill", s.prefill, s.deploy.p_instances_num),
        ("decode", s.decode, s.deploy.d_instances_num),
    ):
        name = R.ENGINE_NAME[role]
        sts = find(b, "StatefulSet", name)
        svc = find(b, "Service", name)
        assert svc["spec"]["clusterIP"] == "None"
        assert sts["spec"]["serviceName"] == svc["metadata"]["name"]
        assert sts["spec"]["replicas"] == count
        c = sts["spec"]["template"]["spec"]["containers"][0]
        assert c["command"] == ["vllm", "serve"]
        args = c["args"]
        assert args[0] == eng.model_path
        opt = {args[i]: args[i + 1] for i in range(1, len(args) - 1) if args[i].startswith("--")}
        assert opt["--port"] == str(eng.port)
        assert opt["--served-model-name"] == eng.served_model_name
        assert opt["--max-model-len"] == str(eng.max_model_len)
        assert opt["--tensor-parallel-size"] == str(eng.tensor_parallel_size)
        kv = json.loads(opt["--kv-transfer-config"])
        assert kv["kv_connector"] == "NixlConnector"
        assert kv["kv_role"] == {"prefill": "kv_producer", "decode": "kv_consumer"}[role]
        assert kv["kv_buffer_device"] == eng.kv_buffer_device
        assert args[len(args) - len(eng.extra_args) :] == eng.extra_args or not eng.extra_args
        env = {e["name"]: e for e in c["env"]}
        assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"]["value"] == str(eng.side_channel_port)
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        for k, v in eng.env.items():
            assert env[k]["value"] == v
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports == {"http": eng.port, "nixl-side": eng.side_channel_port}
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert c[probe]["httpGet"]["path"] == "/health"
            assert ports[c[probe]["httpGet"]["port"]] == eng.port
        startup = c["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= eng.startup_timeout_seconds
        gpu = c["resources"]["limits"].get(eng.accelerator_resource_name)
        assert gpu == (str(eng.accelerator_num) if eng.accelerator_num else None)
        mounts = {m["mountPath"] for m in c["volumeMounts"]}
        assert "/dev/shm" in mounts
        assert (s.deploy.weight_mount_path in mounts) == bool(s.deploy.weight_mount_path)


def test_rendered_user_config_lists_every_engine_pod_by_dns_name(edge):
    cfg, s, b = edge
    coord = b["config"]["motor_coordinator_config"]
    assert coord["api_config"]["coordinator_api_host"] == "0.0.0.0"
    inst = coord["instances"]
    assert [i["role"] for i in inst] == ["prefill"] * s.deploy.p_instances_num + ["decode"] * s.deploy.d_instances_num
    assert len({i["id"] for i in inst}) == len(inst)
    for role, eng in (("prefill", s.prefill), ("decode", s.decode)):
        sts = R.ENGINE_NAME[role]
        addrs = [i["endpoints"][0]["address"] for i in inst if i["role"] == role]
        assert addrs == [
            f"{sts}-{k}.{sts}.{s.namespace}.svc.{s.deploy.cluster_domain}:{eng.port}" for k in range(len(addrs))
        ]
    assert all(i["model_name"] == s.prefill.served_model_name for i in inst)
    model = coord["models"][0]
    assert model["id"] == s.prefill.served_model_name
    assert (model["p_max_seqlen"], model["d_max_seqlen"]) == (s.prefill.max_model_len, s.decode.max_model_len)
    # Everything else of the Coordinator's section passes through untouched.
    for key, val in cfg["motor_coordinator_config"].items():
        if key not in ("api_config", "models", "instances", "cluster_config"):
            assert coord[key] == val


def test_many_pd_instances_have_stable_names():
    b = bundle(EDGE_CONFIGS["many_pd"])
    inst = b["config"]["motor_coordinator_config"]["instances"]
    assert len(inst) == 11 and [i["id"] for i in inst] == list(range(1, 12))
    assert inst[3]["endpoints"][0]["address"].startswith("motor-engine-prefill-3.motor-engine-prefill.mindie-motor.")
    assert inst[10]["endpoints"][0]["address"].startswith("motor-engine-decode-6.motor-engine-decode.")
    assert find(b, "StatefulSet", "motor-engine-decode")["spec"]["replicas"] == 7


def test_static_union_instance_is_kept_after_the_generated_ones():
    extra = {
        "id": 99,
        "role": "union",
        "model_name": "qwen3",
        "endpoints": [{"id": 0, "address": "union.other-ns.svc.cluster.local:8000"}],
    }
    b = bundle(with_changes(motor_coordinator_config={"instances": [extra]}))
    inst = b["config"]["motor_coordinator_config"]["instances"]
    assert [i["role"] for i in inst] == ["prefill", "decode", "union"] and inst[-1]["id"] == 3


def test_slo_values_of_the_served_model_are_kept():
    cfg = with_changes(
        motor_coordinator_config={"models": [{"id": "qwen3", "slo_ttft": 250, "slo_tpot": 20}]},
        motor_engine_decode_config={"max_model_len": 4096},
    )
    model = bundle(cfg)["config"]["motor_coordinator_config"]["models"]
    assert model == [{"id": "qwen3", "slo_ttft": 250, "slo_tpot": 20, "p_max_seqlen": 8192, "d_max_seqlen": 4096}]


def test_static_instances_that_only_look_like_loopback_are_kept():
    addresses = [
        "10.0.0.5:8000",
        "123.example.com:8000",
        "[::ffff:10.0.0.5]:8001",
        "[2001:db8::1]:8000",
        "localhost.example.com:8000",
    ]
    ext = [{"role": "union", "model_name": "qwen3", "endpoints": [{"address": a}]} for a in addresses]
    rendered = bundle(with_changes(motor_coordinator_config={"instances": ext}))["config"]
    inst = rendered["motor_coordinator_config"]["instances"]
    assert [i["endpoints"][0]["address"] for i in inst[2:]] == addresses


def test_every_input_model_is_kept_even_with_no_instance_yet():
    """Models to be served later (POST /instances/refresh) vanished from the rendered config, SLOs and all."""
    given = [{"id": "later", "slo_ttft": 300, "slo_tpot": 30}, {"id": "qwen3", "slo_ttft": 250}, {"id": "external"}]
    ext = {"role": "union", "model_name": "external", "endpoints": [{"address": "ext.example.com:8000"}]}
    cfg = with_changes(motor_coordinator_config={"models": given, "instances": [ext]})
    rendered = bundle(cfg)["config"]
    assert rendered["motor_coordinator_config"]["models"] == [
        {"id": "qwen3", "slo_ttft": 250, "slo_tpot": 50, "p_max_seqlen": 8192, "d_max_seqlen": 8192},
        {"id": "later", "slo_ttft": 300, "slo_tpot": 30},
        {"id": "external"},
    ]
    coord = config.settings_from_dict(rendered, on_this_host=False)
    assert coord.model("later").slo_ttft_ms == 300 and not any(i.model_name == "later" for i in coord.instances)


def test_cpu_engines_get_a_cpu_kv_buffer_unless_the_input_says_otherwise():
    """With accelerator_num 0 the kv_buffer_device stayed "cuda": a CPU engine has no device for it."""
    cfg = with_changes(
        motor_engine_prefill_config={"accelerator_num": 0}, motor_engine_decode_config={"accelerator_num": 0}
    )
    for section in ("motor_engine_prefill_config", "motor_engine_decode_config"):
        del cfg[section]["kv_buffer_device"]
    b = bundle(cfg)
    for role in ("prefill", "decode"):
        args = find(b, "StatefulSet", R.ENGINE_NAME[role])["spec"]["template"]["spec"]["containers"][0]["args"]
        assert json.loads(args[args.index("--kv-transfer-config") + 1])["kv_buffer_device"] == "cpu"
        assert b["config"][f"motor_engine_{role}_config"]["kv_buffer_device"] == "cpu"
    # The input's value stands: "cuda" (what the default file carries) is refused, not replaced.
    errs = errors_of(with_changes(motor_engine_decode_config={"accelerator_num": 0}))
    assert errs == [
        "motor_engine_decode_config.kv_buffer_device: must be 'cpu' when accelerator_num is 0: the pod "
        "has no accelerator to hold the KV buffer (got 'cuda')"
    ]
    assert load(with_changes(motor_engine_decode_config={"kv_buffer_device": "cpu"})).decode.kv_buffer_device == "cpu"


def test_values_that_need_quoting_stay_intact():
    tricky = "yes: #{not} 'a comment' \"quoted\" & <b> \u00e9"
    cfg = with_changes(
        motor_engine_prefill_config={"env": {"TRICKY": tricky}, "extra_args": ["--x", "null"]},
        motor_coordinator_config={"api_key_config.enable_api_key": True, "api_key_config.valid_keys": ["on", tricky]},
    )
    b = bundle(cfg)
    c = find(b, "StatefulSet", "motor-engine-prefill")["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "TRICKY", "value": tricky} in c["env"]
    assert c["args"][-2:] == ["--x", "null"]
    held = json.loads(find(b, "Secret", R.CONFIG_SECRET_NAME)["stringData"]["user_config.json"])
    assert held["motor_coordinator_config"]["api_key_config"]["valid_keys"] == ["on", tricky]


def test_characters_above_the_bmp_render_as_yaml_escapes():
    """JSON's surrogate-pair escapes ("\\ud83d\\ude00") are rejected by Kubernetes' Go YAML parser."""
    emoji = "smile \U0001f600 \\ud83d literal"
    cfg = with_changes(motor_engine_prefill_config={"env": {"GREETING": emoji}, "extra_args": ["--x", emoji]})
    b = bundle(cfg)
    text = b["files"]["engine_prefill.yaml"]
    assert "\\ud83d\\ude00" not in text.lower() and "\\U0001F600" in text
    pod = find(b, "StatefulSet", "motor-engine-prefill")["spec"]["template"]["spec"]
    assert {"name": "GREETING", "value": emoji} in pod["containers"][0]["env"]
    assert pod["containers"][0]["args"][-1] == emoji


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    "changes, expected",
    [
        (
            {"motor_deploy_config": {"coordinator_node_port": 80}},
            "motor_deploy_config.coordinator_node_port: must be 30000..32767",
        ),
        (
            {"motor_deploy_config": {"coordinator_node_port": 32768}},
            "motor_deploy_config.coordinator_node_port: must be 30000..32767",
        ),
        ({"motor_deploy_config": {"d_instances_num": 0}}, "motor_deploy_config.d_instances_num: must be 1..64"),
        ({"motor_deploy_config": {"p_instances_num": 0}}, "motor_deploy_config.p_instances_num: must be 1..64"),
        (
            {"motor_deploy_config": {"coordinator_replicas": 0}},
            "motor_deploy_config.coordinator_replicas: must be 1..16",
        ),
        ({"motor_deploy_config": {"redis_image": ""}}, "motor_deploy_config.redis_image: must be a non-empty image"),
        (
            {"motor_deploy_config": {"redis_storage_size": "lots"}},
            "motor_deploy_config.redis_storage_size: empty or a Kubernetes quantity",
        ),
        (
            {"motor_deploy_config": {"redis_storage_class": "Fast_SSD"}},
            "motor_deploy_config.redis_storage_class: not a StorageClass name",
        ),
        (
            {"motor_deploy_config": {"redis_password_secret": "motor-coordinator-config"}},
            "motor_deploy_config.redis_password_secret: 'motor-coordinator-config' is the Secret",
        ),
        (
            {"motor_deploy_config": {"redis_resources": {"requests": {"memory": "2Gi"}, "limits": {"memory": "1Gi"}}}},
            "motor_deploy_config.redis_resources.requests.memory: 2Gi exceeds limits.memory 1Gi",
        ),
        (
            {"motor_deploy_config": {"redis_password_secret": "pw", "tls_mount_path": "/etc/motor-redis"}},
            "motor_deploy_config.tls_mount_path: '/etc/motor-redis' overlaps /etc/motor-redis",
        ),
        (
            {"motor_coordinator_config": {"cluster_config": "redis://x:6379"}},
            "motor_coordinator_config.cluster_config: must be an object",
        ),
        ({"motor_deploy_config": {"p_instances_num": "2"}}, "motor_deploy_config.p_instances_num: must be an integer"),
        ({"motor_deploy_config": {"p_instances_num": True}}, "motor_deploy_config.p_instances_num: must be an integer"),
        ({"motor_deploy_config": {"job_id": "Bad_NS"}}, "motor_deploy_config.job_id: must be a DNS-1123 label"),
        ({"motor_deploy_config": {"image_pull_policy": "Sometimes"}}, "motor_deploy_config.image_pull_policy:"),
        ({"motor_deploy_config": {"replicas": 2}}, "motor_deploy_config.replicas: unknown key"),
        (
            {"motor_deploy_config": {"coordinator_resources": {"requests": {"cpu": "4"}, "limits": {"cpu": "2"}}}},
            "motor_deploy_config.coordinator_resources.requests.cpu: 4 exceeds limits.cpu 2",
        ),
        (
            {"motor_deploy_config": {"coordinator_resources": {"requests": {"memory": "lots"}}}},
            "motor_deploy_config.coordinator_resources.requests.memory: not a Kubernetes quantity",
        ),
        (
            {"motor_coordinator_config": {"api_config.coordinator_api_mgmt_port": 1025}},
            "motor_coordinator_config.api_config.coordinator_api_mgmt_port: clashes with "
            "motor_coordinator_config.api_config.coordinator_api_infer_port",
        ),
        (
            {"motor_coordinator_config": {"api_config.coordinator_obs_port": 70000}},
            "motor_coordinator_config.api_config.coordinator_obs_port: must be 1..65535",
        ),
        (
            {"motor_engine_decode_config": {"side_channel_port": 8000}},
            "motor_engine_decode_config.side_channel_port: clashes with motor_engine_decode_config.port",
        ),
        (
            {
                "motor_coordinator_config": {
                    "instances": [
                        {
                            "id": 1,
                            "role": "verifier",
                            "model_name": "qwen3",
                            "endpoints": [{"id": 0, "address": "x.y:8000"}],
                        }
                    ]
                }
            },
            "motor_coordinator_config.instances[0].role: must be one of prefill, decode, union",
        ),
        (
            {
                "motor_coordinator_config": {
                    "instances": [
                        {
                            "id": 1,
                            "role": "union",
                            "model_name": "qwen3",
                            "endpoints": [{"id": 0, "address": "127.0.0.1:8000"}],
                        }
                    ]
                }
            },
            "motor_coordinator_config.instances[0].endpoints[0].address: '127.0.0.1:8000' is a loopback address",
        ),
        (
            {
                "motor_coordinator_config": {
                    "instances": [
                        {"role": "union", "model_name": "qwen3", "endpoints": [{"address": "http://127.0.0.1:8000"}]}
                    ]
                }
            },
            "motor_coordinator_config.instances[0].endpoints[0].address: 'http://127.0.0.1:8000' is a loopback address",
        ),
        (
            {
                "motor_coordinator_config": {
                    "instances": [{"role": "union", "model_name": "qwen3", "endpoints": [{"address": "[::1]:8000"}]}]
                }
            },
            "motor_coordinator_config.instances[0].endpoints[0].address: '[::1]:8000' is a loopback address",
        ),
        (
            {
                "motor_coordinator_config": {
                    "instances": [{"role": "union", "model_name": "qwen3", "endpoints": [{"address": "::1:8000"}]}]
                }
            },
            "motor_coordinator_config.instances[0].endpoints[0].address: must be host:port",
        ),
        (
            {
                "motor_coordinator_config": {
                    "instances": [
                        {"role": "union", "model_name": "qwen3", "endpoints": [{"address": "https://LOCALHOST:8443"}]}
                    ]
                }
            },
            "motor_coordinator_config.instances[0].endpoints[0].address: 'https://LOCALHOST:8443' is a loopback address",
        ),
        # Every spelling the resolver reads as loopback: a final dot, inet_aton's IPv4 forms, IPv4-mapped IPv6.
        *[
            (
                {
                    "motor_coordinator_config": {
                        "instances": [
                            {
                                "role": "union",
                                "model_name": "qwen3",
                                "endpoints": [{"address": "ext.example.com:8000"}, {"address": address}],
                            }
                        ]
                    }
                },
                f"motor_coordinator_config.instances[0].endpoints[1].address: {address!r} is a loopback address",
            )
            for address in (
                "localhost.:8000",
                "127.1:8000",
                "2130706433:8000",
                "0x7f.1:8000",
                "0177.0.0.1:8000",
                "127.0.0.1.:8000",
                "0:8000",
                "[::ffff:127.0.0.1]:8000",
                "http://[::ffff:7f00:1]:8000",
            )
        ],
        # What the Coordinator itself refuses, on the input's index (the deployer renumbers instances).
        (
            {
                "motor_coordinator_config": {
                    "instances": [{"role": "union", "endpoints": [{"address": "10.0.0.5:8000"}]}]
                }
            },
            "motor_coordinator_config.instances[0].model_name: must be a string",
        ),
        (
            {
                "motor_coordinator_config": {
                    "instances": [{"role": "union", "model_name": ["m"], "endpoints": [{"address": "e:8000"}]}]
                }
            },
            "motor_coordinator_config.instances[0].model_name: must be a string",
        ),
        (
            {
                "motor_coordinator_config": {
                    "instances": [
                        {"role": "union", "model_name": "qwen3", "endpoints": [{"address": "ext-engine:http"}]}
                    ]
                }
            },
            "motor_coordinator_config.instances[0].endpoints[0].address: must be host:port",
        ),
        (
            {"motor_coordinator_config": {"models": [{"id": ["x"]}]}},
            "motor_coordinator_config.models[0].id: must be a string",
        ),
        (
            {"motor_coordinator_config": {"scheduler_config.scheduler_type": "least_load"}},
            "motor_coordinator_config.scheduler_config.scheduler_type: must be one of round_robin",
        ),
        (
            {"motor_coordinator_config": {"models": [{"id": "qwen3", "slo_ttft": 0}]}},
            "motor_coordinator_config.models[0].slo_ttft: must be >= 1",
        ),
        (
            {"motor_coordinator_config": {"scheduler_config.pd_dispatch": "both"}},
            "motor_coordinator_config.scheduler_config.pd_dispatch: must be one of handoff, trigger",
        ),
        (
            {"motor_coordinator_config": {"mgmt_tls_config": {"enable_tls": True, "cert_file": "", "key_file": "/k"}}},
            "motor_coordinator_config.mgmt_tls_config.cert_file: required when enable_tls is true",
        ),
        (
            {
                "motor_coordinator_config": {
                    "infer_tls_config": {
                        "enable_tls": True,
                        "cert_file": "/etc/ssl/c.crt",
                        "key_file": "/etc/motor-tls/k.key",
                    }
                }
            },
            "motor_coordinator_config.infer_tls_config.cert_file: must be a file under motor_deploy_config.tls_mount_path",
        ),
        (
            {"motor_engine_decode_config": {"served_model_name": "other"}},
            "motor_engine_decode_config.served_model_name: 'other' differs",
        ),
        (
            {"motor_engine_prefill_config": {"tensor_parallel_size": 4}},
            "motor_engine_prefill_config.accelerator_num: 1 is fewer than tensor_parallel_size",
        ),
        ({"motor_engine_prefill_config": {"engine_type": "sglang"}}, "motor_engine_prefill_config.engine_type:"),
        (
            {"motor_engine_prefill_config": {"model_path": "/data/qwen3"}},
            "motor_engine_prefill_config.model_path: '/data/qwen3' is not under motor_deploy_config.weight_mount_path",
        ),
        (
            {"motor_engine_prefill_config": {"env": {"VLLM_NIXL_SIDE_CHANNEL_PORT": "1"}}},
            "motor_engine_prefill_config.env.VLLM_NIXL_SIDE_CHANNEL_PORT: set by the deployer",
        ),
        (
            {"motor_engine_prefill_config": {"extra_args": ["--enforce-eager", "--port", "9000"]}},
            "motor_engine_prefill_config.extra_args[1]: '--port' would override --port, which the deployer sets (from port)",
        ),
        (
            {"motor_engine_decode_config": {"extra_args": ["--max_model_len=32768"]}},
            "motor_engine_decode_config.extra_args[0]: '--max_model_len=32768' would override --max-model-len",
        ),
        (
            {"motor_engine_prefill_config": {"extra_args": ["-tp", "2"]}},
            "motor_engine_prefill_config.extra_args[0]: '-tp' would override -tp, which the deployer sets "
            "(from tensor_parallel_size)",
        ),
        (
            {"motor_engine_prefill_config": {"extra_args": ["--kv-transfer-config.kv_role", "kv_both"]}},
            "motor_engine_prefill_config.extra_args[0]: '--kv-transfer-config.kv_role' would override --kv-transfer-config",
        ),
        (
            {"motor_engine_prefill_config": {"extra_args": ["--served-model", "x"]}},
            "motor_engine_prefill_config.extra_args[0]: '--served-model' would override --served-model-name",
        ),
        (
            {"motor_deploy_config": {"tls_mount_path": "/tmp"}},
            "motor_deploy_config.tls_mount_path: '/tmp' overlaps /tmp, also mounted in the Coordinator pod",
        ),
        (
            {"motor_deploy_config": {"tls_mount_path": "/etc/motor/tls"}},
            "motor_deploy_config.tls_mount_path: '/etc/motor/tls' overlaps /etc/motor",
        ),
        (
            {"motor_deploy_config": {"tls_mount_path": "/etc"}},
            "motor_deploy_config.tls_mount_path: '/etc' overlaps /etc/motor",
        ),
        ({"motor_deploy_config": {"tls_mount_path": "/"}}, "motor_deploy_config.tls_mount_path: '/' overlaps"),
        (
            {"motor_deploy_config": {"tls_mount_path": "/x/../tmp"}},
            "motor_deploy_config.tls_mount_path: must be a normalized absolute directory",
        ),
        (
            {
                "motor_deploy_config": {"weight_mount_path": "/dev/shm/"},
                "motor_engine_prefill_config": {"model_path": "/dev/shm/qwen3"},
                "motor_engine_decode_config": {"model_path": "/dev/shm/qwen3"},
            },
            "motor_deploy_config.weight_mount_path: '/dev/shm/' overlaps /dev/shm, also mounted in the engine pods",
        ),
        # A volume on the code directory or a system directory hides what the container runs: a crash loop.
        *[
            ({"motor_deploy_config": {"tls_mount_path": path}}, f"motor_deploy_config.tls_mount_path: {path!r} {why}")
            for path, why in (
                ("/opt/motor", "would hide /opt/motor"),
                ("/opt/motor/tls", "lies inside /opt/motor"),
                ("/opt", "would hide /opt"),
                ("/usr", "would hide /usr"),
                ("/var/", "would hide /var"),
                ("/usr/local/tls", "lies inside /usr"),
                ("/lib64/x", "lies inside /lib64"),
            )
        ],
        *[
            (
                {
                    "motor_deploy_config": {"weight_mount_path": path},
                    "motor_engine_prefill_config": {"model_path": path + "/qwen3"},
                    "motor_engine_decode_config": {"model_path": path + "/qwen3"},
                },
                f"motor_deploy_config.weight_mount_path: {why}",
            )
            for path, why in (
                ("/usr", "'/usr' would hide /usr"),
                ("/etc", "'/etc' would hide /etc"),
                ("/usr/lib/models", "'/usr/lib/models' lies inside /usr"),
                # Kubernetes refuses '..' in a mountPath or hostPath; //usr and /usr/. are /usr.
                ("/mnt/../weight", "must be a normalized absolute directory (got '/mnt/../weight')"),
                ("/mnt/./weight", "must be a normalized absolute directory"),
                ("//usr", "must be a normalized absolute directory"),
                ("mnt/weight", "must be a normalized absolute directory"),
            )
        ],
        (
            {"motor_deploy_config": {"tls_mount_path": "//opt/motor"}},
            "motor_deploy_config.tls_mount_path: must be a normalized absolute directory",
        ),
        (
            {"motor_engine_prefill_config": {"gpu_memory_utilization": 1.5}},
            "motor_engine_prefill_config.gpu_memory_utilization: must be in (0, 1]",
        ),
        # `$` matches before a final newline: every name is matched whole.
        (
            {
                "motor_engine_prefill_config": {"kv_connector": "Nixl\n"},
                "motor_engine_decode_config": {"kv_connector": "Nixl\n"},
            },
            "motor_engine_prefill_config.kv_connector: must be a connector class name",
        ),
        (
            {"motor_engine_decode_config": {"env": {"A\n": "1"}}},
            "motor_engine_decode_config.env.A\n: not a valid environment",
        ),
        (
            {"motor_deploy_config": {"service_account_name": "sa\n"}},
            "motor_deploy_config.service_account_name: not a service account name, a DNS subdomain",
        ),
        (
            {"motor_deploy_config": {"tls_secret_name": "tls\n"}},
            "motor_deploy_config.tls_secret_name: not a Secret name",
        ),
        (
            {"motor_deploy_config": {"tls_secret_name": "motor-coordinator-config"}},
            "motor_deploy_config.tls_secret_name: 'motor-coordinator-config' is the Secret the deployer renders",
        ),
        (
            {"motor_deploy_config": {"tls_secret_name": "a" * 254}},
            "motor_deploy_config.tls_secret_name: not a Secret name",
        ),
        (
            {"motor_deploy_config": {"image_pull_secrets": ["ok", "reg\n"]}},
            "motor_deploy_config.image_pull_secrets[1]: not a Secret name",
        ),
        ({"motor_deploy_config": {"service_account_name": "s" * 254}}, "motor_deploy_config.service_account_name:"),
        ({"motor_deploy_config": {"cluster_domain": "cluster.local\n"}}, "motor_deploy_config.cluster_domain: must be"),
        ({"motor_deploy_config": {"dshm_size": "8Gi\n"}}, "motor_deploy_config.dshm_size: not a Kubernetes quantity"),
        (
            {"motor_engine_decode_config": {"resources": {"limits": {"cpu": "16\n"}}}},
            "motor_engine_decode_config.resources.limits.cpu: not a Kubernetes quantity",
        ),
        # Native resources would replace the engine's own requests and limits; the rest Kubernetes refuses.
        *[
            (
                {"motor_engine_prefill_config": {"accelerator_resource_name": name}},
                "motor_engine_prefill_config.accelerator_resource_name: not an extended resource name",
            )
            for name in (
                "cpu",
                "memory",
                "ephemeral-storage",
                "hugepages-2Mi",
                "gpu",
                "nvidia.com/",
                "example.com/a/b",
                "kubernetes.io/gpu",
                "gpu.kubernetes.io/a100",
                "requests.example.com/gpu",
                "Example.com/gpu",
                "/gpu",
                "nvidia.com/gpu\n",
                "a" * 245 + "/gpu",
            )
        ],
        # Tolerations and node selectors that kubectl would refuse (the schemas alone accept them).
        (
            {"motor_deploy_config": {"coordinator_tolerations": [{"foo": 1}]}},
            "motor_deploy_config.coordinator_tolerations[0].foo: unknown key (known: key, operator, value, effect, "
            "tolerationSeconds)",
        ),
        (
            {"motor_engine_prefill_config": {"tolerations": [{"key": "k", "value": 5}]}},
            "motor_engine_prefill_config.tolerations[0].value: must be a string (got 5)",
        ),
        (
            {
                "motor_engine_prefill_config": {
                    "tolerations": [
                        {"key": "k", "operator": "Exists", "tolerationSeconds": True, "effect": "NoExecute"}
                    ]
                }
            },
            "motor_engine_prefill_config.tolerations[0].tolerationSeconds: must be an integer (got True)",
        ),
        (
            {"motor_engine_decode_config": {"tolerations": [{"key": "k", "operator": "In", "value": "v"}]}},
            "motor_engine_decode_config.tolerations[0].operator: must be one of Equal, Exists (got 'In')",
        ),
        (
            {"motor_deploy_config": {"coordinator_tolerations": [{"key": "k", "operator": "Exists", "value": "v"}]}},
            "motor_deploy_config.coordinator_tolerations[0].value: must be empty when operator is Exists",
        ),
        (
            {"motor_deploy_config": {"coordinator_tolerations": [{"value": "v", "effect": "NoSchedule"}]}},
            "motor_deploy_config.coordinator_tolerations[0].operator: must be Exists when key is empty",
        ),
        (
            {"motor_deploy_config": {"coordinator_tolerations": [{"key": "k", "value": "two words"}]}},
            "motor_deploy_config.coordinator_tolerations[0].value: not a label value",
        ),
        (
            {"motor_deploy_config": {"coordinator_tolerations": [{"key": "k", "value": "a" * 64}]}},
            "motor_deploy_config.coordinator_tolerations[0].value: not a label value",
        ),
        (
            {"motor_deploy_config": {"coordinator_tolerations": [{"key": "a b", "operator": "Exists"}]}},
            "motor_deploy_config.coordinator_tolerations[0].key: not a label key",
        ),
        (
            {
                "motor_deploy_config": {
                    "coordinator_tolerations": [{"key": "k", "operator": "Exists", "effect": "NoRun"}]
                }
            },
            "motor_deploy_config.coordinator_tolerations[0].effect: must be empty (every effect) or one of NoSchedule",
        ),
        (
            {
                "motor_deploy_config": {
                    "coordinator_tolerations": [
                        {"key": "k", "operator": "Exists", "effect": "NoSchedule", "tolerationSeconds": 60}
                    ]
                }
            },
            "motor_deploy_config.coordinator_tolerations[0].tolerationSeconds: only with effect NoExecute",
        ),
        (
            {"motor_deploy_config": {"coordinator_node_selector": {"a b": "c"}}},
            "motor_deploy_config.coordinator_node_selector.a b: not a label key",
        ),
        (
            {"motor_deploy_config": {"coordinator_node_selector": {"a": "c d"}}},
            "motor_deploy_config.coordinator_node_selector.a: not a label value",
        ),
        (
            {"motor_engine_prefill_config": {"node_selector": {"Example.com/gpu": "h200"}}},
            "motor_engine_prefill_config.node_selector.Example.com/gpu: not a label key",
        ),
        (
            {"motor_engine_decode_config": {"node_selector": {"/gpu": "h200"}}},
            "motor_engine_decode_config.node_selector./gpu: not a label key",
        ),
        (
            {"motor_engine_decode_config": {"node_selector": {"gpu": "-h200"}}},
            "motor_engine_decode_config.node_selector.gpu: not a label value",
        ),
        (
            {"motor_engine_decode_config": {"node_selector": {"x" * 64: "h200"}}},
            f"motor_engine_decode_config.node_selector.{'x' * 64}: not a label key",
        ),
    ],
)
def test_bad_input_is_refused_naming_the_key(changes, expected):
    errs = errors_of(with_changes(**changes))
    assert any(e.startswith(expected) for e in errs), errs


def test_mount_paths_of_their_own_inside_system_directories_are_fine():
    for tls, weights in (
        ("/opt/motor-tls", "/root/.cache/huggingface"),
        ("/etc/ssl/motor", "/var/lib/models/"),
        ("/run/secrets/motor", "/data"),
    ):
        s = load(
            with_changes(
                motor_deploy_config={"tls_mount_path": tls, "weight_mount_path": weights},
                motor_engine_prefill_config={"model_path": weights.rstrip("/") + "/qwen3"},
                motor_engine_decode_config={"model_path": weights.rstrip("/") + "/qwen3"},
            )
        )
        assert (s.deploy.tls_mount_path, s.deploy.weight_mount_path) == (tls, weights)


def test_a_job_id_with_a_final_newline_is_refused_as_the_job_id():
    """It passed the job_id check and the Coordinator's loader then blamed an engine address."""
    errs = errors_of(with_changes(motor_deploy_config={"job_id": "mindie-motor\n"}))
    assert errs == [
        "motor_deploy_config.job_id: must be a DNS-1123 label of at most 40 characters "
        "(lowercase letters, digits, '-'; got 'mindie-motor\\n')"
    ]
    assert load(with_changes(motor_deploy_config={"tls_secret_name": "a" * 253})).deploy.tls_secret_name == "a" * 253


def test_values_in_the_engine_comment_cannot_break_the_yaml():
    s = load(base())
    s.prefill.kv_connector = "Nixl\nextra: 1"  # what load refuses: the comment would end at the line break
    docs = list(yaml.safe_load_all(R.render(s)["engine_prefill.yaml"]))
    assert [sorted(d) for d in docs] == [["apiVersion", "kind", "metadata", "spec"]] * 2


def test_accelerators_are_any_extended_resource_and_never_replace_cpu_or_memory():
    names = ("amd.com/gpu", "example.com/a_b.c", "a" * 244 + "/gpu")
    for name in names:
        b = bundle(with_changes(motor_engine_decode_config={"accelerator_resource_name": name, "accelerator_num": 2}))
        res = find(b, "StatefulSet", R.ENGINE_NAME["decode"])["spec"]["template"]["spec"]["containers"][0]["resources"]
        assert res == {
            "requests": {"cpu": "4", "memory": "32Gi", name: "2"},
            "limits": {"cpu": "16", "memory": "64Gi", name: "2"},
        }
    s = load(base())
    s.prefill.accelerator_resource_name = "memory"  # what load refuses: the render does not write it over memory
    with pytest.raises(AssertionError):
        R.render(s)


def test_a_misspelled_section_is_refused_not_ignored(tmp_path):
    """motor_engine_prefil_config was ignored, and the prefill engines rendered with the defaults."""
    cfg = base()
    cfg["motor_engine_prefil_config"] = cfg.pop("motor_engine_prefill_config")
    assert errors_of(cfg) == [
        "motor_engine_prefil_config: unknown top-level key; did you mean motor_engine_prefill_config?"
    ]
    for near_miss, meant in (
        ("motor_decode_config", "motor_engine_decode_config"),
        ("Motor_Deploy_Config", "motor_deploy_config"),
        ("motor_coordinator", "motor_coordinator_config"),
    ):
        other = base()
        other[near_miss] = other.pop(meant)
        assert f"{near_miss}: unknown top-level key; did you mean {meant}?" in errors_of(other)
    proc = _cli_render(tmp_path, json.dumps(cfg))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.splitlines()[1:] == [f"  {errors_of(cfg)[0]}"], proc.stderr
    assert not (tmp_path / "o").exists()


def test_another_top_level_section_is_passed_over_with_a_warning(tmp_path):
    """A MindIE-PyMotor user_config.json carries sections of components this project does not have."""
    cfg = base()
    cfg["motor_controller_config"] = {"standby": True}
    cfg["motor_nodemanager_config"] = {}
    cfg["motor_engine_config"] = {}
    assert load(cfg).deploy == load(base()).deploy
    proc = _cli_render(tmp_path, json.dumps(cfg))
    assert proc.returncode == 0, proc.stderr
    assert "motor_controller_config: unknown top-level key, not read" in proc.stderr


def test_refusals_of_models_and_static_instances_name_the_input_s_index():
    """The render puts the served model first and the engine pods before the static instances: the
    Coordinator's messages on the rendered file named positions the input does not have."""
    cfg = with_changes(motor_coordinator_config={"models": [{"id": "other"}, {"id": "qwen3", "slo_ttft": -1}]})
    assert errors_of(cfg) == ["motor_coordinator_config.models[1].slo_ttft: must be >= 1"]
    ext = [
        {"role": "union", "model_name": "other", "endpoints": [{"address": "ext.example.com:8000"}]},
        {"role": "union", "model_name": "other", "endpoints": [{"address": "http://ext.example.com:8000"}]},
    ]
    cfg = with_changes(motor_coordinator_config={"models": [{"id": "other"}], "instances": ext})
    # Instance 3: the id the render gives the first static instance, after 1 prefill and 1 decode pod.
    assert errors_of(cfg) == [
        "motor_coordinator_config.instances[1].endpoints[0].address: ext.example.com:8000 "
        "is already the address of instance 3"
    ]


def test_a_static_instance_at_an_engine_pod_s_address_is_named_by_the_input_s_index():
    """It was named by its rendered index (instances[3]), after the engine pods."""
    pod = "http://Motor-engine-decode-0.motor-engine-decode.mindie-motor.svc.cluster.local:8000"
    ext = [
        {"role": "union", "model_name": "qwen3", "endpoints": [{"address": "ext.example.com:8000"}]},
        {"role": "union", "model_name": "qwen3", "endpoints": [{"address": "a.example.com:1"}, {"address": pod}]},
    ]
    assert errors_of(with_changes(motor_coordinator_config={"instances": ext})) == [
        "motor_coordinator_config.instances[1].endpoints[1].address: motor-engine-decode-0.motor-engine-decode."
        "mindie-motor.svc.cluster.local:8000 is already the address of instance 2, an engine pod the deployer renders"
    ]


def test_unknown_model_keys_are_warned_about_once_on_the_input_s_index(caplog):
    load(with_changes(motor_coordinator_config={"models": [{"id": "other", "x": 1}, {"id": "qwen3", "y": 1}]}))
    assert [r.getMessage() for r in caplog.records if "models[" in r.getMessage()] == [
        "config: unknown key motor_coordinator_config.models[0].x ignored",
        "config: unknown key motor_coordinator_config.models[1].y ignored",
    ]


def test_several_errors_are_reported_together():
    errs = errors_of(with_changes(motor_deploy_config={"coordinator_node_port": 1, "d_instances_num": 0}))
    assert len(errs) == 2


def test_missing_sections_take_defaults_but_coordinator_section_is_required():
    s = load({"motor_coordinator_config": {}})
    assert s.deploy.coordinator_node_port == 31015 and s.prefill.port == 8000
    assert s.coordinator.infer_port == 1025
    assert errors_of({"motor_deploy_config": {}}) == [
        "motor_coordinator_config: missing (the Coordinator's own section is required)"
    ]


# --------------------------------------------------------------------------- end to end (needs app.py)


def test_coordinator_starts_on_rendered_config_with_loopback_addresses(sims):
    """The rendered user_config.json, engines swapped for simulators on loopback, serves a PD request."""
    import httpx
    import openai

    from harness.coordinator import Coordinator
    from harness.loopback import free_port

    cfg = bundle(base())["config"]
    coord = cfg["motor_coordinator_config"]
    coord["api_config"].update(
        {
            "coordinator_api_host": "127.0.0.1",
            "coordinator_api_infer_port": free_port(),
            "coordinator_api_mgmt_port": free_port(),
            "coordinator_obs_port": free_port(),
        }
    )
    model = coord["models"][0]["id"]
    for inst in coord["instances"]:
        inst["endpoints"][0]["address"] = sims(inst["role"], model=model).address
    with Coordinator(cfg, wrap=False) as running:
        listed = json.dumps(httpx.get(running.mgmt + "/instances").json())
        for inst in coord["instances"]:
            assert inst["endpoints"][0]["address"] in listed
        c = openai.OpenAI(base_url=running.url + "/v1", api_key="x", max_retries=0)
        resp = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        assert resp.choices[0].message.content
