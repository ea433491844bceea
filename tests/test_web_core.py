"""Framework-neutral web pieces: client IP behind proxies, key values, headers and bodies.

Decisions here are built by hand, so every header value is exact; the HTTP tests in
test_web_starlette.py and test_web_aiohttp.py check the same values through real servers.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiolimit import (
    Concurrency,
    ConfigurationError,
    Decision,
    FixedWindow,
    Limit,
    MinInterval,
    PairDecision,
    SlidingLog,
    TokenBucket,
)
from aiolimit._web.client_ip import ClientIPResolver
from aiolimit._web.headers import (
    problem_body,
    quota_and_window,
    rate_limit_headers,
    retry_after_seconds,
)
from aiolimit._web.keys import key_value, raw_header_key

TEN_PER_SECOND = Limit(10, per=1)
HUNDRED_PER_MINUTE = Limit(100, per=60)


def pair(
    identifier: str, limit: Limit, allowed: bool, remaining: int, retry: float, reset: float
) -> PairDecision:
    return PairDecision(identifier, limit, allowed, remaining, retry, reset)


def test_untrusted_peer_forwarded_header_is_ignored() -> None:
    """A peer that is not a trusted proxy is the client, whatever X-Forwarded-For says."""
    resolver = ClientIPResolver(["10.0.0.0/8"])
    assert resolver.resolve("198.51.100.9", ["203.0.113.7"]) == "198.51.100.9"


def test_trusted_proxy_rightmost_untrusted_hop_is_the_client() -> None:
    """Behind trusted proxies the rightmost untrusted hop wins; hops left of it are ignored."""
    resolver = ClientIPResolver(["10.0.0.0/8"])
    chain = ["1.1.1.1, 203.0.113.7", "10.0.0.2"]
    assert resolver.resolve("10.0.0.1", chain) == "203.0.113.7"


def test_all_hops_trusted_gives_the_leftmost() -> None:
    """If every hop is a trusted proxy, the leftmost hop is the client."""
    resolver = ClientIPResolver(["10.0.0.0/8"])
    assert resolver.resolve("10.0.0.1", ["10.9.9.9, 10.0.0.3"]) == "10.9.9.9"


@pytest.mark.parametrize(
    "header",
    ["", ",,,", "not-an-ip", "300.1.1.1", "1.2.3.4, garbage", "[::1", "\x00\xff", "unknown"],
)
def test_malformed_forwarded_falls_back_to_the_last_good_hop(header: str) -> None:
    """A malformed hop stops the walk: the client is the last good (trusted) hop, never junk."""
    resolver = ClientIPResolver(["10.0.0.0/8"])
    assert resolver.resolve("10.0.0.1", [header]) == "10.0.0.1"


def test_huge_forwarded_header_is_bounded() -> None:
    """A megabyte of hops is cut to its rightmost part; the answer is still the right hop."""
    resolver = ClientIPResolver(["10.0.0.0/8"])
    chain = ", ".join(["10.1.1.1"] * 200_000) + ", 203.0.113.7"
    assert resolver.resolve("10.0.0.1", [chain]) == "203.0.113.7"
    deep = ", ".join(["10.1.1.1"] * 100)
    assert resolver.resolve("10.0.0.1", [deep]) == "10.1.1.1"


def test_rfc7239_forwarded_header() -> None:
    """With header='forwarded', for= values (quoted IPv6 with port included) are honoured."""
    resolver = ClientIPResolver(["10.0.0.0/8"], header="forwarded")
    value = 'for=198.51.100.1;proto=https, for="[2001:db8::7]:4711";by=10.0.0.1'
    assert resolver.resolve("10.0.0.1", [value]) == "2001:db8::/64"  # IPv6: per /64
    assert resolver.resolve("10.0.0.1", ["for=_hidden"]) == "10.0.0.1"


def test_ipv6_keyed_per_64_by_default_and_ipv4_mapped_unwrapped() -> None:
    """IPv6 clients share one identifier per /64 by default; ::ffff:a.b.c.d is plain IPv4."""
    resolver = ClientIPResolver()
    assert resolver.resolve("2001:db8:1:2:aaaa::1", []) == "2001:db8:1:2::/64"
    assert resolver.resolve("2001:db8:1:2:bbbb::9", []) == "2001:db8:1:2::/64"
    assert resolver.resolve("2001:db8:1:3::1", []) == "2001:db8:1:3::/64"
    assert resolver.resolve("::ffff:192.0.2.1", []) == "192.0.2.1"
    assert resolver.resolve("192.0.2.1", []) == "192.0.2.1"
    behind_proxy = ClientIPResolver(["10.0.0.0/8"])
    assert behind_proxy.resolve("10.0.0.1", ["2001:db8::7"]) == "2001:db8::/64"


def test_ipv6_prefix_128_keys_each_address_and_other_prefixes_group() -> None:
    """ipv6_prefix=128 keys every IPv6 address alone (as it is written); /48 groups a site."""
    per_address = ClientIPResolver(ipv6_prefix=128)
    assert per_address.resolve("2001:db8:1:2:aaaa::1", []) == "2001:db8:1:2:aaaa::1"
    assert per_address.resolve("::ffff:192.0.2.1", []) == "192.0.2.1"
    per_site = ClientIPResolver(ipv6_prefix=48)
    assert per_site.resolve("2001:db8:1:2:aaaa::1", []) == "2001:db8:1::/48"


def test_bad_resolver_configuration_fails_at_once() -> None:
    """Invalid trusted proxies, header names or prefixes are ConfigurationErrors."""
    with pytest.raises(ConfigurationError):
        ClientIPResolver(["not-a-network"])
    with pytest.raises(ConfigurationError):
        ClientIPResolver(header="x-real-ip")  # type: ignore[arg-type]
    for prefix in (0, 129, None, True, "64"):
        with pytest.raises(ConfigurationError):
            ClientIPResolver(ipv6_prefix=prefix)  # type: ignore[arg-type]


def test_key_values_are_bounded_and_encodable() -> None:
    """Huge values are hashed, undecodable ones escaped, empty values mean 'no key'."""
    assert key_value("") is None
    assert key_value(b"") is None
    assert key_value(None) is None
    assert key_value(42) == "42"
    assert key_value("ünïcode") == "ünïcode"
    assert key_value("ünïcode".encode()) == "ünïcode"
    hashed = key_value("x" * 100_000)
    assert hashed is not None and hashed.startswith("~sha256:") and len(hashed) < 80
    for strange in ("bad\udcffbyte", b"bad\xffbyte", "~tilde"):
        escaped = key_value(strange)
        assert escaped is not None and escaped.startswith("~")
        escaped.encode("utf-8")  # no lone surrogate left
    assert key_value(b"bad\xff\\byte") == r"~=bad\xff\\byte"


TRICKY = [b"~", b"~=", b"\\", rb"\xff", b"\xff", b"\xed\xb3\xbf", b"sha256:", b"z" * 199]


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.binary(max_size=6),
            st.lists(st.sampled_from(TRICKY), max_size=4).map(b"".join),
            st.integers(190, 210).map(lambda n: b"\xc3\xa9" * n),  # near the length bound
        ),
        unique=True,
    )
)
def test_key_values_of_bytes_are_one_to_one(values: list[bytes]) -> None:
    """Different bytes never give the same identifier text (escapes and hashes included)."""
    texts = [key_value(value) for value in values if value]
    assert len(set(texts)) == len(texts)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.text(st.characters(exclude_categories=()), max_size=6),  # lone surrogates too
            st.lists(
                st.sampled_from(["~", "\\", "\udcff", "\udced", "é", "z" * 199]), max_size=4
            ).map("".join),
        ),
        unique=True,
    )
)
def test_key_values_of_text_are_one_to_one(values: list[str]) -> None:
    """Different text never gives the same identifier text, lone surrogates included."""
    texts = [key_value(value) for value in values if value]
    assert len(set(texts)) == len(texts)


def test_raw_header_key_reads_the_first_field_by_name_in_any_case() -> None:
    """A header key returns the first matching field's bytes, None without one."""

    class Request:
        fields = ((b"Host", b"x"), (b"X-User", b"\xffalice"), (b"x-user", b"bob"))

    key = raw_header_key("x-USER", lambda request: request.fields)
    assert key(Request()) == b"\xffalice"
    assert raw_header_key("x-other", lambda request: request.fields)(Request()) is None
    for name in ("", "clé", None):
        with pytest.raises(ConfigurationError):
            raw_header_key(name, lambda request: ())  # type: ignore[arg-type]


