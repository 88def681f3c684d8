"""A strict logfmt reader, for tests that check what a log reader finds in a line.

Go's go-logfmt grammar, strictly: `key=value` pairs apart by spaces; a key and a bare value are characters above
the space but `=` and `"`; a quoted value takes JSON's escapes and ends at its closing quote, which a space or the
line's end follows. A line holding a control character, a pair without `=`, or anything else is refused.
"""

from __future__ import annotations

import json
import re

_PAIR = re.compile(r'([^\x00-\x20="\x7f]+)=("(?:[^"\\\x00-\x1f]|\\.)*"|[^\x00-\x20="\x7f]*)(?: |$)')


class LogfmtError(ValueError):
    pass


def parse(line: str) -> list[tuple[str, str]]:
    """The (key, value) pairs of `line`, in order, duplicates kept; LogfmtError when it is not strict logfmt."""
    pairs, at = [], 0
    while at < len(line):
        m = _PAIR.match(line, at)
        if m is None:
            raise LogfmtError(f"not logfmt at {at}: {line[at : at + 40]!r}")
        key, value = m.groups()
        if value.startswith('"'):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise LogfmtError(f"bad escape in {value!r}: {e}") from None
        pairs.append((key, value))
        at = m.end()
    if line.endswith(" "):
        raise LogfmtError("a trailing space")
    return pairs


def fields(line: str) -> dict[str, str]:
    """`parse(line)` as a dict; LogfmtError when a key appears twice (a reader would keep one of them)."""
    pairs = parse(line)
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise LogfmtError(f"a key appears twice: {keys}")
    return dict(pairs)
