"""A replica's base URL, spelled one way: what `kvscale serve` advertises in its heartbeats and
what a router builds from a discovered address, so the two compare equal as strings.

IPv6 literals are bracketed (`http://[fd00::5]:8000`) and written in their compressed form, host
names in lower case; the scheme defaults to http, and a trailing `/` or `/v1` is dropped.
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit


def url_host(host: str) -> str:
    """``host`` as it stands in a URL's authority: an IP address canonical, IPv6 in brackets."""
    bare = host.strip().removeprefix("[").removesuffix("]")
    try:
        address = ipaddress.ip_address(bare)
    except ValueError:
        return bare.lower()
    return f"[{address.compressed}]" if address.version == 6 else address.compressed


def base_url(host: str, port: int) -> str:
    return f"http://{url_host(host)}:{port}"


def normalize_base_url(url: str) -> str:
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = f"http://{url}"
    url = url.removesuffix("/v1")
    parts = urlsplit(url)
    if parts.hostname is None:
        return url
    netloc = url_host(parts.hostname) + (f":{parts.port}" if parts.port is not None else "")
    return parts._replace(netloc=netloc).geturl()


def authority(url: str) -> str:
    """``host:port`` of a base URL, the replica id `kvscale serve` takes when given none."""
    return urlsplit(normalize_base_url(url)).netloc
