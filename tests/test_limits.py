"""Limit: a frozen, hashable value with a parser for the common spellings and a readable str()."""

from __future__ import annotations

import dataclasses

import pytest

from aiolimit import ConfigurationError, Limit, parse_limits


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("10/second", Limit(10, per=1)),
        ("120/minute", Limit(120, per=60)),
        ("240/hour", Limit(240, per=3600)),
        ("240 per hour", Limit(240, per=3600)),
        ("1000/day", Limit(1000, per=86400)),
        ("5/10s", Limit(5, per=10)),
        ("5 per 10 seconds", Limit(5, per=10)),
        ("3/2.5s", Limit(3, per=2.5)),
        ("7/m", Limit(7, per=60)),
        ("7/min", Limit(7, per=60)),
        ("7/h", Limit(7, per=3600)),
        ("7/d", Limit(7, per=86400)),
        ("100/15minutes", Limit(100, per=900)),
        ("  10 / second  ", Limit(10, per=1)),
        ("10/SECOND", Limit(10, per=1)),
        ("10 PER Hour", Limit(10, per=3600)),
    ],
)
def test_parse_reads_the_common_spellings(text: str, expected: Limit) -> None:
    """Limit.parse understands '<n>/<unit>', '<n> per <unit>', counts and unit aliases, any case."""
    assert Limit.parse(text) == expected


@pytest.mark.parametrize(
    ("limit", "text"),
    [
        (Limit(10, per=1), "10/second"),
        (Limit(120, per=60), "120/minute"),
        (Limit(240, per=3600), "240/hour"),
        (Limit(1000, per=86400), "1000/day"),
        (Limit(5, per=10), "5/10 seconds"),
        (Limit(100, per=900), "100/15 minutes"),
        (Limit(9, per=7200), "9/2 hours"),
        (Limit(3, per=2.5), "3/2.5 seconds"),
        (Limit(240, per=3600, precision=60), "240/hour (precision 60s)"),
        (Limit(10, per=1, precision=0.25), "10/second (precision 0.25s)"),
        (Limit(10, per=60, precision=60), "10/minute"),
    ],
)
def test_str_is_readable(limit: Limit, text: str) -> None:
    """str(limit) reads like the text it could be parsed from, with any finer precision noted."""
    assert str(limit) == text


def test_parse_and_str_round_trip() -> None:
    """Parsing a limit's str() (without precision) gives the same limit back."""
    for limit in [Limit(10, per=1), Limit(120, per=60), Limit(1000, per=86400)]:
        assert Limit.parse(str(limit)) == limit


def test_precision_defaults_to_the_period() -> None:
    """Without a precision the window is one bucket: precision == per, as floats."""
    limit = Limit(10, per=60)
    assert (limit.amount, limit.per, limit.precision) == (10, 60.0, 60.0)
    assert isinstance(limit.per, float)
    assert Limit(10, per=60) == Limit(10, per=60.0, precision=60)


def test_limits_are_frozen() -> None:
    """A Limit cannot be changed after it is made."""
    limit = Limit(10, per=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        limit.amount = 11  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        limit.per = 2.0  # type: ignore[misc]


def test_limits_are_hashable_and_compare_by_value() -> None:
    """Equal limits are equal and hash alike; any differing field makes them different."""
    assert Limit(10, per=1) == Limit(10, per=1.0)
    assert hash(Limit(10, per=1)) == hash(Limit(10, per=1.0))
    assert len({Limit(10, per=1), Limit(10, per=1), Limit.parse("10/second")}) == 1
    different = [
        Limit(10, per=1),
        Limit(11, per=1),
        Limit(10, per=2),
        Limit(10, per=60),
        Limit(10, per=60, precision=1),
    ]
    assert len(set(different)) == len(different)
    assert {Limit(10, per=1): "a"}[Limit.parse("10/second")] == "a"


def test_wire_form_is_integers_in_microseconds() -> None:
    """The script sees (algorithm, amount, period µs, precision µs), never floats."""
    assert Limit(240, per=3600, precision=60).wire == ("sw", 240, 3_600_000_000, 60_000_000)
    assert Limit(3, per=0.5).wire == ("sw", 3, 500_000, 500_000)
    assert Limit(7, per=1).max_weight == 7


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("10/second;100/minute", (Limit(10, per=1), Limit(100, per=60))),
        ("5 per second, 1000 per day", (Limit(5, per=1), Limit(1000, per=86400))),
        ("10000/week", (Limit(10000, per=7 * 86400),)),
        ("1000000/month; 5/2 weeks", (Limit(1000000, per=30 * 86400), Limit(5, per=14 * 86400))),
        ("1/year", (Limit(1, per=365 * 86400),)),
        ("3/10mins", (Limit(3, per=600),)),
    ],
)
def test_parse_limits_reads_several_and_long_units(text: str, expected: tuple[Limit, ...]) -> None:
    """Several limits in one string (';' or ','); week, month and year are fixed lengths
    (7, 30 and 365 days)."""
    assert parse_limits(text) == expected


@pytest.mark.parametrize("text", ["", "10/second;", ";", "10/fortnight", "ten/second", "10"])
def test_a_bad_limit_string_shows_the_grammar(text: str) -> None:
    """Empty parts, unknown units and missing numbers fail with the accepted grammar."""
    with pytest.raises(ConfigurationError, match="units: second, minute, hour, day, week"):
        parse_limits(text)


def test_rules_take_a_several_limit_string_anywhere() -> None:
    """A Limiter's rules accept one string with several limits, alone or per kind."""
    from aiolimit import Limiter

    limiter = Limiter("memory://", "10/second;100/minute")
    assert limiter.limits == {"*": (Limit(10, per=1), Limit(100, per=60))}
    limiter = Limiter("memory://", {"ip": "1/s, 5/h", "*": ["2/s", "9/day;10/week"]})
    assert limiter.limits["ip"] == (Limit(1, per=1), Limit(5, per=3600))
    assert limiter.limits["*"] == (Limit(2, per=1), Limit(9, per=86400), Limit(10, per=604800))
