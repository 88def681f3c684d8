"""CLI: python -m engine_sim --port N --role union|prefill|decode --model NAME ..."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys

from . import SimConfig, serve


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="engine_sim", description="Simulated vLLM 0.32 server")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--role", choices=("union", "prefill", "decode"), default="union")
    p.add_argument("--model", default="sim-model")
    p.add_argument("--engine-id", default=None)
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--bytes-per-token", type=int, default=4, help="the tokenizer: UTF-8 bytes per prompt token")
    p.add_argument("--prefill-tokens-per-s", type=float, default=8000.0)
    p.add_argument("--decode-step-ms", type=float, default=10.0)
    p.add_argument("--decode-per-seq-ms", type=float, default=0.5)
    p.add_argument("--kv-capacity-tokens", type=int, default=200_000)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default="fcfs")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--speedup", type=float, default=1.0)
    p.add_argument("--zero-latency", action="store_true")
    p.add_argument("--kv-hold-timeout-s", type=float, default=30.0)
    p.add_argument("--faults", default=None, help="JSON object of fault knobs")
    p.add_argument("--kv-events-config", default=None, help="vLLM's --kv-events-config (JSON): publish KV events")
    p.add_argument("--log-level", default="WARNING")
    return p.parse_args(argv)


async def _amain(cfg: SimConfig):
    srv = await serve(cfg)
    print(
        f"engine_sim listening on http://{cfg.host}:{srv.port} role={cfg.role} "
        f"model={cfg.model} engine_id={cfg.engine_id}",
        flush=True,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except NotImplementedError:  # pragma: no cover
            pass
    await stop.wait()
    await srv.stop()


def main(argv=None):
    a = parse_args(argv)
    logging.basicConfig(level=getattr(logging, str(a.log_level).upper(), logging.WARNING))
    faults = json.loads(a.faults) if a.faults else {}
    cfg = SimConfig(
        role=a.role,
        model=a.model,
        host=a.host,
        port=a.port,
        engine_id=a.engine_id,
        max_model_len=a.max_model_len,
        bytes_per_token=a.bytes_per_token,
        prefill_tokens_per_s=a.prefill_tokens_per_s,
        decode_step_ms=a.decode_step_ms,
        decode_per_seq_ms=a.decode_per_seq_ms,
        kv_capacity_tokens=a.kv_capacity_tokens,
        max_num_seqs=a.max_num_seqs,
        max_num_batched_tokens=a.max_num_batched_tokens,
        scheduling_policy=a.scheduling_policy,
        block_size=a.block_size,
        speedup=a.speedup,
        zero_latency=a.zero_latency,
        kv_hold_timeout_s=a.kv_hold_timeout_s,
        faults=faults,
        kv_events=json.loads(a.kv_events_config) if a.kv_events_config else {},
        log_level=a.log_level,
    )
    asyncio.run(_amain(cfg))
    return 0


if __name__ == "__main__":
    sys.exit(main())
