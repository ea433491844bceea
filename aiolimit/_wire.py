"""The decision script's calling convention (see the header of ``lua/decide.lua``).

Pure functions: a list of identifier plans becomes KEYS and ARGV, and a reply becomes per-pair
verdicts. Nothing here talks to a server, so the protocol and the tests can use it freely.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from aiolimit._decision import Decision, PairDecision
from aiolimit._rules import IdentifierPlan

ACQUIRE = "acquire"
CHECK = "check"
REFUND = "refund"
UNDO = "undo"
RELEASE = "release"
RENEW = "renew"
PAIR_ARGS = 6
REPLY_HEAD = 3
REPLY_PER_PAIR = 4


@dataclass(frozen=True, slots=True)
class Call:
    """One script call: its keys and arguments, and the plans they came from."""

    keys: list[str]
    args: list[str | int]
    plans: Sequence[IdentifierPlan]


@dataclass(frozen=True, slots=True)
class Reply:
    """A parsed reply: the call's verdict, whether it was a replay, and per-pair verdicts."""

    allowed: bool
    replay: bool
    now_us: int
    pairs: tuple[PairDecision, ...]


def encode(
    mode: str,
    plans: Sequence[IdentifierPlan],
    weight: int,
    now_us: int | None,
    slack_ms: int,
    op: str = "",
    penalty: bool = False,
    max_wait_us: int = 0,
) -> Call:
    keys: list[str] = []
    pair_args: list[str | int] = []
    npairs = 0
    for plan in plans:
        main = len(keys) + 1
        keys.extend(plan.keys)
        for aux, algorithm, amount, period, param in plan.pairs:
            pair_args += (main, main + aux if aux >= 0 else 0, algorithm, amount, period, param)
            npairs += 1
    if op:
        keys.append(plans[0].keys[0] + ":op:" + op)  # same hash tag: same slot
    now = "" if now_us is None else now_us
    flags = "p" if penalty else ""
    if max_wait_us > 0:
        flags += f"r{max_wait_us}"
    head: list[str | int] = [mode, now, weight, slack_ms, op, flags, npairs]
    return Call(keys, head + pair_args, plans)


def decode(call: Call, raw: Sequence[int]) -> Reply:
    pairs = []
    at = REPLY_HEAD
    for plan in call.plans:
        for limit in plan.limits:
            allowed, remaining, retry_us, reset_us = raw[at : at + REPLY_PER_PAIR]
            pairs.append(
                PairDecision(
                    plan.identifier,
                    limit,
                    bool(allowed),
                    int(remaining),
                    max(int(retry_us), 0) / 1_000_000,
                    max(int(reset_us), 0) / 1_000_000,
                )
            )
            at += REPLY_PER_PAIR
    return Reply(bool(raw[0]), bool(raw[1]), int(raw[2]), tuple(pairs))


def decision(reply: Reply) -> Decision:
    """The caller-facing decision. A replayed refusal (the op was cancelled) is a refusal."""
    merged = Decision.from_pairs(reply.pairs)
    if merged.allowed != reply.allowed:
        # The script's all-or-nothing verdict is authoritative (e.g. a replayed op).
        merged = replace(merged, allowed=reply.allowed)
    return merged
