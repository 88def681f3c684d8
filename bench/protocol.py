"""What checking a request body costs: µs per `job_from_body` (serving/job.py) on a parsed body.

    python bench/protocol.py [--base e1e323c] [--rounds 7] [--number 2000]

Bodies: a tiny chat completion, a 32 KiB one (a long conversation), a completion, and an Anthropic
Messages body with tools, a named tool choice and a thinking budget. Each is checked `--number` times
per round, timed in the process's CPU time; the best round of `--rounds` is shown (the least disturbed
by the rest of the machine). With `--base`, the same bodies go through that commit's serving/job.py too (loaded from git), so the
two columns are one run side by side. The JSON parse (ujson, unchanged) is shown apart for scale.

A Coordinator's chat request costs about 140 µs of CPU end to end (bench/overhead.py), so 5 % is
about 7 µs: the budget a body check may take on the hot path.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
import time
import timeit
from functools import partial
from pathlib import Path

import ujson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from serving import job as current  # noqa: E402
from serving.families import CHAT, COMPLETIONS, MESSAGES  # noqa: E402

TOOLS = [
    {
        "name": f"tool_{i}",
        "description": "Look something up and answer with what was found, in a few words.",
        "input_schema": {
            "type": "object",
            "properties": {"query": {"type": "string"}, "limit": {"type": "integer", "minimum": 1}},
            "required": ["query"],
        },
    }
    for i in range(8)
]


def _conversation(total_bytes: int) -> list[dict]:
    turn = "word " * 150  # ~750 bytes a turn
    out = [{"role": "system", "content": "You are a careful assistant."}]
    while len(ujson.dumps(out)) < total_bytes:
        out.append({"role": "user" if len(out) % 2 else "assistant", "content": turn})
    return out


BODIES = {
    "chat, tiny": (
        CHAT,
        {"model": "m", "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 16, "stream": True},
    ),
    "chat, 32 KiB": (
        CHAT,
        {
            "model": "m",
            "messages": _conversation(32 * 1024),
            "max_tokens": 256,
            "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": 0.7,
        },
    ),
    "completions": (COMPLETIONS, {"model": "m", "prompt": "Once upon a time", "max_tokens": 16}),
    "messages + tools": (
        MESSAGES,
        {
            "model": "m",
            "max_tokens": 4096,
            "system": "You are a careful assistant.",
            "messages": [
                {"role": "user", "content": "Find the weather in Paris."},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "tool_0", "input": {}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny"}]},
            ],
            "tools": TOOLS,
            "tool_choice": {"type": "tool", "name": "tool_3"},
            "thinking": {"type": "enabled", "budget_tokens": 2048},
            "stream": True,
        },
    ),
}


def load_base(commit: str):
    """serving/job.py as it was at `commit`, importable beside today's (it imports only errors/ and ujson)."""
    source = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{commit}:serving/job.py"], capture_output=True, text=True, check=True
    ).stdout
    path = Path(tempfile.mkdtemp()) / "base_job.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("base_job", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["base_job"] = module  # (its dataclass looks its module up)
    spec.loader.exec_module(module)
    return module


def per_call_us(fn, rounds: int, number: int) -> float:
    # The process's CPU time, not the wall clock: on a shared machine, time spent preempted is not the check's.
    return min(timeit.repeat(fn, number=number, repeat=rounds, timer=time.process_time)) / number * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="e1e323c", help="commit to compare with ('' for none)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--number", type=int, default=2000)
    args = ap.parse_args()
    base = load_base(args.base) if args.base else None
    head = f"{'body':<18} {'bytes':>7} {'parse µs':>9} {'check µs':>9}"
    print(head + (f" {'base µs':>8} {'delta µs':>9}" if base else ""))
    for name, (family, body) in BODIES.items():
        raw = ujson.dumps(body).encode()
        parse = per_call_us(partial(ujson.loads, raw), args.rounds, args.number)
        now = per_call_us(partial(current.job_from_body, family, raw, body, "rid"), args.rounds, args.number)
        line = f"{name:<18} {len(raw):>7} {parse:>9.2f} {now:>9.2f}"
        if base is not None:
            then = per_call_us(
                partial(base.job_from_body, family.route, family.api, raw, body, "rid"), args.rounds, args.number
            )
            line += f" {then:>8.2f} {now - then:>+9.2f}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
