"""Who may use the router, and where it may send requests (docs/router.md, Security).

- Keys: the admin key (KUBESGL_ROUTER_ADMIN_KEY) opens the endpoints that change the pool; the
  engines' API key (KUBESGL_API_KEY) is the one clients must present and the one the router
  presents to engines, which never see a client's own credentials. Both are compared in
  constant time.
- Worker addresses: a URL that would make the router send prompts and its key to a link-local
  or cloud metadata address is refused, whether it is written as an IP address or resolves to
  one (checked when the admin API adds a worker, and again whenever a connection is opened, so
  a name that changes its answer after the check still cannot lead there).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import re
import socket
from collections.abc import Awaitable, Callable

from aiohttp.abc import AbstractResolver, ResolveResult
from aiohttp.resolver import DefaultResolver

from kubesgl.contract import bearer_key_problem

Headers = list[tuple[bytes, bytes]]
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

# -- keys ------------------------------------------------------------------------------------


def check_key(name: str, key: str) -> str:
    """A key a client can send as `Authorization: Bearer KEY`: printable ASCII, nothing around it.

    A header value loses its surrounding whitespace on the way in and cannot hold a control
    character, so such a key could never match; most often it is a Secret made from a file
    that ends with a newline."""
    if not key:  # a Secret without its value must not turn a check off
        raise ValueError(f"{name} is empty (unset it to run without this key)")
    problem = bearer_key_problem(key)
    if problem is not None:
        raise ValueError(f"{name} {problem}")
    return key


class BearerKey:
    """Checks `Authorization: Bearer KEY` without leaking, through timing, how much of it matched."""

    __slots__ = ("_digest", "header")

    def __init__(self, key: str) -> None:
        # Comparing digests keeps the comparison's time independent of the presented key's length.
        self._digest = hashlib.sha256(key.encode()).digest()
        self.header = (b"authorization", b"Bearer " + key.encode())  # to present to engines

    def admits(self, headers: Headers) -> bool:
        values = [value for name, value in headers if name.lower() == b"authorization"]
        if len(values) != 1:
            return False
        scheme, _, token = values[0].strip().partition(b" ")
        if scheme.lower() != b"bearer":
            return False
        return hmac.compare_digest(hashlib.sha256(token.strip()).digest(), self._digest)


# -- worker addresses ------------------------------------------------------------------------

LINK_LOCAL_NETWORKS = (ipaddress.ip_network("169.254.0.0/16"), ipaddress.ip_network("fe80::/10"))
# AWS, GCP, Azure, OCI, DigitalOcean... (IPv4), and AWS's IPv6 instance metadata service.
METADATA_ADDRESSES = frozenset(
    {ipaddress.ip_address("169.254.169.254"), ipaddress.ip_address("fd00:ec2::254")}
)
# GCP's metadata server names (`metadata` through the search domain).
METADATA_HOST_NAMES = frozenset({"metadata.google.internal", "metadata"})
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_IPV4_COMPATIBLE = ipaddress.ip_network("::/96")
_NUMERIC_HOST = re.compile(r"[0-9a-fA-FxX.]+")


def _embedded_ipv4(address: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 one leads to: mapped (::ffff:a.b.c.d), NAT64, IPv4-compatible."""
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address in _NAT64 or (address in _IPV4_COMPATIBLE and int(address) > 1):
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return None


def address_problem(address: IPAddress) -> str | None:
    """Why the router must never connect to this address, or None."""
    if isinstance(address, ipaddress.IPv6Address):
        address = _embedded_ipv4(address) or address
    if address in METADATA_ADDRESSES:
        return "a cloud metadata address"
    if any(address in network for network in LINK_LOCAL_NETWORKS):
        return "a link-local address"
    return None


def literal_address(host: str) -> IPAddress | None:
    """The address a host written as a number stands for (the forms a resolver takes as one,
    2852039166 and 0xa9fea9fe included), else None: a name."""
    host = host.strip("[]").split("%", 1)[0].rstrip(".")  # brackets, an IPv6 zone, a final dot
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        pass
    if _NUMERIC_HOST.fullmatch(host):
        try:
            return ipaddress.IPv4Address(socket.inet_aton(host))
        except OSError:
            pass
    return None


def host_problem(host: str) -> str | None:
    """Why a worker URL's host is refused without looking it up, or None."""
    if host.lower().rstrip(".") in METADATA_HOST_NAMES:
        return "a cloud metadata host name"
    address = literal_address(host)
    return address_problem(address) if address is not None else None


Resolve = Callable[[str, int], Awaitable[list[str]]]


async def resolve_host(host: str, port: int) -> list[str]:
    """Every address `host` resolves to, as the connection pool would look it up."""
    resolver = DefaultResolver()
    try:
        return [
            result["host"] for result in await resolver.resolve(host, port, family=socket.AF_UNSPEC)
        ]
    finally:
        await resolver.close()


def resolved_problem(host: str, addresses: list[str]) -> str | None:
    """Why a name that resolves to these addresses is refused, or None."""
    for text in addresses:
        address = literal_address(text)
        problem = address_problem(address) if address is not None else None
        if problem is not None:
            return f"{host} resolves to {text}, {problem}"
    return None


class GuardedResolver(AbstractResolver):
    """The worker connection pool's resolver: drops link-local and metadata addresses from
    every answer, so a name checked once cannot lead there later (DNS rebinding), whichever way
    the worker was registered. Hosts written as IP addresses never reach a resolver; they were
    checked when the worker was registered."""

    def __init__(self, inner: AbstractResolver | None = None) -> None:
        self._inner = inner

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        if self._inner is None:
            self._inner = DefaultResolver()
        results = await self._inner.resolve(host, port, family)
        allowed = [r for r in results if _allowed(r)]
        if not allowed:
            refused = ", ".join(sorted({r["host"] for r in results}))
            raise OSError(
                f"{host} resolves only to addresses the router refuses ({refused}): link-local or cloud metadata"
            )
        return allowed

    async def close(self) -> None:
        if self._inner is not None:
            await self._inner.close()


def _allowed(result: ResolveResult) -> bool:
    address = literal_address(str(result["host"]))
    return address is None or address_problem(address) is None
