"""Limit: a frozen, hashable value with a parser for the common spellings and a readable str()."""

from __future__ import annotations

import dataclasses

import pytest

from aiolimit import Limit


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
