"""Key naming: identifiers are untrusted text; their keys never collide and share one slot."""

from __future__ import annotations

import itertools

import pytest
from redis.crc import key_slot

from aiolimit import InvalidRequestError, Limit, SlidingLog
from aiolimit._keys import MAX_TAG_BYTES, aux_key, identifier_kind, identifier_tag, main_key
from aiolimit._rules import Rules

AWKWARD = [
    "ip:203.0.113.7",
    "a",
    "{a}",
    "{a",
    "a}",
    "}{",
    "{}",
    "a:{b}",
    "a}:{b",
    "%7B",
    "%7Ba%7D",
    "%25",
    "%",
    "%H" + "0" * 64,
    "a\x00b",
    "a\x00",
    "\x00",
    "ünïcødé",
    "用户:42",
    "🙂",
    "a:b:c",
    "a:",
    ":a",
    "a b",
    "a\nb",
]


def _tag_of(key: str) -> str:
    """The hash tag Redis Cluster uses for ``key`` (between the first '{' and the next '}')."""
    start = key.index("{")
    return key[start + 1 : key.index("}", start + 1)]


def test_awkward_identifiers_get_distinct_keys() -> None:
    """Braces, ':', '%', NUL and unicode never make two identifiers share a key."""
    keys = {main_key("p", identifier) for identifier in AWKWARD}
    assert len(keys) == len(AWKWARD)
    aux = {aux_key("p", identifier, "log:1") for identifier in AWKWARD}
    assert len(aux) == len(AWKWARD)
    assert not keys & aux


def test_no_identifiers_key_is_another_identifiers_aux_key() -> None:
    """A main key of one identifier is never an aux key of another, whatever the text."""
    mains = {main_key("p", identifier) for identifier in AWKWARD}
    for identifier, suffix in itertools.product(AWKWARD, ["log:1", "x", "}", "{a}"]):
        assert aux_key("p", identifier, suffix) not in mains


@pytest.mark.parametrize("identifier", AWKWARD)
def test_every_key_of_an_identifier_shares_its_hash_tag(identifier: str) -> None:
    """The main key and every aux key of one identifier hash to one cluster slot."""
    main = main_key("aiolimit", identifier)
    assert main == f"aiolimit:{{{identifier_tag(identifier)}}}"
    assert _tag_of(main) == identifier_tag(identifier)
    assert "{" not in identifier_tag(identifier) and "}" not in identifier_tag(identifier)
    slot = key_slot(main.encode())
    for suffix in ["log:1000000", "op:0123abcd", "x:{y}"]:
        assert key_slot(aux_key("aiolimit", identifier, suffix).encode()) == slot


def test_all_keys_of_a_plan_share_a_slot_and_differ_per_identifier() -> None:
    """Rules put an identifier's main and aux keys in one slot, under the rule's prefix."""
    rules = Rules([Limit(10, per=1), SlidingLog(5, per=60)], "tenant-a")
    first, second = rules.plans(["user:{42}", "user:42"])
    assert first.keys == ("tenant-a:{user:%7B42%7D}", "tenant-a:{user:%7B42%7D}:log:60000000")
    assert second.keys == ("tenant-a:{user:42}", "tenant-a:{user:42}:log:60000000")
    assert len({key_slot(key.encode()) for key in first.keys}) == 1


def test_escaping_is_exact_and_reversible() -> None:
    """Only '%', '{' and '}' are percent-escaped; everything else is kept as is."""
    assert identifier_tag("a{b}%c:\x00ü") == "a%7Bb%7D%25c:\x00ü"
    assert identifier_tag("%7B") == "%257B"  # a literal escape never equals an escaped brace
    assert identifier_tag("{") != identifier_tag("%7B")


def test_long_identifiers_are_hashed_to_a_bounded_tag() -> None:
    """An identifier whose escaped form passes 256 bytes becomes %H + a SHA-256 (66 chars)."""
    at_limit = "a" * MAX_TAG_BYTES
    assert identifier_tag(at_limit) == at_limit
    long = "a" * (MAX_TAG_BYTES + 1)
    tag = identifier_tag(long)
    assert tag.startswith("%H")
    assert len(tag) == 2 + 64
    assert len(main_key("p", "x" * 100_000)) == len("p:{}") + 66
    # Escaping counts: 100 braces are 300 bytes once escaped, so they are hashed too.
    assert identifier_tag("{" * 100).startswith("%H")
    # Multi-byte text is measured in UTF-8 bytes, not characters.
    assert identifier_tag("ü" * 128) == "ü" * 128
    assert identifier_tag("ü" * 129).startswith("%H")


def test_distinct_long_identifiers_get_distinct_keys() -> None:
    """Long identifiers that differ in one character (even the last) get different keys."""
    base = "user:" + "x" * 400
    variants = [base, base + "y", base[:-1] + "z", "y" + base[1:], base + "\x00"]
    assert len({main_key("p", identifier) for identifier in variants}) == len(variants)
    assert main_key("p", base) == main_key("p", "user:" + "x" * 400)  # and stable


def test_a_hashed_tag_never_equals_a_short_identifiers_tag() -> None:
    """A short identifier spelled like a hashed tag is escaped, so it cannot collide with one."""
    long = "k" * 300
    impostor = identifier_tag(long)
    assert identifier_tag(impostor) != impostor
    assert main_key("p", impostor) != main_key("p", long)


@pytest.mark.parametrize("identifier", ["\ud800", "ip:\udfff", "a\ud83d"])
def test_lone_surrogates_are_rejected(identifier: str) -> None:
    """Text that cannot be encoded as UTF-8 raises InvalidRequestError naming the identifier."""
    with pytest.raises(InvalidRequestError, match="lone surrogate") as caught:
        main_key("p", identifier)
    assert repr(identifier) in str(caught.value)


@pytest.mark.parametrize(
    ("identifier", "kind"),
    [("ip:1", "ip"), ("ip:1:2", "ip"), ("anon", "anon"), (":x", ""), ("用户:42", "用户")],
)
def test_an_identifiers_kind_is_the_text_before_the_first_colon(identifier: str, kind: str) -> None:
    """identifier_kind takes the text before the first ':' (all of it when there is none)."""
    assert identifier_kind(identifier) == kind