def test_quota_and_window_of_every_limit_type() -> None:
    """Every limit type gives its quota and window through BaseLimit (amount, per): no
    guessing among attribute names."""
    assert quota_and_window(TEN_PER_SECOND) == (10, 1)
    assert quota_and_window(Limit(5, per=0.5)) == (5, 1)  # sub-second windows round up
    assert quota_and_window(FixedWindow(7, per=60)) == (7, 60)
    assert quota_and_window(SlidingLog(9, per=3600)) == (9, 3600)
    # A bucket's window is its time to refill from empty: q/w is its sustained rate.
    assert quota_and_window(TokenBucket(4, per=1, burst=20)) == (20, 5)
    assert quota_and_window(TokenBucket(10, per=60)) == (10, 60)
    assert quota_and_window(MinInterval(2.5)) == (1, 3)
    assert quota_and_window(Concurrency(3, lease_ttl=30)) == (3, 30)
    assert quota_and_window(None) is None


def test_allowed_headers_one_item_per_limit() -> None:
    """An allowed decision gets RateLimit-Policy and RateLimit items, no Retry-After."""
    decision = Decision.from_pairs(
        (
            pair("ip:203.0.113.7", TEN_PER_SECOND, True, 7, 0.0, 0.4),
            pair("user:42", HUNDRED_PER_MINUTE, True, 55, 0.0, 31.2),
        )
    )
    headers = dict(rate_limit_headers(decision))
    assert headers == {
        "RateLimit-Policy": '"ip-10-per-1s";q=10;w=1, "user-100-per-60s";q=100;w=60',
        "RateLimit": '"ip-10-per-1s";r=7;t=1, "user-100-per-60s";r=55;t=32',
    }


