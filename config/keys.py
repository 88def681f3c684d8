"""API keys as MindIE-PyMotor writes them in `valid_keys`: plain, or hashed as PBKDF2-SHA256 `salt:iterations:hexhash`.

The hash is PBKDF2-HMAC-SHA256 of the key's UTF-8 bytes, with the salt text's own UTF-8 bytes as salt (PyMotor
writes 16 random bytes in hex and uses that hex text), `iterations` rounds, 32 bytes written in lowercase hex
(MindIE-PyMotor's motor/common/utils/key_encryption.py). So a config need not hold its keys in clear:

    python -m config.keys hash            # reads the key from stdin (not the shell's history)
    python -m config.keys hash --iterations 200000 < key.txt
"""

from __future__ import annotations

import argparse
import getpass
import hashlib
import hmac
import re
import secrets
import sys
from typing import NamedTuple

DEFAULT_ITERATIONS = 100_000
# Verifying a hashed key costs its iterations in CPU; a config asking for more than this would make every
# request with a new key hold a thread for seconds.
MAX_ITERATIONS = 10_000_000
_HASHED = re.compile(r"(?P<salt>[^:\s]{1,256}):(?P<iterations>[0-9]{1,9}):(?P<hash>[0-9a-f]{64})")


class HashedKey(NamedTuple):
    salt: bytes
    iterations: int
    digest: bytes

    def matches(self, key: bytes) -> bool:
        """Runs PBKDF2 (CPU for `iterations` rounds; hashlib lets other threads run meanwhile)."""
        return hmac.compare_digest(hashlib.pbkdf2_hmac("sha256", key, self.salt, self.iterations), self.digest)


def hashed_entry(entry: str) -> HashedKey | None:
    """The hashed key an entry of valid_keys writes, or None for a plain key."""
    m = _HASHED.fullmatch(entry)
    if m is None or not 1 <= int(m["iterations"]) <= MAX_ITERATIONS:
        return None
    return HashedKey(m["salt"].encode(), int(m["iterations"]), bytes.fromhex(m["hash"]))


def looks_hashed(entry: str) -> str | None:
    """Why an entry that is meant as a hashed key is not one (its iterations out of bounds), or None."""
    m = _HASHED.fullmatch(entry)
    if m is not None and not 1 <= int(m["iterations"]) <= MAX_ITERATIONS:
        return f"a hashed key's iterations must be 1..{MAX_ITERATIONS}"
    return None


def hash_key(key: str, iterations: int = DEFAULT_ITERATIONS, salt: str | None = None) -> str:
    """The `salt:iterations:hexhash` entry of `key`, as MindIE-PyMotor's script writes it."""
    salt = salt or secrets.token_hex(16)
    digest = hashlib.pbkdf2_hmac("sha256", key.encode(), salt.encode(), iterations)
    return f"{salt}:{iterations}:{digest.hex()}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m config.keys", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    h = sub.add_parser("hash", help="print the hashed form of a key read from stdin (or a prompt)")
    h.add_argument("--iterations", type=int, default=DEFAULT_ITERATIONS)
    args = parser.parse_args(argv)
    if not 1 <= args.iterations <= MAX_ITERATIONS:
        parser.error(f"--iterations must be 1..{MAX_ITERATIONS}")
    key = getpass.getpass("API key: ") if sys.stdin.isatty() else sys.stdin.readline().rstrip("\r\n")
    if not key:
        parser.error("no key given")
    print(hash_key(key, args.iterations))
    return 0


if __name__ == "__main__":
    sys.exit(main())
