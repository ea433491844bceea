"""The client's IP behind trusted proxies, from ``X-Forwarded-For`` or RFC 7239 ``Forwarded``.

Framework-neutral: the integrations pass the socket peer and the header's values, and get the
identifier text back (``ClientIPResolver.resolve``).
"""

from __future__ import annotations

import functools
import ipaddress
from collections.abc import Iterable, Sequence
from typing import Literal, TypeAlias

from aiolimit._errors import ConfigurationError
from aiolimit._validation import check_int
from aiolimit._web.keys import key_value

IPAddress: TypeAlias = "ipaddress.IPv4Address | ipaddress.IPv6Address"
Network: TypeAlias = "ipaddress.IPv4Network | ipaddress.IPv6Network"
ForwardedHeader = Literal["x-forwarded-for", "forwarded"]

MAX_FORWARDED_CHARS = 8192
MAX_HOPS = 64
#: IPv6 clients are keyed per /64: one subscriber usually holds a whole /64 and can rotate
#: through its addresses at will, so a per-address limit would not limit them at all.
DEFAULT_IPV6_PREFIX = 64
#: Peers whose identifier is kept (cleared when full).
PEER_CACHE_SIZE = 4096
#: In ``trusted_proxies``: the peer of a Unix socket (the server gives it no IP address), a
#: proxy in front of an app served on one (nginx ``proxy_pass http://unix:...``).
UNIX = "unix"


@functools.lru_cache(maxsize=4096)  # the same few peers and proxies ask again and again
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
    other would come from the client untouched.

    ``"unix"`` among ``trusted_proxies`` trusts a peer that has no IP address (an app served
    on a Unix socket, which only processes on its host can reach: the proxy), and its chain
    is read the same way. Without it such peers are one client (see ``resolve``).

    IPv6 clients are keyed per network of ``ipv6_prefix`` bits, /64 by default
    (``"2001:db8:1:2::/64"``): one subscriber usually holds a whole /64 and picks addresses
    from it freely. ``ipv6_prefix=128`` keys each IPv6 address alone. IPv4 clients are keyed
    per address, and an IPv4-mapped IPv6 address (``::ffff:192.0.2.1``) is that IPv4 address.
    """

    def __init__(
        self,
        trusted_proxies: Iterable[str] = (),
        *,
        header: ForwardedHeader = "x-forwarded-for",
        ipv6_prefix: int = DEFAULT_IPV6_PREFIX,
    ) -> None:
        if isinstance(trusted_proxies, str):
            trusted_proxies = (trusted_proxies,)
        items = list(trusted_proxies)
        #: A peer without an IP address (a Unix socket) is a trusted proxy.
        self.trusts_unix = any(isinstance(item, str) and item == UNIX for item in items)
        try:
            self.trusted: tuple[Network, ...] = tuple(
                ipaddress.ip_network(item, strict=False)
                for item in items
                if not (isinstance(item, str) and item == UNIX)
            )
        except (TypeError, ValueError) as exc:
            raise ConfigurationError(
                "trusted_proxies must be IP addresses or networks like '10.0.0.0/8', or "
                f"'unix' for a proxy in front of a Unix socket: {exc}"
            ) from exc
        #: Whether the forwarded header is read at all (some proxy is trusted).
        self.reads_forwarded = bool(self.trusted) or self.trusts_unix
        if header not in ("x-forwarded-for", "forwarded"):
            raise ConfigurationError(
                f"forwarded_header must be 'x-forwarded-for' or 'forwarded', got {header!r}"
            )
        if ipv6_prefix is None:
            raise ConfigurationError(
                "ipv6_prefix must be an int in 1..128 (64 by default; 128 keys each IPv6 "
                "address alone), got None"
            )
        check_int("ipv6_prefix (64 by default; 128 keys each IPv6 address alone)",
                  ipv6_prefix, 1, 128)  # fmt: skip
        self.header = header
        self.ipv6_prefix = ipv6_prefix
        self._by_peer: dict[str | None, str] = {}

    def is_trusted(self, address: IPAddress) -> bool:
        return any(address in network for network in self.trusted)

    def resolve(self, peer: str | None, forwarded: Sequence[str]) -> str | None:
        """The client's IP as text, from the peer address and the header's values (in order).

        A peer that is not an IP address (a Unix socket, a server's odd ``client`` value) is
        used as it is, and no peer at all is ``"unknown"``: such requests share one identifier
        rather than escaping the limits, unless ``"unix"`` is trusted and the chain names the
        client.
        """
        if not forwarded or not self.reads_forwarded:
            # The common case, the peer alone: its identifier is kept (bounded), since
            # parsing and formatting an address costs more than the rest of the lookup.
            known = self._by_peer.get(peer)
            if known is None:
                known = self._resolve(peer, ())
                if len(self._by_peer) >= PEER_CACHE_SIZE:
                    self._by_peer.clear()
                self._by_peer[peer] = known
            return known
        return self._resolve(peer, forwarded)

    def _resolve(self, peer: str | None, forwarded: Sequence[str]) -> str:
        client = parse_ip(peer) if peer else None
        if client is None:
            found = self._walk(forwarded) if self.trusts_unix and forwarded else None
            if found is None:
                return key_value(peer) or "unknown"
            return self.format(found)
        if self.trusted and forwarded and self.is_trusted(client):
            client = self._walk(forwarded) or client
        return self.format(client)

    def _walk(self, forwarded: Sequence[str]) -> IPAddress | None:
        """The client the chain names behind a trusted peer: the rightmost hop that is not
        a trusted proxy (or the last good one); None when the last hop is malformed."""
        client = None
        for hop in self._hops_right_to_left(forwarded):
            address = parse_ip(hop) if hop is not None else None
            if address is None:
                break
            client = address
            if not self.is_trusted(address):
                break
        return client

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
        """The identifier text: an IPv4 address, or the IPv6 network of ``ipv6_prefix`` bits."""
        if isinstance(address, ipaddress.IPv6Address) and self.ipv6_prefix < 128:
            network = ipaddress.IPv6Network((address, self.ipv6_prefix), strict=False)
            return str(network)
        return str(address)