def test_refused_headers_retry_after_is_the_largest_rounded_up() -> None:
    """Retry-After is whole seconds rounded up, the largest over the refusing pairs."""
    decision = Decision.from_pairs(
        (
            pair("ip:203.0.113.7", TEN_PER_SECOND, False, 0, 0.2, 0.9),
            pair("user:42", HUNDRED_PER_MINUTE, False, 0, 12.01, 40.0),
            # A refusal charges nothing: a pair with room reports its quota as it stands.
            pair("api:k", Limit(1000, per=3600), True, 1000, 0.0, 3000.0),
        )
    )
    headers = dict(rate_limit_headers(decision, legacy=True))
    assert headers["Retry-After"] == "13"
    assert headers["RateLimit"] == (
        '"ip-10-per-1s";r=0;t=1, "user-100-per-60s";r=0;t=13, "api-1000-per-3600s";r=1000;t=3000'
    )
    assert headers["X-RateLimit-Limit"] == "100"
    assert headers["X-RateLimit-Reset"] == "13"


def test_one_pair_headers_are_those_of_the_general_way() -> None:
    """A single pair's headers (written out) read as the items the general way makes: the
    same pair next to an undescribable one goes through ``_items``; kinds and limits equal
    by value share a description, different ones never do."""
    cases = [
        pair("ip:203.0.113.7", TEN_PER_SECOND, True, 7, 0.0, 0.4),
        pair("ip:203.0.113.8", Limit(10, per=1), False, 0, 2.5, 0.9),  # equal by value
        pair("ip:203.0.113.7", Limit(10, per=2), True, 3, 0.0, 1.5),  # another limit
        pair("user:42", TEN_PER_SECOND, True, -2, 0.0, 0.0),  # another kind
        pair("plain", TokenBucket(4, per=1, burst=20), False, 0, 0.25, 4.0),
        pair("route:GET /x:ip:1", Concurrency(3, lease_ttl=30), True, 2, 0.0, 30.0),
    ]
    for one in cases:
        decision = Decision.from_pairs((one,))
        fast = rate_limit_headers(decision)
        # The general way: two pairs of one policy name, the tighter of them the same pair.
        roomy = one._replace(allowed=True, remaining=one.remaining + 1000)
        both = Decision(
            decision.allowed, one.remaining, decision.retry_after, one.reset_after,
            one.identifier, one.limit, (roomy, one),
        )  # fmt: skip
        general = rate_limit_headers(both)
        assert fast == general, one
    names = [dict(rate_limit_headers(Decision.from_pairs((p,))))["RateLimit-Policy"] for p in cases]
    assert names[0] == names[1] and len(set(names)) == len(names) - 1


