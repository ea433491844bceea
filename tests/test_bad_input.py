"""Bad input fails at the boundary with a typed error that says what is wrong, and changes nothing.

Every call test charges something first, sends the bad call, and then compares the whole stored
state under the test's prefix with what it was before.
"""

from __future__ import annotations

import asyncio
import enum
import math
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from _workers import Backend

from aiolimit import (
    BackendUnavailable,
    ConfigurationError,
    InvalidRequestError,
    Limit,
    Limiter,
    WeightNeverFits,
)
from aiolimit.testing import ManualClock

START = 1_700_000_000.25
LIMITS = {"ip": [Limit(10, per=1), Limit(5, per=60)], "user": [Limit(3, per=1)]}
Call = Callable[[Limiter], Awaitable[Any]]


@pytest.fixture
async def charged(backend: Backend) -> tuple[Backend, Limiter]:
    """A limiter on which ip:1 and user:2 were already charged once."""
    limiter = backend.limiter(LIMITS, clock=ManualClock(start=START))
    assert (await limiter.try_acquire(["ip:1", "user:2"])).allowed
    return backend, limiter


async def assert_refused_unchanged(
    charged: tuple[Backend, Limiter], call: Call, error: type[Exception], *words: str
) -> str:
    """Runs the bad call: it raises ``error`` naming ``words``, and nothing stored changes."""
    backend, limiter = charged
    before = await backend.snapshot()
    assert before  # the comparison is not between two empty states
    with pytest.raises(error) as caught:
        await call(limiter)
    message = str(caught.value)
    for word in words:
        assert word in message, (word, message)
    assert await backend.snapshot() == before
    return message


BAD_WEIGHTS = [
    pytest.param(0, InvalidRequestError, "got 0", id="zero"),
    pytest.param(-3, InvalidRequestError, "got -3", id="negative"),
    pytest.param(1.0, InvalidRequestError, "got 1.0", id="float"),
    pytest.param(True, InvalidRequestError, "got True", id="bool"),
    pytest.param(math.nan, InvalidRequestError, "got nan", id="nan"),
    pytest.param(10**30, WeightNeverFits, "can never be admitted", id="huge"),
]
CALLS: dict[str, Callable[[Any], Call]] = {
    "try_acquire": lambda w: lambda limiter: limiter.try_acquire(["ip:1", "user:2"], weight=w),
    "acquire": lambda w: lambda limiter: limiter.acquire(["ip:1", "user:2"], weight=w),
    "peek": lambda w: lambda limiter: limiter.peek(["ip:1", "user:2"], weight=w),
    "limit": lambda w: lambda limiter: limiter.limit(["ip:1", "user:2"], weight=w),
}


@pytest.mark.parametrize("method", sorted(CALLS))
@pytest.mark.parametrize(("weight", "error", "words"), BAD_WEIGHTS)
async def test_bad_weight_is_refused_before_anything_is_sent(
    charged: tuple[Backend, Limiter], method: str, weight: Any, error: type[Exception],
    words: str,
) -> None:  # fmt: skip
    """Weight 0, negative, float, bool, NaN or huge raises a typed error and charges nothing."""
    message = await assert_refused_unchanged(charged, CALLS[method](weight), error, words)
    assert "weight" in message


