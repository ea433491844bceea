"""Rules.plans' fast paths (a str; a 1-element list/tuple) validate exactly as the general
path (the pre-0f7b4a8 code, copied here)."""

from __future__ import annotations

import pytest

from aiolimit import InvalidRequestError, Limit
from aiolimit._rules import Rules


def general_plans(rules: Rules, ids: object) -> list:  # type: ignore[type-arg]
    if isinstance(ids, str):
        ids = (ids,)
    elif not isinstance(ids, (list, tuple, set, frozenset)):
        raise InvalidRequestError(
            f"identifiers must be a str or a list/tuple of str, got {type(ids).__name__}"
        )
    if not ids:
        raise InvalidRequestError("at least one identifier is needed, got none")
    seen: dict[str, None] = {}
    for identifier in ids:
        if not isinstance(identifier, str):
            raise InvalidRequestError(
                f"identifiers must be str, got {identifier!r} ({type(identifier).__name__})"
            )
        if not identifier:
            raise InvalidRequestError("an identifier must not be the empty string")
        seen[identifier] = None
    return [rules.plan_for(identifier) for identifier in seen]


class Sub(str):
    pass


class L(list):  # type: ignore[type-arg]
    pass


INPUTS = [
    "ip:1", "", "nokind", "ip:", ":1", "other:1", Sub("ip:1"), Sub(""), b"ip:1", None, 1,
    ["ip:1"], [""], [b"ip:1"], [None], [Sub("ip:1")], [Sub("")], [1], ("ip:1",), ("",),
    (b"x",), L(["ip:1"]), L([""]), [], (), ["ip:1", "ip:1"], ["ip:1", ""], {"ip:1"},
    frozenset({"ip:1"}), {"ip:1": 1}, ["nokind"], ["ip:1\x00"], "ip:" + "x" * 5000,
]  # fmt: skip


@pytest.mark.parametrize("ids", INPUTS, ids=repr)
def test_fast_paths_validate_like_the_general_path(ids: object) -> None:
    rules = Rules({"ip": [Limit(5, per=1)]}, "p")

    def outcome(plans: object) -> object:
        try:
            return [(p.identifier, type(p.identifier), p.keys, p.block) for p in plans()]  # type: ignore[operator]
        except Exception as error:
            return (type(error), str(error))

    assert outcome(lambda: rules.plans(ids)) == outcome(lambda: general_plans(rules, ids))