@pytest.mark.parametrize(("retry", "expected"), [(0.0001, 1), (1.0, 1), (1.2, 2), (2.999, 3)])
def test_retry_after_rounding(retry: float, expected: int) -> None:
    """Retry-After rounds up and is at least 1."""
    decision = Decision(False, 0, retry, retry, "ip:x", TEN_PER_SECOND, ())
    assert retry_after_seconds(decision) == expected


def test_problem_body_names_policies_not_identifiers() -> None:
    """The 429 body is RFC 9457 quota-exceeded with the violated policies, no identifiers."""
    decision = Decision.from_pairs(
        (
            pair("user:secret-api-key", TEN_PER_SECOND, False, 0, 0.5, 0.5),
            pair("ip:203.0.113.7", HUNDRED_PER_MINUTE, True, 3, 0.0, 10.0),
        )
    )
    status, body = problem_body(decision)
    problem = json.loads(body)
    assert status == 429
    assert problem["type"].endswith("#quota-exceeded")
    assert problem["status"] == 429
    assert problem["violated-policies"] == ["user-10-per-1s"]
    assert b"secret-api-key" not in body and b"203.0.113.7" not in body


def test_degraded_decisions_get_no_rate_limit_fields() -> None:
    """A decision made by the failure policy has no limits to advertise; refused is a 503."""
    admitted = Decision(True, 0, 0.0, 0.0, None, None, (), degraded=True)
    refused = Decision(False, 0, 0.7, 0.7, None, None, (), degraded=True)
    assert rate_limit_headers(admitted) == []
    assert problem_body(refused)[0] == 503


def test_unparseable_or_missing_peer_is_still_limited() -> None:
    """A peer that is no IP (a Unix socket path) or no peer at all still gets an identifier."""
    resolver = ClientIPResolver(["10.0.0.0/8"])
    assert resolver.resolve("/run/app.sock", ["203.0.113.7"]) == "/run/app.sock"
    assert resolver.resolve(None, []) == "unknown"


def test_peer_identifiers_are_kept_bounded_and_equal_to_a_fresh_resolution(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The peer-only lookup is cached (bounded); a cached answer equals a fresh one, IPv6 /64
    grouping and odd peers included, and forwarded headers still go through trusted proxies."""
    from aiolimit._web import client_ip

    monkeypatch.setattr(client_ip, "PEER_CACHE_SIZE", 4)
    resolver = ClientIPResolver(["10.0.0.0/8"])
    peers = ["203.0.113.7", "2001:db8::1", "2001:db8::2", "unix:/tmp/s", None, "203.0.113.7"]
    first = [resolver.resolve(peer, ()) for peer in peers]
    again = [resolver.resolve(peer, ()) for peer in peers]
    assert first == again
    assert first[1] == first[2] == "2001:db8::/64" and first[4] == "unknown"
    assert len(resolver._by_peer) <= 4
    assert resolver.resolve("10.1.2.3", ["198.51.100.9"]) == "198.51.100.9"
    assert resolver.resolve("203.0.113.7", ["198.51.100.9"]) == "203.0.113.7"  # untrusted peer


@pytest.mark.parametrize("framework", ["starlette", "aiohttp"])
@pytest.mark.parametrize("wrong", [["/health"], "/health", True])
def test_an_exempt_that_is_no_callable_is_a_configuration_error(
    framework: str, wrong: object
) -> None:
    """``exempt=`` takes a function of the request; paths go in ``routes={path: None}``.
    Anything else used to be accepted and then fail every request (500: not callable)."""
    from aiolimit import Limiter

    limiter = Limiter("memory://", [Limit(5, per=60)])
    with pytest.raises(ConfigurationError, match=r"routes=\{path: None\}"):
        if framework == "starlette":
            from aiolimit.starlette import RateLimitMiddleware

            RateLimitMiddleware(lambda *_: None, limiter, exempt=wrong)  # type: ignore[arg-type]
        else:
            from aiolimit.aiohttp import rate_limit_middleware

            rate_limit_middleware(limiter, exempt=wrong)  # type: ignore[arg-type]
