"""`python -m deployer render [--config FILE] [--out DIR]`."""

from __future__ import annotations

import argparse
import codecs
import json
import sys
from pathlib import Path
from typing import Any

from .render import DEFAULT_CONFIG, DEFAULT_OUT, write
from .sections import ConfigError
from .settings import load

# Far deeper than any real config; much deeper would exhaust the recursion of json, copy.deepcopy or the render.
MAX_NESTING = 100


def _nested_deeper_than(value: Any, limit: int) -> bool:
    """Whether lists and objects nest more than `limit` levels in `value`, walked level by level (not recursively)."""
    level = [value]
    for _ in range(limit):
        level = [v for c in level if isinstance(c, (dict, list)) for v in (c.values() if isinstance(c, dict) else c)]
    return any(isinstance(c, (dict, list)) for c in level)


def _cmd_render(args: argparse.Namespace) -> int:
    path = Path(args.config)
    bom = 0
    too_deep = f"error: {path}: lists and objects nested more than {MAX_NESTING} levels deep"
    try:
        data = path.read_bytes()
        bom = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0  # Windows editors write one
        raw = json.loads(data[bom:].decode("utf-8"))
    except OSError as exc:
        print(f"error: cannot read {path}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    except UnicodeDecodeError as exc:
        print(f"error: {path}: not UTF-8 text (byte {bom + exc.start})", file=sys.stderr)
        return 2
    except json.JSONDecodeError as exc:
        print(f"error: {path}: not valid JSON: {exc}", file=sys.stderr)
        return 2
    except RecursionError:  # json's decoder recurses once per level
        print(too_deep, file=sys.stderr)
        return 2
    if _nested_deeper_than(raw, MAX_NESTING):
        print(too_deep, file=sys.stderr)
        return 2
    try:
        settings = load(raw)
    except ConfigError as exc:
        print(f"error: {path}: invalid configuration", file=sys.stderr)
        for line in exc.errors:
            print(f"  {line}", file=sys.stderr)
        return 1
    try:
        written = write(settings, Path(args.out))
    except OSError as exc:
        print(f"error: cannot write {exc.filename or args.out}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    for path in written:
        print(f"wrote {path}")
    d = settings.deploy
    print(
        f"namespace {settings.namespace}: {d.p_instances_num} prefill + {d.d_instances_num} decode "
        f"engines, Coordinator on nodePort {d.coordinator_node_port}"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m deployer", description="Render the Coordinator's Kubernetes deployment."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    render = sub.add_parser("render", help="render the manifests and the cluster user_config.json")
    render.add_argument("--config", default=str(DEFAULT_CONFIG), help="input user_config.json (default: %(default)s)")
    render.add_argument("--out", default=str(DEFAULT_OUT), help="output directory (default: %(default)s)")
    render.set_defaults(func=_cmd_render)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
