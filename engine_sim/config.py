"""SimConfig: every knob of one simulated vLLM server."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

FAULT_KNOBS = (
    "fail_status",
    "fail_first_n",
    "hang_before_first_byte",
    "slow_first_byte_s",
    "stall_mid_stream_after_n",
    "close_mid_stream_after_n",
    "malformed_chunk_after_n",
    "partial_event_at_n",
    "eos_on_prefill",
    "health_status",
    "slow_health_s",
    "fail_body",
    "fail_retry_after",
    "mid_stream_fault",
    "mid_stream_fault_after_tokens",
    "held_text_token",
    "linger_after_end_s",
)
# What mid_stream_fault does once mid_stream_fault_after_tokens tokens of a stream are out: the engine dies (every
# open stream dropped, every later connection too, until the faults are cleared), the connection is reset, an
# in-band 5xx error event ends the stream (vLLM's way: its HTTP status is 200 by then), or it stalls for good.
MID_STREAM_FAULTS = ("die", "reset", "error", "stall")


@dataclass
class SimConfig:
    role: str = "union"  # union | prefill | decode
    model: str = "sim-model"
    host: str = "127.0.0.1"
    port: int = 0  # 0 = pick a free port
    engine_id: str | None = None  # default: a fresh uuid4
    max_model_len: int = 8192
    # The tokenizer: a prompt's text counts ceil(UTF-8 bytes / bytes_per_token) tokens wherever the engine counts
    # it (usage, the context check, count_tokens, prefill time), its ids are chunks that long and its prefix-cache
    # blocks block_size such tokens. 4 is the Coordinator's uncalibrated estimate; real tokenizers differ by model
    # and text (about 3 bytes a token for code, 4 to 5 for English).
    bytes_per_token: int = 4
    prefill_tokens_per_s: float = 8000.0
    decode_step_ms: float = 10.0
    decode_per_seq_ms: float = 0.5
    kv_capacity_tokens: int = 200_000
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 8192  # prefill token budget per engine step
    # vLLM's --scheduling-policy: "fcfs" (a request with a non-zero `priority` is refused, as vLLM refuses it) or
    # "priority" (the waiting queue is ordered by `priority`, lower first, then arrival)
    scheduling_policy: str = "fcfs"
    block_size: int = 16
    speedup: float = 1.0
    zero_latency: bool = False
    kv_hold_timeout_s: float = 30.0  # NixlConnector's kv_lease_duration (vLLM 0.32; D's heartbeats extend it)
    kv_transfer_tokens_per_s: float = 1_000_000.0  # simulated NIXL pull bandwidth
    prefix_cache_blocks: int = 0  # LRU bound; 0 = kv_capacity_tokens // block_size
    faults: dict[str, Any] = field(default_factory=dict)
    # Extra fields merged into issued tickets: newer vLLM versions add fields a gateway must relay unchanged.
    ticket_extra: dict[str, Any] = field(default_factory=dict)
    # /v1/messages usage with cache_creation/cache_read_input_tokens, as vLLM started with
    # --enable-prompt-tokens-details answers (the OpenAI routes always carry prompt_tokens_details).
    anthropic_cache_usage: bool = False
    # /v1/responses keeps responses (`store`, background mode) as vLLM does with VLLM_ENABLE_RESPONSES_API_STORE=1.
    responses_store: bool = True
    # An engine whose /v1/messages honours `return_token_ids` as chat does (vLLM 0.32's Messages route has no
    # such field and answers none): message_start carries `prompt_token_ids`, each content delta `token_ids`.
    messages_token_ids: bool = False
    # vLLM's --kv-events-config: {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:PORT",
    # "replay_endpoint": "tcp://*:PORT2", "topic": ""}; the prefix cache's stores and evictions are published.
    kv_events: dict[str, Any] = field(default_factory=dict)
    log_level: str = "WARNING"

    def __post_init__(self):
        if self.role not in ("union", "prefill", "decode"):
            raise ValueError("role must be union, prefill or decode")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError("scheduling_policy must be fcfs or priority")
        if not self.engine_id:
            self.engine_id = str(uuid.uuid4())
        if self.speedup <= 0:
            raise ValueError("speedup must be > 0")
        if self.bytes_per_token < 1:
            raise ValueError("bytes_per_token must be >= 1")
        unknown = set(self.faults) - set(FAULT_KNOBS)
        if unknown:
            raise ValueError(f"unknown fault knobs: {sorted(unknown)}")
        if self.faults.get("mid_stream_fault") not in (None, *MID_STREAM_FAULTS):
            raise ValueError(f"mid_stream_fault must be one of {', '.join(MID_STREAM_FAULTS)}")
