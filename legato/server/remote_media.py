"""Remote reference audio: `http(s)://` URLs, fetched only from public addresses.

A server that fetches URLs its clients choose can be aimed at hosts only the server reaches (SSRF): the cloud
metadata service, admin ports on loopback, the private network behind it. So each hop's host is resolved
once, every address it resolves to must be public (or inside a network the operator allowed), and the
connection goes to that very address with the name kept in the Host header and TLS SNI: no second lookup
that a DNS-rebinding answer could change. Redirects are followed by hand, each hop checked again, and the
time limit covers every hop together.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Sequence
from typing import TYPE_CHECKING

import httpx

from legato.server.media import IPNetwork, MediaError

if TYPE_CHECKING:
    from legato.server.media import MediaPolicy

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

MAX_REDIRECTS = 5
_REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
_ALLOW_FLAG = "--remote-media-allow-cidr"

# Never fetched, not even inside an allowed network: an operator allowing 100.64.0.0/10 for an internal
# service does not mean to hand out the cloud's instance credentials.
_METADATA = tuple(ipaddress.ip_network(n) for n in ("169.254.169.254/32", "fd00:ec2::254/128", "100.100.100.200/32"))

# First match names the reason; whatever is left that is not globally routable is refused as reserved.
_FORBIDDEN = tuple((ipaddress.ip_network(n), why) for n, why in (
    ("0.0.0.0/8", "an unspecified"), ("::/128", "an unspecified"),
    ("127.0.0.0/8", "a loopback"), ("::1/128", "a loopback"),
    ("10.0.0.0/8", "a private"), ("172.16.0.0/12", "a private"), ("192.168.0.0/16", "a private"),
    ("fc00::/7", "a private (unique local)"),
    ("169.254.0.0/16", "a link-local"), ("fe80::/10", "a link-local"),
    ("100.64.0.0/10", "a carrier-grade NAT"),
    ("224.0.0.0/4", "a multicast"), ("ff00::/8", "a multicast"),
    ("240.0.0.0/4", "a reserved"), ("192.0.0.0/24", "a reserved"), ("fec0::/10", "a reserved (site-local)"),
    ("::/96", "a reserved (IPv4-compatible)"),
))

# IPv6 prefixes whose low bits carry an IPv4 address the packets end up at: judged by that address.
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_SIXTOFOUR = ipaddress.ip_network("2002::/16")


def forbidden_reason(addr: IPAddress, allowed: Sequence[IPNetwork] = ()) -> str | None:
    """Why the server must not connect to `addr` (e.g. "a loopback address"), or None when it may."""
    embedded = _embedded_ipv4(addr)
    if embedded is not None:
        why = forbidden_reason(embedded, allowed)
        return f"{why} in IPv6 form" if why else None
    if any(addr in net for net in _METADATA):
        return "a cloud metadata address"
    if any(addr.version == net.version and addr in net for net in allowed):
        return None
    for net, why in _FORBIDDEN:
        if addr.version == net.version and addr in net:
            return f"{why} address"
    if not addr.is_global:
        return "a reserved (not globally routable) address"
    return None


def _embedded_ipv4(addr: IPAddress) -> ipaddress.IPv4Address | None:
    if addr.version != 6:
        return None
    if addr.ipv4_mapped is not None:
        return addr.ipv4_mapped
    if addr.sixtofour is not None:
        return addr.sixtofour
    if addr in _NAT64:
        return ipaddress.IPv4Address(int(addr) & 0xFFFFFFFF)
    return None


async def fetch_remote(url: str, policy: MediaPolicy) -> bytes:
    """Downloads `url` under the policy (public addresses, byte cap, one time limit for all hops)."""
    if not policy.allow_remote:
        raise MediaError(403, "remote ref_audio URLs are disabled on this server (--allow-remote-media)")
    try:
        return await asyncio.wait_for(_follow(url, policy), timeout=policy.timeout_s)
    except asyncio.TimeoutError as e:
        raise MediaError(400, f"fetching ref_audio timed out after {policy.timeout_s:g} s") from e


async def _follow(url: str, policy: MediaPolicy) -> bytes:
    # trust_env off: a proxy from the environment would make its own connection, not to the checked address
    async with httpx.AsyncClient(timeout=policy.timeout_s, follow_redirects=False, trust_env=False) as http:
        target = _parse(url)
        for _ in range(MAX_REDIRECTS + 1):
            addr = await _checked_address(target, policy)
            result = await _get(http, target, addr, policy)
            if isinstance(result, bytes):
                return result
            target = _parse(result, base=target)
    raise MediaError(400, f"ref_audio URL redirected more than {MAX_REDIRECTS} times")


def _parse(url: str, base: httpx.URL | None = None) -> httpx.URL:
    try:
        parsed = base.join(url) if base is not None else httpx.URL(url)  # a relative Location: from this hop
    except (httpx.InvalidURL, ValueError, TypeError) as e:
        raise MediaError(400, "ref_audio URL is malformed") from e
    if parsed.scheme not in ("http", "https"):
        raise MediaError(400, f"ref_audio URL (or a redirect) has scheme {parsed.scheme!r}; only http(s) is fetched")
    if not parsed.host:
        raise MediaError(400, "ref_audio URL has no host")
    if parsed.userinfo:
        raise MediaError(400, "ref_audio URL must not carry a user name or password")
    return parsed


async def _checked_address(url: httpx.URL, policy: MediaPolicy) -> IPAddress:
    """Resolves the URL's host once and returns the address to connect to; every address must pass."""
    host = url.raw_host.decode("ascii")
    addrs = await _resolve(host, url.port or (443 if url.scheme == "https" else 80))
    for addr in addrs:
        why = forbidden_reason(addr, policy.allow_remote_networks)
        if why:
            named = f"{host!r} resolves to {addr}" if str(addr) != host else host
            raise MediaError(403, f"ref_audio URL host {named}, {why}: the server only fetches from public "
                                  f"addresses (an operator can allow a network with {_ALLOW_FLAG})")
    return addrs[0]


