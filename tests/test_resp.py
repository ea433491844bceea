"""The stores' hand-packed RESP is byte for byte what redis-py's own packer writes."""

from __future__ import annotations

import pytest
from redis.asyncio.connection import Connection

from aiolimit._stores import resp
from aiolimit._stores.resp import command_head, pack_call, pack_calls

SHA = "ab" * 20


def _redis_py(*args: object) -> bytes:
    return b"".join(Connection().pack_command(*args))


@pytest.mark.parametrize(
    ("keys", "args"),
    [
        (["p:{ip:1}"], ["acquire", "", 1, 0, "c1:7:3,5", "", 1, b"1,1,0,sw,5,1000000,100000"]),
        (["p:{ü:é}", "p:{ü:é}:log:1"], ["check", 1_700_000_000_000_000, 10**6, 0, "", "r5", 1]),
        ([], ["release", "", 0, 3_600_000, "x:1:", "p", 0]),
        (["p:{a\r\nb}"], ["", b"", b"\x00\xff", -5]),
    ],
)
def test_a_call_packs_as_redis_py_packs_it(keys: list[str], args: list[object]) -> None:
    """Keys and arguments of every type (unicode, CRLF inside, negative ints, empty)."""
    head = command_head("EVALSHA", SHA)
    expected = _redis_py("EVALSHA", SHA, len(keys), *keys, *args)
    assert pack_call(head, 2, keys, args) == expected  # type: ignore[arg-type]
    assert pack_call(head, 2, keys, args) == expected, "again, from the cache"  # type: ignore[arg-type]


def test_several_calls_pack_into_one_buffer_and_the_cache_stays_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """pack_calls concatenates the calls; the cache of repeated values never passes its
    bound."""

    class Call:
        def __init__(self, keys: list[str], args: list[object]) -> None:
            self.keys, self.args = keys, args

    monkeypatch.setattr(resp, "_PACKED_MAX", 8)
    head = command_head("EVALSHA", SHA)
    calls = [
        Call([f"p:{{ip:{i}}}"], ["acquire", "", 1, 0, "", "", 1, b"blk%d" % i]) for i in range(20)
    ]
    packed = pack_calls(head, 2, calls)  # type: ignore[arg-type]
    assert packed == b"".join(_redis_py("EVALSHA", SHA, 1, *c.keys, *c.args) for c in calls)
    assert len(resp._PACKED) <= 8


def test_an_argument_of_another_type_is_refused() -> None:
    """A float (or None) is a bug upstream: it fails loudly instead of being sent."""
    with pytest.raises(TypeError, match="str, int or bytes"):
        pack_call(command_head("EVALSHA", SHA), 2, [], [1.5])  # type: ignore[list-item]


async def test_replies_read_before_a_broken_connection_are_kept() -> None:
    """A pipeline whose connection breaks after two replies: those two stay their calls'
    results (the cluster store answers only the rest with the error), and an error reply
    is a result, not a failure. (A stand-in connection: this is the reading logic only.)"""
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import ResponseError

    from aiolimit._stores.resp import read_replies

    class Broken:
        def __init__(self) -> None:
            self.replies: list[object] = [[1, 0, 5], ResponseError("NOSCRIPT x")]

        async def read_response(self) -> object:
            if not self.replies:
                raise RedisConnectionError("reset by peer")
            reply = self.replies.pop(0)
            if isinstance(reply, ResponseError):
                raise reply
            return reply

    into: list[object] = []
    with pytest.raises(RedisConnectionError):
        await read_replies(Broken(), 4, into)
    assert into[0] == [1, 0, 5]
    assert isinstance(into[1], ResponseError) and len(into) == 2
