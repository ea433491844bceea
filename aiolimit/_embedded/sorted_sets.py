"""Sorted sets for the embedded backend: the ``SortedSet`` value and the Z* commands.

Replies and errors are Redis 7.0's, scores included (``%.17g``, strtod bounds, ``-0`` stored as
0). ``commands`` registers these handlers under their Redis names.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right, insort
from collections.abc import Sequence
from typing import TYPE_CHECKING

from .numbers import format_double, int_arg, parse_double, parse_range_bound
from .replies import NOT_FLOAT, SYNTAX, CommandError, Reply

if TYPE_CHECKING:
    from .keyspace import Keyspace


class SortedSet:
    """A ZSET: member -> score, plus the (score, member) pairs kept in Redis' order."""

    __slots__ = ("entries", "scores")

    def __init__(self) -> None:
        self.scores: dict[bytes, float] = {}
        self.entries: list[tuple[float, bytes]] = []

    def insert(self, member: bytes, score: float) -> None:
        score += 0.0  # Redis' small-set encoding stores -0 as 0
        self.scores[member] = score
        insort(self.entries, (score, member))

    def remove(self, member: bytes) -> None:
        score = self.scores.pop(member)
        del self.entries[bisect_left(self.entries, (score, member))]

    def score_slice(self, low: tuple[float, bool], high: tuple[float, bool]) -> tuple[int, int]:
        """Index range [start, stop) of the entries whose score lies within the bounds."""
        start = (bisect_right if low[1] else bisect_left)(self.entries, low[0], key=_score)
        stop = (bisect_left if high[1] else bisect_right)(self.entries, high[0], key=_score)
        return start, max(start, stop)

    def rank_slice(self, start: int, end: int) -> tuple[int, int]:
        """Redis' index rules: negative counts from the end, clamped; [start, stop) or empty."""
        size = len(self.entries)
        start, end = start + size if start < 0 else start, end + size if end < 0 else end
        start = max(start, 0)
        if start > end or start >= size:
            return 0, 0
        return start, min(end, size - 1) + 1


def _score(entry: tuple[float, bytes]) -> float:
    return entry[0]


_ZADD_OPTIONS = (b"nx", b"xx", b"gt", b"lt", b"incr", b"ch")


def zadd(ks: Keyspace, args: Sequence[bytes], flags: set[bytes]) -> Reply:
    index = 2
    while index < len(args) and args[index].lower() in _ZADD_OPTIONS:
        flags.add(args[index].lower())
        index += 1
    pairs = args[index:]
    if not pairs or len(pairs) % 2:
        raise CommandError(SYNTAX)
    nx, xx, gt, lt, incr, changed = (option in flags for option in _ZADD_OPTIONS)
    if nx and xx:
        raise CommandError("ERR XX and NX options at the same time are not compatible")
    if (gt and nx) or (lt and nx) or (gt and lt):
        raise CommandError("ERR GT, LT, and/or NX options at the same time are not compatible")
    if incr and len(pairs) > 2:
        raise CommandError("ERR INCR option supports a single increment-element pair")
    scores = [parse_double(raw) for raw in pairs[::2]]
    if None in scores:
        raise CommandError(NOT_FLOAT)
    zset = ks.get_zset(args[1])
    if zset is None and xx:
        return None if incr else 0
    if zset is None:
        zset = ks.data[bytes(args[1])] = SortedSet()
    added = updated = processed = 0
    score = 0.0
    for new, member in zip(scores, pairs[1::2], strict=True):
        assert new is not None
        current = zset.scores.get(member)
        if current is None:
            if not xx:
                zset.insert(bytes(member), new)
                score, added, processed = new, added + 1, processed + 1
            continue
        if nx:
            continue
        if incr:
            new += current
            if math.isnan(new):
                raise CommandError("ERR resulting score is not a number (NaN)")
        if (lt and new >= current) or (gt and new <= current):
            continue
        score, processed = new, processed + 1
        if new != current:
            zset.remove(member)
            zset.insert(bytes(member), new)
            updated += 1
    if incr:
        return format_double(score) if processed else None
    return added + updated if changed else added


