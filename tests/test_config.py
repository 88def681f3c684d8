"""Config values that would fail at start-up are refused when the config is read: one line naming the key
path, a non-zero exit, no traceback."""

from __future__ import annotations

import pytest

from config import ConfigError, settings_from_dict
from tests.support import coordinator_config, instance

MODEL = "qwen3"


def union(iid: int, *addresses: str) -> dict:
    return instance(iid, "union", MODEL, *addresses)


def refused(cfg: dict) -> str:
    with pytest.raises(ConfigError) as info:
        settings_from_dict({"motor_coordinator_config": cfg})
    return str(info.value)


def test_duplicate_endpoint_ids_in_one_instance_are_refused():
    inst = union(1, "127.0.0.1:9", "127.0.0.1:8")
    inst["endpoints"][1]["id"] = 0
    assert refused(coordinator_config([inst])) == (
        "motor_coordinator_config.instances[0].endpoints[1].id: duplicate endpoint id 0 in instance 1"
    )
    # The same id in two instances names two endpoints: fine.
    assert settings_from_dict(coordinator_config([union(1, "127.0.0.1:9"), union(2, "127.0.0.1:8")]))