async def _resolve(host: str, port: int) -> list[IPAddress]:
    try:
        infos = await asyncio.to_thread(socket.getaddrinfo, host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as e:  # socket.gaierror is an OSError
        raise MediaError(400, f"cannot resolve the ref_audio URL host {host!r}") from e
    addrs: list[IPAddress] = []
    for family, *_, sockaddr in infos:
        if family not in (socket.AF_INET, socket.AF_INET6):
            continue
        addr = ipaddress.ip_address(str(sockaddr[0]).split("%")[0])  # drop an IPv6 zone ("fe80::1%eth0")
        if addr not in addrs:
            addrs.append(addr)
    if not addrs:
        raise MediaError(400, f"the ref_audio URL host {host!r} has no IP address")
    return addrs


async def _get(http: httpx.AsyncClient, url: httpx.URL, addr: IPAddress, policy: MediaPolicy) -> bytes | str:
    """One hop, connected to `addr`: the body, or the Location (a str) of a redirect."""
    name = url.raw_host.decode("ascii")
    host_header = f"[{name}]" if ":" in name else name
    if url.port is not None:
        host_header += f":{url.port}"
    pinned = url.copy_with(host=str(addr))
    extensions = {"sni_hostname": name} if url.scheme == "https" else {}  # certificates are checked for the name
    try:
        async with http.stream("GET", pinned, headers={"Host": host_header}, extensions=extensions) as resp:
            if resp.status_code in _REDIRECT_STATUSES:
                location = resp.headers.get("location")
                if not location:
                    raise MediaError(400, f"fetching ref_audio failed: HTTP {resp.status_code} without a Location")
                return location
            if resp.status_code >= 300:
                raise MediaError(400, f"fetching ref_audio failed: HTTP {resp.status_code}")
            return await _read_capped(resp, policy.max_bytes)
    except httpx.TimeoutException as e:
        raise MediaError(400, f"fetching ref_audio timed out after {policy.timeout_s:g} s") from e
    except (httpx.HTTPError, httpx.InvalidURL) as e:
        raise MediaError(400, f"fetching ref_audio failed: {type(e).__name__}: {e}") from e


async def _read_capped(resp: httpx.Response, max_bytes: int) -> bytes:
    declared = resp.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > max_bytes:
        raise MediaError(413, f"remote ref_audio is {declared} bytes; the limit is {max_bytes}")
    buf = bytearray()
    async for chunk in resp.aiter_bytes():
        buf += chunk
        if len(buf) > max_bytes:
            raise MediaError(413, f"remote ref_audio is over the limit of {max_bytes} bytes")
    return bytes(buf)
