"""Long prompts: what a prompt's size costs the Coordinator, next to vllm-router, in one run.

    python bench/prompts.py                     # sizes 0,32,256,1024 KiB; chat, PD chat, PD chat streamed,
                                                #   Messages, PD Messages streamed
    python bench/prompts.py --sizes 0,256 --duration 4 --tree-also /tmp/base

Each size is one bench/overhead.py run (1 worker on 1 core, log INFO, the same fake engines) with every
cell's user message padded to that size (`--prompt-kib`). The table gives CPU µs per request, and µs per KiB
of prompt: (µs at the size - µs at size 0) / KiB, for the Coordinator and vllm-router (when installed:
`pip install vllm-router==0.1.17`), and their ratio; the latency a request adds over direct access at
concurrency 1 (p50); and the worker's peak RSS, which at 1024 KiB includes 32 requests of 1 MiB in flight
(`--connections 32`). Arguments it does not know go to bench/overhead.py.

The Messages cells (`messages`, `pd_messages_stream`: an agent's /v1/messages request with a system prompt
and tools, the padding a quarter in the system prompt and three quarters in the user message) run on the
Coordinator only: vllm-router 0.1.17 has no /v1/messages. Their ratio column compares with vllm-router's
chat cell of the same kind (`messages` with `chat`, `pd_messages_stream` with `pd_chat_stream`) and says so
("1.40x (router chat)"): the same prompt bytes through the router's only route. overhead.py's
`chat_stream` cell, which this table never showed, is not run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from bench import overhead  # noqa: E402

CELLS = ("chat", "pd_chat", "pd_chat_stream", "messages", "pd_messages_stream")
# vllm-router's cell a Messages cell's ratio is taken against (it has no /v1/messages).
ROUTER_CELL = {"messages": "chat", "pd_messages_stream": "pd_chat_stream"}


def run(sizes: list[int], passthrough: list[str]) -> dict[int, dict[tuple[str, str], dict]]:
    """{size: {(gateway label, cell): the cell's results}}"""
    out = {}
    for kib in sizes:
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            argv = ["--prompt-kib", str(kib), "--json", f.name, "--workers", "1", "--no-warning", "--no-floor"]
            argv += ["--cells", ",".join(CELLS)]
            if overhead.main([*argv, *passthrough]) != 0:
                raise SystemExit(f"bench/overhead.py failed at {kib} KiB")
            cells = json.load(f)["cells"]
        out[kib] = {(c["gateway"], c["cell"]): c for c in cells if c.get("cpu_us_per_req")}
    return out


def table(results: dict[int, dict[tuple[str, str], dict]]) -> str:
    sizes = sorted(results)
    gateways = sorted({g for r in results.values() for g, _ in r})
    router = next((g for g in gateways if g.startswith("vllm-router")), None)
    lines = [
        "| gateway | cell | KiB | CPU µs/req | µs per KiB | x vllm-router per KiB | c=1 added p50 ms | peak RSS MB |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]

    def cpu(kib: int, gw: str, cell: str) -> float | None:
        c = results[kib].get((gw, cell))
        return c["cpu_us_per_req"] if c else None

    for gw in gateways:
        for cell in CELLS:
            base = cpu(sizes[0], gw, cell)
            for kib in sizes:
                c = results[kib].get((gw, cell))
                if c is None:
                    continue
                us = c["cpu_us_per_req"]
                per = (us - base) / kib if kib and base is not None else None
                ratio = ""
                ref = ROUTER_CELL.get(cell, cell)
                r0, r = cpu(sizes[0], router, ref), cpu(kib, router, ref)
                if per is not None and router and gw != router and r0 is not None and r is not None and r > r0:
                    ratio = f"{per / ((r - r0) / kib):.2f}x" + (f" (router {ref})" if ref != cell else "")
                added = c.get("added_p50_us")
                rss = max(c.get("rss_mb") or [0])
                lines.append(
                    f"| {gw} | {cell} | {kib} | {us:,.0f} | {'' if per is None else f'{per:.2f}'} | {ratio} "
                    f"| {'' if added is None else f'{added / 1000:.2f}'} | {rss:.0f} |"
                )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="0,32,256,1024", help="prompt sizes in KiB, the first the baseline (0)")
    opts, passthrough = ap.parse_known_args(argv)
    sizes = [int(s) for s in opts.sizes.split(",") if s]
    print(table(run(sizes, passthrough)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