class _ClockSaying:
    """A user's clock (the ``aiolimit.Clock`` protocol) whose ``now_us`` returns ``value``."""

    ttl_slack_ms = 1000
    sleep_margin = 0.000_5

    def __init__(self, value: Any) -> None:
        self.value = value

    async def now_us(self) -> Any:
        return self.value

    def monotonic(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


BAD_NOWS = [
    pytest.param(-5_000_000, id="negative"),
    pytest.param(1.7e15 + 0.5, id="float"),
    pytest.param(2**53, id="past-2**53"),
    pytest.param("1700000000000000", id="text"),
    pytest.param(True, id="bool"),
]
CLOCK_CALLS: dict[str, Call] = {
    "try_acquire": lambda limiter: limiter.try_acquire(["ip:1", "user:2"]),
    "acquire": lambda limiter: limiter.acquire(["ip:1", "user:2"]),
    "peek": lambda limiter: limiter.peek(["ip:1", "user:2"]),
    "refund": lambda limiter: limiter.refund(["ip:1", "user:2"]),
}


@pytest.mark.parametrize("method", sorted(CLOCK_CALLS))
@pytest.mark.parametrize("value", BAD_NOWS)
async def test_a_clock_that_gives_no_valid_time_is_refused_before_anything_is_sent(
    charged: tuple[Backend, Limiter], method: str, value: Any
) -> None:
    """A clock of the user's whose ``now_us()`` is not whole microseconds since the epoch (an
    int in [0, 2**53)) makes a typed error naming it and the value, not a Redis error, a
    TypeError from deep inside or a time the scripts cannot store: nothing changes, and
    nothing is left to undo in the background."""
    backend, _ = charged
    limiter = backend.limiter(LIMITS, clock=_ClockSaying(value))
    await assert_refused_unchanged(
        (backend, limiter), CLOCK_CALLS[method], ConfigurationError, "now_us()", repr(value)
    )
    protocol = limiter._protocol  # type: ignore[attr-defined]
    assert not protocol._tasks and protocol.statistics.compensation_errors == 0


class _Micros(int):
    """An int subclass, as a units library might return."""


class _Epoch(enum.IntEnum):
    T = 1_700_000_000_500_000


@pytest.mark.parametrize("value", [_Micros(1_700_000_000_500_000), _Epoch.T], ids=repr)
async def test_a_clock_may_return_an_int_subclass(backend: Backend, value: int) -> None:
    """An int subclass or an IntEnum is whole microseconds too: it is taken by its value."""
    limiter = backend.limiter(LIMITS, clock=_ClockSaying(value))
    decision = await limiter.try_acquire(["ip:1", "user:2"])
    assert decision.allowed and decision.remaining == 2


@pytest.mark.parametrize(("weight", "error", "words"), BAD_WEIGHTS[:-1])
async def test_bad_refund_weight_is_refused(
    charged: tuple[Backend, Limiter], weight: Any, error: type[Exception], words: str
) -> None:
    """refund rejects the same bad weights and credits nothing."""
    await assert_refused_unchanged(
        charged, lambda limiter: limiter.refund("ip:1", weight=weight), error, "weight", words
    )


async def test_a_huge_refund_weight_is_refused_before_anything_is_sent(
    charged: tuple[Backend, Limiter],
) -> None:
    """refund(weight=10**30) is an InvalidRequestError naming the bound, not a Lua error."""
    await assert_refused_unchanged(
        charged,
        lambda limiter: limiter.refund("ip:1", weight=10**30),
        InvalidRequestError,
        "weight",
        "<= 1000000000000",
    )


async def test_an_infinite_acquire_timeout_waits_as_long_as_it_takes(
    charged: tuple[Backend, Limiter],
) -> None:
    """acquire(timeout=math.inf) means no timeout (not an OverflowError)."""
    _, limiter = charged
    decision = await limiter.acquire("user:2", timeout=math.inf)
    assert decision.allowed


async def test_weight_above_the_smallest_limit_never_fits(charged: tuple[Backend, Limiter]) -> None:
    """A weight above the smallest applicable limit raises WeightNeverFits naming the pair."""
    await assert_refused_unchanged(
        charged,
        lambda limiter: limiter.try_acquire(["ip:1", "user:2"], weight=4),
        WeightNeverFits,
        "weight 4",
        "'user:2'",
        "3/second",
    )
    limiter = charged[1]
    assert (await limiter.try_acquire("ip:1", weight=4)).allowed  # fits ip's own limits


async def test_acquire_never_waits_for_a_weight_that_never_fits(
    charged: tuple[Backend, Limiter],
) -> None:
    """acquire(timeout=None) raises WeightNeverFits at once instead of waiting forever."""
    started = time.monotonic()
    await assert_refused_unchanged(
        charged,
        lambda limiter: limiter.acquire("ip:1", weight=6, timeout=None),
        WeightNeverFits,
        "'ip:1'",
        "5/minute",
    )
    assert time.monotonic() - started < 1.0
    assert charged[1].statistics().waits == 0


@pytest.mark.parametrize(
    ("ids", "words"),
    [
        pytest.param([], "at least one identifier", id="empty-list"),
        pytest.param((), "at least one identifier", id="empty-tuple"),
        pytest.param([1], "got 1 (int)", id="int-id"),
        pytest.param([b"ip:1"], "got b'ip:1' (bytes)", id="bytes-id"),
        pytest.param(["ip:1", None], "got None (NoneType)", id="none-id"),
        pytest.param(42, "got int", id="not-a-list"),
        pytest.param([""], "empty string", id="empty-string-id"),
        pytest.param(["ip:1", ""], "empty string", id="empty-string-among-good"),
        pytest.param(["ip:\ud800"], "lone surrogate", id="lone-surrogate"),
    ],
)
async def test_bad_identifiers_are_refused(
    charged: tuple[Backend, Limiter], ids: Any, words: str
) -> None:
    """Empty lists, non-str ids, empty strings and unencodable text raise InvalidRequestError."""
    for call in (
        lambda limiter: limiter.try_acquire(ids),
        lambda limiter: limiter.peek(ids),
        lambda limiter: limiter.refund(ids),
        lambda limiter: limiter.reset(ids),
    ):
        await assert_refused_unchanged(charged, call, InvalidRequestError, words)


async def test_duplicate_identifiers_count_once(backend: Backend) -> None:
    """The same identifier listed twice is charged once, not twice."""
    limit = Limit(3, per=1)
    limiter = backend.limiter([limit], clock=ManualClock(start=START))
    decision = await limiter.try_acquire(["ip:1", "ip:1", "ip:1"], weight=2)
    assert (decision.allowed, decision.remaining, len(decision.details)) == (True, 1, 1)
    assert await backend.counts("ip:1") == {"w1000000/1000000:1700000000": 2}


async def test_an_identifier_kind_without_a_rule_is_refused(backend: Backend) -> None:
    """Without a "*" rule, an identifier of an unconfigured kind raises, naming the kind."""
    limiter = backend.limiter({"ip": [Limit(3, per=1)]}, clock=ManualClock(start=START))
    assert (await limiter.try_acquire("ip:1")).allowed
    await assert_refused_unchanged(
        (backend, limiter),
        lambda limiter: limiter.try_acquire(["ip:1", "user:2"]),
        InvalidRequestError,
        "'user:2'",
        "kind 'user'",
        "['ip']",
    )


@pytest.mark.parametrize(
    "bad_timeout", [-1, math.nan, True, "1"], ids=["negative", "nan", "bool", "str"]
)
async def test_bad_acquire_timeout_is_refused(
    charged: tuple[Backend, Limiter], bad_timeout: Any
) -> None:
    """acquire's timeout must be None or seconds >= 0."""
    await assert_refused_unchanged(
        charged,
        lambda limiter: limiter.acquire("ip:1", timeout=bad_timeout),
        ConfigurationError,
        "timeout",
        repr(bad_timeout),
    )


@pytest.mark.parametrize(
    ("arguments", "words"),
    [
        pytest.param({"amount": 0, "per": 1}, "got 0", id="amount-zero"),
        pytest.param({"amount": -5, "per": 1}, "got -5", id="amount-negative"),
        pytest.param({"amount": 2.5, "per": 1}, "must be an int, got 2.5", id="amount-float"),
        pytest.param({"amount": True, "per": 1}, "must be an int, got True", id="amount-bool"),
        pytest.param({"amount": 10, "per": 0}, "per must be between", id="period-zero"),
        pytest.param({"amount": 10, "per": -1}, "got -1", id="period-negative"),
        pytest.param({"amount": 10, "per": math.nan}, "got nan", id="period-nan"),
        pytest.param({"amount": 10, "per": math.inf}, "got inf", id="period-inf"),
        pytest.param({"amount": 10, "per": "1s"}, "number of seconds", id="period-str"),
        pytest.param(
            {"amount": 10, "per": 60, "precision": 61}, "precision must be between", id="coarse"
        ),
        pytest.param({"amount": 10, "per": 60, "precision": 0}, "got 0", id="precision-zero"),
    ],
)
def test_bad_limits_are_refused(arguments: dict[str, Any], words: str) -> None:
    """Limit rejects a non-positive or non-int amount, a bad period and a precision above it."""
    with pytest.raises(ConfigurationError, match="Limit") as caught:
        Limit(**arguments)
    assert words in str(caught.value)
    assert isinstance(caught.value, ValueError)


@pytest.mark.parametrize(
    "text",
    ["", "ten/second", "10/fortnight", "10 per", "/second", "0/second", "-5/second", "10/0s"],
)
def test_unparseable_limits_are_refused(text: str) -> None:
    """Limit.parse raises ConfigurationError on text that is not '<amount>/<unit>'."""
    with pytest.raises(ConfigurationError) as caught:
        Limit.parse(text)
    assert "Limit" in str(caught.value) or repr(text) in str(caught.value)


@pytest.mark.parametrize("value", [None, 10, b"10/second"])
def test_limit_parse_refuses_non_text(value: Any) -> None:
    """Limit.parse takes text only."""
    with pytest.raises(ConfigurationError, match="cannot parse limit"):
        Limit.parse(value)


@pytest.mark.parametrize(
    ("store", "words"),
    [
        ("mongodb://127.0.0.1:27017", "'mongodb'"),
        ("127.0.0.1:6379", "'127.0.0.1:6379'"),
        ("", "''"),
    ],
)
def test_unknown_store_scheme_is_refused(store: str, words: str) -> None:
    """An unknown URL scheme raises ConfigurationError naming it and the schemes allowed."""
    with pytest.raises(ConfigurationError) as caught:
        Limiter(store, [Limit(1, per=1)])
    assert words in str(caught.value)
    assert "redis://" in str(caught.value)
    assert "memory://" in str(caught.value)


@pytest.mark.parametrize("prefix", ["{", "a}b", "", 7])
def test_bad_prefix_is_refused(prefix: Any) -> None:
    """A prefix must be non-empty text without hash-tag braces."""
    with pytest.raises(ConfigurationError, match="prefix"):
        Limiter("memory://", [Limit(1, per=1)], prefix=prefix)


@pytest.mark.parametrize(
    ("limits", "words"),
    [
        ([], "at least one limit"),
        ({}, "at least one kind"),
        ({"ip:x": [Limit(1, per=1)]}, "kind must be"),
        ([Limit(1, per=1), Limit(1, per=1)], "share one counter"),
        (["10/second", 5], "must be Limit objects"),
        (b"10/second", "must be a list"),  # (text is taken: "10/second;100/minute")
    ],
)
def test_bad_rules_are_refused(limits: Any, words: str) -> None:
    """Rules need at least one limit, kinds without ':', and no repeated limit."""
    with pytest.raises(ConfigurationError, match=words):
        Limiter("memory://", limits)


def _closed_port() -> int:
    """A loopback port nothing listens on: the OS picked it free, and it was closed again."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


async def test_unreachable_redis_raises_backend_unavailable_naming_it() -> None:
    """A refused connection raises BackendUnavailable naming the address, within the timeout."""
    port = _closed_port()
    url = f"redis://127.0.0.1:{port}/0"
    async with Limiter(url, [Limit(1, per=1)], socket_timeout=1) as limiter:
        started = time.monotonic()
        with pytest.raises(BackendUnavailable) as caught:
            await limiter.try_acquire("ip:1")
        assert time.monotonic() - started < 3
        assert f"127.0.0.1:{port}" in str(caught.value)
        assert caught.value.__cause__ is not None
        assert not isinstance(caught.value, ValueError)  # never mistaken for bad input
        assert limiter.statistics().errors == 1


async def _time_silent_store(server: Any, **options: Any) -> tuple[BackendUnavailable, float]:
    """Pauses the server (TCP accepted, nothing answered) and times one acquire against it."""
    async with Limiter(server.url, [Limit(1, per=1)], socket_timeout=1, **options) as limiter:
        server.pause()
        try:
            started = time.monotonic()
            with pytest.raises(BackendUnavailable) as caught:
                await limiter.acquire("ip:1", timeout=None)
            elapsed = time.monotonic() - started
        finally:
            server.resume()
    return caught.value, elapsed


async def test_silent_redis_times_out_at_the_socket_timeout(fresh_standalone: Any) -> None:
    """Without a deadline, a silent server raises BackendUnavailable at the socket timeout."""
    error, elapsed = await _time_silent_store(fresh_standalone, deadline=None)
    assert 0.9 < elapsed < 3
    assert f"127.0.0.1:{fresh_standalone.port}" in str(error)
    assert isinstance(error.__cause__, Exception)


async def test_silent_redis_error_names_the_address_under_the_default_deadline(
    fresh_standalone: Any,
) -> None:
    """With the default decision deadline, a silent server's error still names the address."""
    error, elapsed = await _time_silent_store(fresh_standalone)
    assert elapsed < 3
    assert f"127.0.0.1:{fresh_standalone.port}" in str(error)
