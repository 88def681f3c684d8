"""Exact prompt ids on a live Coordinator (scheduling/exact.py): a model with a `tokenizer_path`, a chat prompt
of 10 to 27 KiB encoded off the event loop, and an engine whose KV events (a raw ZMQ publisher the test
drives, as vLLM's) say it holds the prompt's leading blocks in the tokenizer's own ids. The Coordinator's
prediction is only exact when it encoded the whole rendered chat as the engine does."""

from __future__ import annotations

import httpx
import pytest

from harness.configs import coordinator_config
from harness.coordinator import Coordinator
from harness.loopback import free_ports, wait_until
from harness.tokenizer import tiny_tokenizer
from tests.test_kv_events import BLOCK, RawPublisher, sim_with_events, stored

LINE = "the quick brown fox jumps over the lazy dog\n"


def _conversation(turns: int) -> list[dict]:
    messages = [{"role": "system", "content": "system user assistant tools " * 40}]
    for t in range(turns):
        messages.append({"role": "user", "content": f"turn {t} " + LINE * 200})  # 8.6 KiB a turn
        messages.append({"role": "assistant", "content": "the dog " * 20})
    return messages[:-1]  # ends with the user's turn


def _rendered(messages: list[dict]) -> str:
    """harness.tokenizer.TEMPLATE by hand: what vLLM renders for this model."""
    body = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return "<s>" + body + "<|im_start|>assistant\n"


def _config(tmp_path, sim, pub: int, replay: int) -> dict:
    """A Coordinator routing on KV events published at `pub` (replayed at `replay`) for its one union engine `sim`,
    with the model's tokenizer in `tmp_path`."""
    kv = {"endpoint": f"tcp://127.0.0.1:{pub}", "replay_endpoint": f"tcp://127.0.0.1:{replay}"}
    instances = [
        {"id": 1, "role": "union", "model_name": "m", "endpoints": [{"id": 0, "address": sim.address, "kv_events": kv}]}
    ]
    return coordinator_config(
        instances,
        models=[{"id": "m", "tokenizer_path": str(tmp_path)}],
        scheduler_config={"scheduler_type": "kv_cache_affinity"},
        kv_event_config={"enable": True},
    )


def test_a_long_conversation_is_predicted_from_its_exact_ids(tmp_path):
    pytest.importorskip("tokenizers")
    tok = tiny_tokenizer(str(tmp_path))
    pub, replay, sim_pub = free_ports(3)
    publisher = RawPublisher(pub, replay)
    sim = sim_with_events(sim_pub, None)  # its own events go nowhere: the raw publisher speaks for it
    cfg = _config(tmp_path, sim, pub, replay)
    try:
        with Coordinator(cfg) as coord:
            publisher.serve_replay(10.0)  # what the subscriber asks at connect: nothing was published before
            assert httpx.get(coord.mgmt + "/instances").json()["prompt_tokens"] == {"m": "exact"}
            seq, first = 0, 100
            for turns in (1, 3):  # the second request is turn 3 of the same conversation: its pieces mostly cached
                messages = _conversation(turns)
                ids = tok.encode(_rendered(messages), add_special_tokens=False).ids
                held = (len(ids) // BLOCK - 3) * BLOCK  # the engine holds all but the last blocks
                publisher.send(seq, [{"type": "AllBlocksCleared"}, stored(ids[:held], first)])
                seq, first = seq + 1, first + held
                assert wait_until(
                    lambda h=held: httpx.get(coord.mgmt + "/instances").json()["instances"][0]["endpoints"][0][
                        "kv_events"
                    ]["blocks"]
                    == h // BLOCK,
                    5,
                )
                r = httpx.post(
                    coord.url + "/v1/chat/completions",
                    json={"model": "m", "messages": messages, "max_tokens": 1},
                    timeout=30,
                )
                assert r.status_code == 200, r.text
                assert wait_until(lambda h=held: f"cached_tokens_predicted={h} " in coord.output(), 5), held
    finally:
        publisher.close()
        sim.stop()


def test_a_prompt_without_exact_ids_is_counted_unpredicted(tmp_path):
    """A chat with an image cannot be rendered to ids here (the engine expands it): the events cannot predict it,
    and the Coordinator says so, in its line and in `motor_kv_prediction_total{outcome="unpredicted"}`, rather
    than leave it out of the count (which read as fewer requests than were served)."""
    pytest.importorskip("tokenizers")
    tiny_tokenizer(str(tmp_path))
    pub, replay = free_ports(2)
    sim = sim_with_events(pub, replay)
    cfg = _config(tmp_path, sim, pub, replay)
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    chats = [
        [{"role": "user", "content": LINE * 20}],
        [{"role": "user", "content": [{"type": "text", "text": LINE * 20}, image]}],
    ]
    try:
        with Coordinator(cfg) as coord:
            for messages in chats:
                r = httpx.post(
                    coord.url + "/v1/chat/completions",
                    json={"model": "m", "messages": messages, "max_tokens": 1},
                    timeout=30,
                )
                assert r.status_code == 200, r.text
            assert wait_until(lambda: coord.output().count(" cached_tokens=") == 2, 5), coord.output()
            lines = [line for line in coord.output().splitlines() if " cached_tokens=" in line]
            assert "cached_tokens_predicted=0 " in lines[0] and "cached_tokens_predicted=- " in lines[1], lines

            def outcomes() -> str:
                return httpx.get(coord.obs + "/metrics").text

            assert wait_until(lambda: 'motor_kv_prediction_total{model="m",outcome="unpredicted"} 1.0' in outcomes(), 5)
            assert 'motor_kv_prediction_total{model="m",outcome="exact"} 1.0' in outcomes()
    finally:
        sim.stop()
