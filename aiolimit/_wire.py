"""The decision script's calling convention (see the header of ``lua/decide.lua``).

Pure functions: a list of identifier plans becomes KEYS and ARGV, and a reply becomes per-pair
verdicts. Nothing here talks to a server, so the protocol and the tests can use it freely.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from aiolimit._decision import Decision, PairDecision
from aiolimit._rules import IdentifierPlan
from aiolimit._stores.base import Arg

ACQUIRE = "acquire"
CHECK = "check"
REFUND = "refund"
UNDO = "undo"
RELEASE = "release"
RENEW = "renew"
PAIR_FIELDS = 5  # per pair within a block: aux, algorithm, amount, period, param
REPLY_HEAD = 3
REPLY_PER_PAIR = 4


@dataclass(frozen=True, slots=True)
class Call:
    """One script call: its keys and arguments, and the plans they came from."""

    keys: list[str]
    args: list[Arg]
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
    flags = "p" if penalty else ""
    if max_wait_us > 0:
        flags += f"r{max_wait_us}"
    args: list[Arg] = [
        mode, "" if now_us is None else now_us, weight, slack_ms, op, flags, len(plans)
    ]  # fmt: skip
    if len(plans) == 1:
        plan = plans[0]
        keys = list(plan.keys)
        args.append(plan.block)
    else:
        keys = []
        for plan in plans:
            keys += plan.keys
            args.append(plan.block)
    if op:
        keys.append(plans[0].keys[0] + ":op:" + op)  # same hash tag: same slot
    return Call(keys, args, plans)


def decode(call: Call, raw: Sequence[int]) -> Reply:
    pairs = []
    at = REPLY_HEAD
    for plan in call.plans:
        identifier = plan.identifier
        for limit in plan.limits:
            retry_us = raw[at + 2]
            reset_us = raw[at + 3]
            pairs.append(
                PairDecision(
                    identifier,
                    limit,
                    raw[at] == 1,
                    raw[at + 1],
                    retry_us / 1_000_000 if retry_us > 0 else 0.0,
                    reset_us / 1_000_000 if reset_us > 0 else 0.0,
                )
            )
            at += REPLY_PER_PAIR
    return Reply(raw[0] == 1, raw[1] == 1, raw[2], tuple(pairs))


def parse_args(keys: Sequence[str], args: Sequence[object]) -> list[tuple[str, ...]]:
    """The pairs a call's KEYS/ARGV describe: (main key, aux key or "", algorithm, amount,
    period, param), for tests and tools that stand in for the script."""
    out: list[tuple[str, ...]] = []
    key_base = 0
    for block in args[7 : 7 + int(str(args[6]))]:
        values = (block.decode("ascii") if isinstance(block, bytes) else str(block)).split(",")
        at = 2
        for _ in range(int(values[1])):
            aux, algorithm, amount, period, param = values[at : at + PAIR_FIELDS]
            aux_key = keys[key_base + int(aux) - 1] if int(aux) else ""
            out.append((keys[key_base], aux_key, algorithm, amount, period, param))
            at += PAIR_FIELDS
        key_base += int(values[0])
    return out


def decision(reply: Reply) -> Decision:
    """The caller-facing decision. A replayed refusal (the op was cancelled) is a refusal."""
    merged = Decision.from_pairs(reply.pairs)
    if merged.allowed != reply.allowed:
        # The script's all-or-nothing verdict is authoritative (e.g. a replayed op).
        merged = replace(merged, allowed=reply.allowed)
    return merged
