"""The script's calling convention: encode() lays out KEYS/ARGV as lua/decide.lua's header says,
and decode() reads its reply. Pure: the one script run here is the embedded store's, in-process.
"""

from __future__ import annotations

from aiolimit import Limit, Limiter, SlidingLog
from aiolimit._calls import ACQUIRE, CHECK, decide_script, decision, decode, encode, parse_args
from aiolimit._rules import Rules

NOW_US = 1_700_000_000_250_000
PER_SECOND = Limit(10, per=1)
LOG = SlidingLog(5, per=60)
HOURLY = Limit(240, per=3600, precision=60)


def _plans() -> list:  # type: ignore[type-arg]
    rules = Rules({"ip": [PER_SECOND, LOG], "user": [HOURLY]}, "p")
    return rules.plans(["ip:1", "user:2"])


def test_encode_lays_out_keys_and_argv_as_the_header_says() -> None:
    """KEYS: each identifier's keys (no op record key); ARGV: 7 head values, then blocks."""
    call = encode(
        ACQUIRE, _plans(), 3, NOW_US, 3_600_000, op="c1:7:5", penalty=True, max_wait_us=500
    )
    assert call.keys == [
        "p:{ip:1}",  # block 1, key 1: the main key
        "p:{ip:1}:log:60000000",  # block 1, key 2: the sliding log's aux key
        "p:{user:2}",  # block 2, key 1
    ]
    assert call.args == [
        "acquire",  # ARGV[1] mode
        NOW_US,  # ARGV[2] now, integer µs
        3,  # ARGV[3] weight
        3_600_000,  # ARGV[4] TTL slack, ms
        "c1:7:5",  # ARGV[5] op: client, stamp, ack
        "pr500",  # ARGV[6] flags: penalty, reserve up to 500 µs
        2,  # ARGV[7] B blocks, then one comma-separated string per block:
        # K keys, P pairs, then per pair: aux (0 = none, 2 = the block's second key),
        # code, amount, period µs, param (the sliding window's precision µs)
        b"2,2,0,sw,10,1000000,1000000,2,log,5,60000000,0",
        b"1,1,0,sw,240,3600000000,60000000",
    ]  # fmt: skip
    assert call.plans == _plans()


def test_encode_without_op_clock_or_flags() -> None:
    """No op: ""; server time: now is ""; no flags: ""."""
    call = encode(CHECK, _plans()[1:], 1, None, 0)
    assert call.keys == ["p:{user:2}"]
    assert call.args == ["check", "", 1, 0, "", "", 1, b"1,1,0,sw,240,3600000000,60000000"]


def test_parse_args_reads_back_every_pair() -> None:
    """parse_args recovers (main key, aux key, code, amount, period, param) per pair."""
    call = encode(ACQUIRE, _plans(), 1, NOW_US, 0, op="abc")
    assert parse_args(call.keys, call.args) == [
        ("p:{ip:1}", "", "sw", "10", "1000000", "1000000"),
        ("p:{ip:1}", "p:{ip:1}:log:60000000", "log", "5", "60000000", "0"),
        ("p:{user:2}", "", "sw", "240", "3600000000", "60000000"),
    ]


def test_decode_reads_a_hand_made_reply() -> None:
    """The reply is {allowed, replay, now} then 4 integers per pair, in the call's pair order."""
    call = encode(ACQUIRE, _plans(), 2, NOW_US, 0)
    raw = [
        0, 0, NOW_US,
        1, 7, 0, 750_000,  # ip:1 10/second: allowed, 7 left, resets in 0.75 s
        0, 0, 1_500_000, 3_000_000,  # ip:1 sliding log: refused, retry in 1.5 s
        1, 230, -5, 3_599_750_000,  # user:2 hourly: a negative time reads as 0.0
    ]  # fmt: skip
    reply = decode(call, raw)
    assert (reply.allowed, reply.replay, reply.now_us) == (False, False, NOW_US)
    assert [(p.identifier, p.limit, p.allowed, p.remaining) for p in reply.pairs] == [
        ("ip:1", PER_SECOND, True, 7),
        ("ip:1", LOG, False, 0),
        ("user:2", HOURLY, True, 230),
    ]
    assert [(p.retry_after, p.reset_after) for p in reply.pairs] == [
        (0.0, 0.75),
        (1.5, 3.0),
        (0.0, 3599.75),
    ]
    merged = decision(reply)
    assert (merged.allowed, merged.remaining, merged.retry_after, merged.reset_after) == (
        False,
        0,
        1.5,
        3599.75,
    )
    assert (merged.identifier, merged.limit) == ("ip:1", LOG)


def test_a_replayed_refusal_is_a_refusal_even_if_every_pair_has_room() -> None:
    """The script's all-or-nothing verdict (reply[1]) wins over the per-pair verdicts."""
    call = encode(ACQUIRE, _plans()[1:], 1, NOW_US, 0, op="x")
    reply = decode(call, [0, 1, NOW_US, 1, 239, 0, 3_600_000_000])
    assert (reply.allowed, reply.replay) == (False, True)
    assert decision(reply).allowed is False


async def test_the_script_accepts_the_layout_written_from_its_header() -> None:
    """A KEYS/ARGV written by hand from the header runs in the real script, and decodes."""
    async with Limiter("memory://", [Limit(1, per=1)]) as limiter:
        engine = limiter.store.engine  # type: ignore[attr-defined]
        sha = engine.script_load(decide_script().source)
        keys = ["p:{ip:1}", "p:{ip:1}:log:60000000", "p:{user:2}"]
        args = ["acquire", NOW_US, 2, 0, "", "", 2,
                b"2,2,0,sw,10,1000000,1000000,2,log,5,60000000,0",
                b"1,1,0,sw,240,3600000000,60000000"]  # fmt: skip
        raw = engine.evalsha(sha, keys, args)
        assert raw == [
            1,
            0,
            NOW_US,
            1,
            8,
            0,
            750_000,
            1,
            3,
            0,
            60_000_000,
            1,
            238,
            0,
            3_579_750_000,
        ]
        call = encode(ACQUIRE, _plans(), 2, NOW_US, 0)
        assert (call.keys, call.args) == (keys, args)
        assert decision(decode(call, raw)).remaining == 3


def test_the_library_name_covers_its_whole_code() -> None:
    """A server that has a library of this name has this code, registrations included
    (FUNCTION LOAD of an existing name is taken as loaded): the name's digest is the hash
    of the whole library, not of the algorithm files alone."""
    import hashlib

    from aiolimit._calls import decide_library

    library = decide_library()
    digest = library.name.removeprefix("aiolimit_")
    template = library.code.replace("{", "{{").replace("}", "}}").replace(digest, "{digest}")
    assert hashlib.sha1(template.encode()).hexdigest()[:16] == digest
    assert f"'{library.function}'" in library.code and f"'{library.many}'" in library.code
