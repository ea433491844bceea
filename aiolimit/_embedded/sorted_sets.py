"""The sorted set commands of the embedded engine, as the scripts call them.

Replies and errors are Redis 7.0's, scores included (``%.17g``, strtod bounds, ``-0`` stored as
0). Only the forms the scripts use are implemented: ZADD with no flag but XX, ZRANGE by rank and
ZRANGEBYSCORE, each with WITHSCORES (and LIMIT for ZRANGEBYSCORE); any other option is refused
as Redis refuses an unknown one. ``commands`` registers these handlers under their names.
"""

from __future__ import annotations

from collections.abc import Sequence

from .keyspace import CommandError, Keyspace, Reply
from .numbers import format_double, int_arg, parse_double, parse_range_bound

SYNTAX = "ERR syntax error"
Entries = list[tuple[float, bytes]]


def zadd(ks: Keyspace, args: Sequence[bytes]) -> Reply:
    """ZADD key [XX] score member ...: how many members were added (XX: only update)."""
    update_only = args[2].lower() == b"xx"
    pairs = args[3:] if update_only else args[2:]
    if not pairs or len(pairs) % 2:
        raise CommandError(SYNTAX)
    scores = [parse_double(raw) for raw in pairs[::2]]
    if None in scores:
        raise CommandError("ERR value is not a valid float")
    zset = ks.get_zset(args[1], create=not update_only)
    added = 0
    for score, member in zip(scores, pairs[1::2], strict=True):
        assert score is not None
        current = zset.scores.get(member)
        if current is None:
            if not update_only:
                zset.insert(bytes(member), score)
                added += 1
        elif score != current:
            zset.remove(member)
            zset.insert(bytes(member), score)
    return added


def zrem(ks: Keyspace, args: Sequence[bytes]) -> Reply:
    zset = ks.get_zset(args[1])
    removed = 0
    for member in args[2:]:
        if member in zset.scores:
            zset.remove(member)
            removed += 1
    ks.drop_if_empty(args[1])
    return removed


def _score_bounds(low: bytes, high: bytes) -> tuple[tuple[float, bool], tuple[float, bool]]:
    bounds = parse_range_bound(low), parse_range_bound(high)
    if bounds[0] is None or bounds[1] is None:
        raise CommandError("ERR min or max is not a float")
    return bounds[0], bounds[1]


def zscore(ks: Keyspace, args: Sequence[bytes]) -> Reply:
    """ZSCORE key member: the score as text, or nil."""
    score = ks.get_zset(args[1]).scores.get(bytes(args[2]))
    return None if score is None else format_double(score)


def zcount(ks: Keyspace, args: Sequence[bytes]) -> Reply:
    bounds = _score_bounds(args[2], args[3])
    start, stop = ks.get_zset(args[1]).score_slice(*bounds)
    return stop - start


def _range_options(args: Sequence[bytes], *, limit: bool) -> tuple[bool, int, int]:
    """WITHSCORES, and LIMIT offset count where allowed: (with_scores, offset, count)."""
    with_scores, offset, count = False, 0, -1
    index = 4
    while index < len(args):
        option = args[index].lower()
        if option == b"withscores":
            with_scores = True
        elif option == b"limit" and limit and index + 2 < len(args):
            offset, count = int_arg(args[index + 1]), int_arg(args[index + 2])
            index += 2
        else:
            raise CommandError(SYNTAX)
        index += 1
    return with_scores, offset, count


def _entries_reply(entries: Entries, with_scores: bool) -> Reply:
    if with_scores:
        return [item for score, member in entries for item in (member, format_double(score))]
    return [member for _, member in entries]


def zrange(ks: Keyspace, args: Sequence[bytes]) -> Reply:
    """ZRANGE key start stop [WITHSCORES]: by rank, negative ranks counting from the end."""
    with_scores, _, _ = _range_options(args, limit=False)
    ranks = int_arg(args[2]), int_arg(args[3])
    zset = ks.get_zset(args[1])
    start, stop = zset.rank_slice(*ranks)
    return _entries_reply(zset.entries[start:stop], with_scores)


def zrangebyscore(ks: Keyspace, args: Sequence[bytes]) -> Reply:
    """ZRANGEBYSCORE key min max [WITHSCORES] [LIMIT offset count]."""
    with_scores, offset, count = _range_options(args, limit=True)
    bounds = _score_bounds(args[2], args[3])
    zset = ks.get_zset(args[1])
    start, stop = zset.score_slice(*bounds)
    if offset < 0 or (offset > 0 and offset >= len(zset.entries)):
        return []
    start += offset
    if count >= 0:
        stop = min(stop, start + count)
    return _entries_reply(zset.entries[start:stop], with_scores)


def zremrangebyscore(ks: Keyspace, args: Sequence[bytes]) -> Reply:
    bounds = _score_bounds(args[2], args[3])
    zset = ks.get_zset(args[1])
    start, stop = zset.score_slice(*bounds)
    for _, member in zset.entries[start:stop]:
        del zset.scores[member]
    del zset.entries[start:stop]
    ks.drop_if_empty(args[1])
    return stop - start
