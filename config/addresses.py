"""Engine addresses: how one is written in a config file, and the engine (socket) it names.

An address is `host:port`, `http://host:port` or `https://host:port`; it is read exactly as engines/ reads
it (urlsplit of `engine_url`), so an address the config accepts is one the engine client can call.
"""

from __future__ import annotations

import ipaddress
import re
from functools import lru_cache
from urllib.parse import urlsplit

ENGINE_SCHEMES = ("http", "https")
# The network location of an engine address: a name or IPv4 address, or an IPv6 address in brackets (unbracketed,
# its colons cannot be told from the port's), then the port.
_ENGINE_NETLOC = re.compile(r"(?:\[(?P<ipv6>[0-9A-Fa-f:.]+)\]|[A-Za-z0-9_.-]+):(?P<port>[0-9]{1,5})")
ADDRESS_FORMS = "host:port, http://host:port or https://host:port (an IPv6 host in brackets: [::1]:8000)"


def engine_url(address: str) -> str:
    """The URL engines/ sends to for an engine address: a bare "host:port" is http."""
    return address if "://" in address else f"http://{address}"


@lru_cache(maxsize=4096)
def split_address(address: str) -> tuple[str, int]:
    """(host, port) of an engine address, read as engines/ reads it (urlsplit of `engine_url`), or ValueError
    saying why it cannot be one. The host comes lowercased and without brackets."""
    if not address.isprintable() or " " in address:  # urlsplit drops tabs and newlines, engines/ would too
        raise ValueError(f"must be {ADDRESS_FORMS}, without spaces")
    url = engine_url(address)
    try:
        parts = urlsplit(url)
    except ValueError:  # a bracketed host that is not an IPv6 address
        parts = None
    if parts is not None and parts.scheme not in ENGINE_SCHEMES:
        raise ValueError("the scheme must be http or https")
    netloc = _ENGINE_NETLOC.fullmatch(parts.netloc) if parts is not None else None
    if netloc is None or url.partition("://")[2] != parts.netloc:  # a path, query or fragment, even an empty one
        raise ValueError(f"must be {ADDRESS_FORMS}")
    if netloc["ipv6"] is not None:
        try:
            ipaddress.IPv6Address(netloc["ipv6"])
        except ValueError:
            raise ValueError(f"must be {ADDRESS_FORMS}") from None
    port = int(netloc["port"])
    if not 1 <= port <= 65535:
        raise ValueError("the port must be 1..65535")
    return parts.hostname or "", port


def address_key(address: str) -> str:
    """The engine a valid address names, as "host:port": `HOST:80`, `http://host:80` and `https://host:80` are one
    engine (one socket), and so are two spellings of one IPv6 address (`[::1]` and `[0::1]`)."""
    host, port = split_address(address)
    if ":" in host:
        host = f"[{ipaddress.IPv6Address(host).compressed}]"
    return f"{host}:{port}"
