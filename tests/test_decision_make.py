"""``made_decision`` (the store's way to make a ``Decision``, faster than the dataclass's own
``__init__``) makes exactly what ``Decision(...)`` makes: every field, equality, hash, repr,
immutability, and the charge kept apart from the answer."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from aiolimit import Limit
from aiolimit._decision import Charge, Decision, PairDecision, made_decision

LIMIT = Limit(10, per=1)
PAIR = PairDecision("ip:x", LIMIT, False, 0, 0.25, 1.0)


@pytest.mark.parametrize(
    "given",
    [
        (True, 5, 0.0, 1.0, "ip:x", LIMIT, ()),
        (False, 0, 0.25, 1.0, "ip:x", LIMIT, (PAIR,)),
        (True, 0, 0.0, 0.0, None, None, ()),
    ],
)
def test_made_decision_equals_the_dataclass_s_own_in_every_field(given: tuple) -> None:
    made, plain = made_decision(*given), Decision(*given)
    for item in dataclasses.fields(Decision):
        assert getattr(made, item.name) == getattr(plain, item.name), item.name
    assert made == plain
    assert hash(made) == hash(plain)
    assert repr(made) == repr(plain)
    assert type(made) is Decision


def test_a_made_decision_is_frozen_and_replace_keeps_its_fields() -> None:
    made = made_decision(True, 5, 0.0, 1.0, "ip:x", LIMIT, ())
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.allowed = False  # type: ignore[misc]
    again = dataclasses.replace(made, degraded=True)
    assert again.degraded and again.remaining == 5 and not made.degraded


def test_the_charge_is_kept_but_is_no_part_of_the_answer() -> None:
    charge = Charge(object(), [], 1)
    made = made_decision(True, 5, 0.0, 1.0, "ip:x", LIMIT, (), charge)
    assert made._charge is charge
    assert made == made_decision(True, 5, 0.0, 1.0, "ip:x", LIMIT, ())
    assert "charge" not in repr(made)
    assert pickle.loads(pickle.dumps(made))._charge is None  # (Charge.__reduce__)
