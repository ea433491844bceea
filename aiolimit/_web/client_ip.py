"""The client's IP behind trusted proxies, from ``X-Forwarded-For`` or RFC 7239 ``Forwarded``.

Framework-neutral: the integrations pass the socket peer and the header's values, and get the
identifier text back (``ClientIPResolver.resolve``).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Sequence
from typing import Literal, TypeAlias

from aiolimit._errors import ConfigurationError
from aiolimit._web.keys import key_value

IPAddress: TypeAlias = "ipaddress.IPv4Address | ipaddress.IPv6Address"
Network: TypeAlias = "ipaddress.IPv4Network | ipaddress.IPv6Network"
ForwardedHeader = Literal["x-forwarded-for", "forwarded"]

MAX_FORWARDED_CHARS = 8192
MAX_HOPS = 64


def parse_ip(text: str) -> IPAddress | None:
    """An address from ``1.2.3.4``, ``1.2.3.4:80``, ``[2001:db8::1]:80``, ``"..."``; else None."""
    text = text.strip().strip('"').strip()
    if not text or len(text) > 64:
        return None
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            return None
        text = text[1:end]
    elif text.count(":") == 1:  # IPv4 with a port
        text = text.split(":", 1)[0]
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def _forwarded_for(element: str) -> str | None:
    """The ``for=`` value of one RFC 7239 ``Forwarded`` element, or None."""
    for pair in element.split(";"):
        name, sep, value = pair.partition("=")
        if sep and name.strip().lower() == "for":
            return value.strip()
    return None


class ClientIPResolver:
    """The client's IP: the socket peer, unless the peer is a trusted proxy.

    Behind trusted proxies the forwarded chain is read right to left and the first hop that is
    not a trusted proxy is the client (the rightmost untrusted hop: hops to its left were
    written by the client and can be anything). A malformed hop stops the walk at the last
    good one, so garbage can never pick the client's identity. Only ``header`` is read
    (``X-Forwarded-For`` or RFC 7239 ``Forwarded``), never both: a proxy sets one, and the
    other would come from the client untouched. IPv6 clients may be grouped by ``/ipv6_prefix``
    (one /64 is usually one subscriber).
    """

    def __init__(
        self,
        trusted_proxies: Iterable[str] = (),
        *,
        header: ForwardedHeader = "x-forwarded-for",
        ipv6_prefix: int | None = None,
    ) -> None:
        if isinstance(trusted_proxies, str):
            trusted_proxies = (trusted_proxies,)
        try:
            self.trusted: tuple[Network, ...] = tuple(
                ipaddress.ip_network(item, strict=False) for item in trusted_proxies
            )
        except (TypeError, ValueError) as exc:
            raise ConfigurationError(
                f"trusted_proxies must be IP addresses or networks like '10.0.0.0/8': {exc}"
            ) from exc
        if header not in ("x-forwarded-for", "forwarded"):
            raise ConfigurationError(
                f"forwarded_header must be 'x-forwarded-for' or 'forwarded', got {header!r}"
            )
        if ipv6_prefix is not None and (
            isinstance(ipv6_prefix, bool)
            or not isinstance(ipv6_prefix, int)
            or not 1 <= ipv6_prefix <= 128
        ):
            raise ConfigurationError(f"ipv6_prefix must be None or 1..128, got {ipv6_prefix!r}")
        self.header = header
        self.ipv6_prefix = ipv6_prefix

    def is_trusted(self, address: IPAddress) -> bool:
        return any(address in network for network in self.trusted)

    def resolve(self, peer: str | None, forwarded: Sequence[str]) -> str | None:
        """The client's IP as text, from the peer address and the header's values (in order).

        A peer that is not an IP address (a Unix socket, a server's odd ``client`` value) is
        used as it is, and no peer at all is ``"unknown"``: such requests share one identifier
        rather than escaping the limits.
        """
        client = parse_ip(peer) if peer else None
        if client is None:
            return key_value(peer) or "unknown"
        if self.trusted and forwarded and self.is_trusted(client):
            for hop in self._hops_right_to_left(forwarded):
                address = parse_ip(hop) if hop is not None else None
                if address is None:
                    break
                client = address
                if not self.is_trusted(address):
                    break
        return self.format(client)

    def _hops_right_to_left(self, values: Sequence[str]) -> Iterable[str | None]:
        text = ",".join(values)
        truncated = len(text) > MAX_FORWARDED_CHARS
        if truncated:
            text = text[-MAX_FORWARDED_CHARS:]
        hops = text.split(",")
        if truncated:
            hops = hops[1:]  # the first piece may be a cut-off address
        for count, hop in enumerate(reversed(hops)):
            if count >= MAX_HOPS:
                return
            yield _forwarded_for(hop) if self.header == "forwarded" else hop

    def format(self, address: IPAddress) -> str:
        if self.ipv6_prefix is not None and isinstance(address, ipaddress.IPv6Address):
            network = ipaddress.IPv6Network((address, self.ipv6_prefix), strict=False)
            return str(network)
        return str(address)
