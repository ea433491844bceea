"""Addresses and networks of the ``ip`` kind in a rules document are read as the web layer
names clients (``ClientIPResolver``): lowercase compressed IPv6, IPv6 clients per /64 by
default, IPv4-mapped IPv6 as IPv4. An entry written any other way would validate and then
never match a client."""

from __future__ import annotations

import pytest

from aiolimit import Limiter, RulesError, RuleSet
from aiolimit._follow import split
from aiolimit._web.client_ip import ClientIPResolver
from tests.test_web_starlette import serve, starlette_app

KINDS = {"ip": "100/minute"}


def client(peer: str, **options: int) -> str:
    """The identifier the web integrations give a request from ``peer``."""
    resolved = ClientIPResolver(**options).resolve(peer, ())
    assert resolved is not None
    return f"ip:{resolved}"


@pytest.mark.parametrize(
    ("entry", "peer"),
    [
        ("ip:2001:DB8:1:2::/64", "2001:db8:1:2::7"),  # uppercase
        ("ip:2001:0db8:0001:0002::/64", "2001:db8:1:2::7"),  # leading zeros
        ("ip:2001:db8:1:2::9/64", "2001:db8:1:2::7"),  # host bits: that address's /64
        ("ip:::ffff:203.0.113.7", "203.0.113.7"),  # IPv4-mapped: the IPv4 address
        ("ip:::ffff:203.0.113.7", "::ffff:203.0.113.7"),
        ("ip:::FFFF:203.0.113.0/120", "203.0.113.9"),  # a mapped network: the IPv4 one
    ],
)
def test_ip_entries_match_the_clients_the_web_layer_names(entry: str, peer: str) -> None:
    for placed in ({"deny": [entry]}, {"overrides": {entry: {"exempt": True}}}):
        rules = RuleSet.from_mapping({"kinds": KINDS, **placed})
        found = rules.override_for(client(peer))
        assert found is not None and (found.deny or found.exempt), (placed, client(peer))


def test_an_ipv6_address_is_kept_for_clients_keyed_per_address() -> None:
    rules = RuleSet.from_mapping({"kinds": KINDS, "deny": ["ip:2001:DB8:0::0001"]})
    identifier = client("2001:db8::1", ipv6_prefix=128)
    assert identifier == "ip:2001:db8::1"
    assert rules.override_for(identifier) is not None


def test_the_canonical_document_and_the_stored_overrides_use_that_form() -> None:
    rules = RuleSet.from_mapping(
        {
            "kinds": KINDS,
            "overrides": {
                "ip:2001:DB8:1:2::/64": {"limits": "1/hour"},
                "ip:10.1.2.3/8": {"scale": 2},
            },
            "allow": ["ip:::ffff:127.0.0.1", "ip:127.0.0.1"],
            "deny": ["ip:2001:0DB8::/32"],
        }
    )
    assert rules.version == RuleSet.from_text(rules.document, "json").version
    document, exact = split(rules)
    assert set(exact) == {"ip:2001:db8:1:2::/64"}  # what a follower looks identifiers up by
    assert '"ip:10.0.0.0/8"' in document and '"ip:2001:db8::/32"' in document
    assert '"allow":["ip:127.0.0.1"]' in document
    # Other kinds are not the web layer's: their identifiers are kept as written.
    other = RuleSet.from_mapping({"kinds": KINDS, "deny": ["peer:2001:DB8::1"]})
    assert other.override_for("peer:2001:DB8::1") is not None


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ("ip:2001:db8:1:2::/64", "ip:2001:DB8:1:2::/64"),
        ("ip:203.0.113.7", "ip:::ffff:203.0.113.7"),
        ("ip:10.0.0.0/8", "ip:10.1.2.3/8"),
    ],
)
def test_two_overrides_of_one_client_are_refused(first: str, second: str) -> None:
    with pytest.raises(RulesError) as caught:
        RuleSet.from_mapping(
            {"kinds": KINDS, "overrides": {first: {"scale": 2}, second: {"limits": "1/hour"}}}
        )
    assert caught.value.where == f"overrides.{second!r}".replace("'", '"')
    assert first in str(caught.value)


async def test_a_followed_override_written_in_another_form_reaches_its_client(
    redis_url: str, prefix: str
) -> None:
    rules = RuleSet.from_mapping(
        {"kinds": KINDS, "overrides": {"ip:2001:DB8:1:2::/64": {"limits": "1/hour"}}}
    )
    async with Limiter(redis_url, {"ip": "100/minute"}, prefix=prefix, follow_rules=True) as fleet:
        assert await fleet.push_rules(rules)
        identifier = client("2001:db8:1:2::abcd")
        assert [(await fleet.try_acquire(identifier)).allowed for _ in range(2)] == [True, False]


async def test_a_denied_ipv6_client_gets_403_through_the_web_layer(
    redis_url: str, prefix: str
) -> None:
    rules = RuleSet.from_mapping({"kinds": KINDS, "deny": ["ip:2001:0DB8:0001:0002::/64"]})
    async with Limiter(redis_url, rules, prefix=prefix) as limiter:
        app = starlette_app(limiter, trusted_proxies=["127.0.0.0/8"])
        async with serve(app) as http:
            denied = await http.get("/", headers={"x-forwarded-for": "2001:db8:1:2::7"})
            other = await http.get("/", headers={"x-forwarded-for": "2001:db8:1:3::7"})
        assert (denied.status_code, other.status_code) == (403, 200)
