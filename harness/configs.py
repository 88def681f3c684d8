"""motor_coordinator_config objects for a Coordinator on loopback: its API section on free ports, its
instances, and the defaults the tests run with."""

from __future__ import annotations

from harness.loopback import free_ports

# The checks of a Coordinator in front of real vLLM engines. A killed engine refuses connections and is dropped at
# the next check; one that answers /health late is kept through 40 late answers in a row (about a minute): three
# vLLM engines (one maybe restarting), the Coordinator and the tests share 2 cores, and a CI run saw a live P answer
# nothing for 17 s. Dropped, P's requests are served on D alone, which the PD tests count as a missed handoff.
REAL_ENGINE_CHECKS = {"health_check_interval": 0.5, "health_check_timeout_failures": 40, "metrics_scrape_interval": 1.0}


def instance(iid: int, role: str, model: str, *addresses: str, **extra) -> dict:
    """One `instances[]` entry: endpoint k listens at addresses[k]."""
    return {
        "id": iid,
        "role": role,
        "model_name": model,
        "endpoints": [{"id": i, "address": a} for i, a in enumerate(addresses)],
        **extra,
    }


def api_config() -> dict:
    """The api_config section: 127.0.0.1, three distinct free ports (inference, management, metrics)."""
    infer, mgmt, obs = free_ports(3)
    return {
        "coordinator_api_host": "127.0.0.1",
        "coordinator_api_infer_port": infer,
        "coordinator_api_mgmt_port": mgmt,
        "coordinator_obs_port": obs,
    }


def coordinator_config(instances: list[dict], models: list[dict] | None = None, **sections) -> dict:
    """A motor_coordinator_config object; each of `sections` (api_key_config=...) is merged into the default
    section of its name when both are objects, and replaces it otherwise."""
    cfg = {
        "api_config": api_config(),
        "inference_workers_config": {"num_workers": 1},
        "scheduler_config": {"health_check_interval": 0.2, "metrics_scrape_interval": 0.2},
        "exception_config": {"retry_delay": 0.01},
        "log_config": {"log_level": "INFO"},
        "models": models if models is not None else [],
        "instances": instances,
    }
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(cfg.get(key), dict):
            cfg[key] = {**cfg[key], **value}
        else:
            cfg[key] = value
    return cfg


def api_keys(*keys: str, header: str = "Authorization", prefix: str = "Bearer ") -> dict:
    """An api_key_config section that admits `keys`, read from `header` after `prefix`."""
    return {"enable_api_key": True, "valid_keys": list(keys), "header_name": header, "key_prefix": prefix}