def zrem(ks: Keyspace, args: Sequence[bytes]) -> Reply:
    zset = ks.get_zset(args[1]) or SortedSet()
    removed = 0
    for member in args[2:]:
        if member in zset.scores:
            zset.remove(member)
            removed += 1
    ks.drop_if_empty(args[1])
    return removed


def _score_of(ks: Keyspace, key: bytes, member: bytes) -> float | None:
    zset = ks.get_zset(key)
    return None if zset is None else zset.scores.get(member)


def zrank(ks: Keyspace, args: Sequence[bytes], reverse: bool) -> Reply:
    score = _score_of(ks, args[1], args[2])
    if score is None:
        return None
    entries = (ks.get_zset(args[1]) or SortedSet()).entries
    rank = bisect_left(entries, (score, args[2]))
    return len(entries) - 1 - rank if reverse else rank


def _score_bounds(low: bytes, high: bytes) -> tuple[tuple[float, bool], tuple[float, bool]]:
    bounds = parse_range_bound(low), parse_range_bound(high)
    if bounds[0] is None or bounds[1] is None:
        raise CommandError("ERR min or max is not a float")
    return bounds[0], bounds[1]


def zcard(ks: Keyspace, args: Sequence[bytes]) -> Reply:
    return len((ks.get_zset(args[1]) or SortedSet()).scores)


def zcount(ks: Keyspace, args: Sequence[bytes]) -> Reply:
    low, high = _score_bounds(args[2], args[3])
    start, stop = (ks.get_zset(args[1]) or SortedSet()).score_slice(low, high)
    return stop - start


def zscore(ks: Keyspace, args: Sequence[bytes]) -> Reply:
    score = _score_of(ks, args[1], args[2])
    return None if score is None else format_double(score)


def zrange(
    ks: Keyspace, args: Sequence[bytes], by_score: bool | None, reverse: bool | None
) -> Reply:
    with_scores, offset, limit = False, 0, -1
    index = 4
    while index < len(args):
        option = args[index].lower()
        if option == b"withscores":
            with_scores = True
        elif option == b"limit" and len(args) - index - 1 >= 2:
            offset, limit = int_arg(args[index + 1]), int_arg(args[index + 2])
            index += 2
        elif option == b"rev" and reverse is None:
            reverse = True
        elif option == b"byscore" and by_score is None:
            by_score = True
        else:
            raise CommandError(SYNTAX)
        index += 1
    if limit != -1 and not by_score:
        raise CommandError(
            "ERR syntax error, LIMIT is only supported in combination with either BYSCORE or BYLEX"
        )
    low, high = (args[3], args[2]) if reverse and by_score else (args[2], args[3])
    if by_score:
        bounds = _score_bounds(low, high)
    else:
        ranks = int_arg(low), int_arg(high)
    zset = ks.get_zset(args[1]) or SortedSet()
    entries = zset.entries
    if by_score:
        start, stop = zset.score_slice(*bounds)
        chosen = entries[start:stop][::-1] if reverse else entries[start:stop]
        if offset < 0 or (offset > 0 and offset >= len(entries)):
            chosen = []
        chosen = chosen[offset:] if limit < 0 else chosen[offset : offset + limit]
    else:
        start, stop = zset.rank_slice(*ranks)
        size = len(entries)
        chosen = entries[size - stop : size - start][::-1] if reverse else entries[start:stop]
    if with_scores:
        return [item for score, member in chosen for item in (member, format_double(score))]
    return [member for _, member in chosen]


def zremrange(ks: Keyspace, args: Sequence[bytes], by_score: bool) -> Reply:
    if by_score:
        bounds = _score_bounds(args[2], args[3])
    else:
        ranks = int_arg(args[2]), int_arg(args[3])
    zset = ks.get_zset(args[1]) or SortedSet()
    start, stop = zset.score_slice(*bounds) if by_score else zset.rank_slice(*ranks)
    for _, member in zset.entries[start:stop]:
        del zset.scores[member]
    del zset.entries[start:stop]
    ks.drop_if_empty(args[1])
    return stop - start
