"""The decision script: loading it, and its calling convention (see ``lua/decide.lua``).

The only module that knows the script's KEYS and ARGV layout and its reply shape. A list of
identifier plans becomes a ``Call`` (its mode, KEYS and ARGV), and a reply becomes per-pair
verdicts. Pure functions: nothing here talks to a server, so the protocol and the tests use
them freely; stores send a ``Call``'s ``keys`` and ``args`` as they are and never read them.

``lua/`` is the single source of truth for the algorithms. Its files are concatenated in a
fixed order (the prelude, every algorithm, then the ``decide`` entry point) into one script,
so one call judges any mix of algorithms atomically; it is read and hashed once per process.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import cache
from importlib.resources import files
from importlib.resources.abc import Traversable
from typing import Protocol

from aiolimit._decision import Decision, PairDecision, made_decision
from aiolimit._limits import BaseLimit
from aiolimit._rules import IdentifierPlan

#: One script argument (identifier blocks are pre-encoded bytes).
Arg = str | int | bytes
#: A raw script reply: a flat list of integers.
RawReply = list[int]


class Mode(enum.StrEnum):
    """What a call asks of the script (ARGV[1])."""

    ACQUIRE = "acquire"  # decide; charge every pair only if every pair allows
    CHECK = "check"  # decide; write nothing (phase 1 across cluster slots)
    PEEK = "peek"  # decide; write nothing; report each pair's state now (no charge assumed)
    REFUND = "refund"  # give weight back (newest charges first)
    UNDO = "undo"  # credit exactly what an acquire op charged, once
    RELEASE = "release"  # drop an op's concurrency leases
    RENEW = "renew"  # extend an op's concurrency leases

    @property
    def writes(self) -> bool:
        return self is not Mode.CHECK and self is not Mode.PEEK


ACQUIRE = Mode.ACQUIRE
CHECK = Mode.CHECK
PEEK = Mode.PEEK
REFUND = Mode.REFUND
UNDO = Mode.UNDO
RELEASE = Mode.RELEASE
RENEW = Mode.RENEW
PAIR_FIELDS = 5  # per pair within a block: aux, algorithm, amount, period, param
REPLY_HEAD = 3
REPLY_PER_PAIR = 4


@dataclass(slots=True, eq=False)
class Call:
    """One script call: its mode, keys and arguments, and the plans they came from.

    Not frozen, though nothing changes one once made: a frozen dataclass's ``__init__`` costs
    about 0.5 µs more, and every decision makes one (a cross-slot one four)."""

    mode: Mode
    keys: list[str]
    args: list[Arg]
    plans: Sequence[IdentifierPlan]
    #: For a call that carries its time (a clock of the client's): that clock's monotonic
    #: and its reading when the call was made, so a call sent again later is judged at the
    #: time it is sent (``resend_args``). None for a call judged by the server's TIME.
    monotonic: Callable[[], float] | None = None
    read_at: float = 0.0


@dataclass(slots=True, eq=False)
class Reply:
    """A parsed reply: the call's verdict, whether it was a replay, and per-pair verdicts."""

    allowed: bool
    replay: bool
    now_us: int
    pairs: tuple[PairDecision, ...]


def encode(
    mode: Mode,
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
        mode.value, "" if now_us is None else now_us, weight, slack_ms, op, flags, len(plans)
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
    return Call(mode, keys, args, plans)


class ScriptCallLike(Protocol):
    """Any call a store is given (``aiolimit._stores.base.ScriptCall``): keys and args."""

    @property
    def args(self) -> Sequence[Arg]: ...


#: Modes judged at the time a call is sent: sent again later, they move their time on. An
#: undo or a refund is judged at its decision's time on purpose (it credits what that charged).
_MOVED_ON = frozenset({Mode.ACQUIRE.value, Mode.CHECK.value, Mode.PEEK.value})


def resend_args(call: Call | ScriptCallLike) -> Sequence[Arg]:
    """The arguments to send ``call`` again with: its own, but an acquire or a check that
    carries its time (ARGV[2]) has it moved on by the time its clock says passed since the
    call was made. A call retried through a failover (seconds of backoff) would otherwise be
    judged in the past: its charge would leave its window that much early. The op is the
    same, so a copy that ran already still replays, whatever its time."""
    args = call.args
    monotonic = getattr(call, "monotonic", None)  # (a call made elsewhere carries no clock)
    if monotonic is None or not isinstance(args[1], int) or args[0] not in _MOVED_ON:
        return args
    late = round((monotonic() - getattr(call, "read_at", 0.0)) * 1_000_000)
    if late <= 0:
        return args
    moved = list(args)
    moved[1] = args[1] + late
    return moved


_new_pair = tuple.__new__  # (a NamedTuple made without its Python-level __new__)


def decode(call: Call, raw: Sequence[int]) -> Reply:
    pairs: list[PairDecision] = []
    append = pairs.append
    at = REPLY_HEAD
    for plan in call.plans:
        identifier = plan.identifier
        for limit in plan.limits:
            retry_us = raw[at + 2]
            reset_us = raw[at + 3]
            append(
                _new_pair(
                    PairDecision,
                    (
                        identifier,
                        limit,
                        raw[at] == 1,
                        raw[at + 1],
                        retry_us / 1_000_000 if retry_us > 0 else 0.0,
                        reset_us / 1_000_000 if reset_us > 0 else 0.0,
                    ),
                )
            )
            at += REPLY_PER_PAIR
    return Reply(raw[0] == 1, raw[1] == 1, raw[2], tuple(pairs))


def reply_decision(call: Call, raw: Sequence[int]) -> Decision:
    """``decision(decode(call, raw))``, with the commonest call (one identifier under one
    limit) built directly: the same fields, without the intermediate reply and merge."""
    plans = call.plans
    if len(plans) == 1:
        plan = plans[0]
        limits = plan.limits
        if len(limits) == 1:
            limit = limits[0]
            identifier = plan.identifier
            pair_allowed = raw[3] == 1
            remaining = raw[4]
            retry_us = raw[5]
            reset_us = raw[6]
            retry = retry_us / 1_000_000 if retry_us > 0 else 0.0
            reset = reset_us / 1_000_000 if reset_us > 0 else 0.0
            pair = _new_pair(
                PairDecision, (identifier, limit, pair_allowed, remaining, retry, reset)
            )
            # The script's all-or-nothing verdict stands (a replayed refusal is a refusal).
            return made_decision(
                raw[0] == 1, remaining, 0.0 if pair_allowed else retry, reset, identifier,
                limit, (pair,),
            )  # fmt: skip
    return replies_decision((call,), (raw,))


def replies_decision(calls: Sequence[Call], raws: Sequence[Sequence[int]]) -> Decision:
    """The decision over several calls' replies (one per slot of a call across slots, all
    answered): ``decision`` of their pairs merged, the call allowed only if every reply
    allows. Decoded and merged in one pass (``Decision.from_pairs``'s rules, on locals),
    without the intermediate replies."""
    pairs: list[PairDecision] = []
    append = pairs.append
    allowed = True
    merged = True  # every pair so far allows
    remaining = bound_remaining = 0
    reset = retry_bound = 0.0
    bound_identifier: str | None = None
    bound_limit: BaseLimit | None = None
    for call, raw in zip(calls, raws, strict=True):
        if raw[0] != 1:
            allowed = False
        at = REPLY_HEAD
        for plan in call.plans:
            identifier = plan.identifier
            for limit in plan.limits:
                pair_allowed = raw[at] == 1
                pair_remaining = raw[at + 1]
                retry_us = raw[at + 2]
                reset_us = raw[at + 3]
                retry = retry_us / 1_000_000 if retry_us > 0 else 0.0
                pair_reset = reset_us / 1_000_000 if reset_us > 0 else 0.0
                append(
                    _new_pair(
                        PairDecision,
                        (identifier, limit, pair_allowed, pair_remaining, retry, pair_reset),
                    )
                )
                if bound_limit is None:  # the first pair binds until another does
                    remaining, reset = pair_remaining, pair_reset
                    bound_identifier, bound_limit = identifier, limit
                    bound_remaining, retry_bound = pair_remaining, retry
                else:
                    if pair_remaining < remaining:
                        remaining = pair_remaining
                    if pair_reset > reset:
                        reset = pair_reset
                if not pair_allowed:
                    if merged or retry > retry_bound:
                        bound_identifier, bound_limit = identifier, limit
                        bound_remaining, retry_bound = pair_remaining, retry
                    merged = False
                elif merged and pair_remaining < bound_remaining:
                    bound_identifier, bound_limit = identifier, limit
                    bound_remaining, retry_bound = pair_remaining, retry
                at += REPLY_PER_PAIR
    if not pairs:
        return Decision(allowed, 0, 0.0, 0.0, None, None, ())
    # The scripts' all-or-nothing verdict stands (a replayed refusal is a refusal).
    return made_decision(
        allowed, remaining, 0.0 if merged else retry_bound, reset, bound_identifier,
        bound_limit, tuple(pairs),
    )  # fmt: skip


def allows(raw: Sequence[int]) -> bool:
    """A raw reply's all-or-nothing verdict, without decoding its pairs."""
    return raw[0] == 1


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


# --- loading the script ------------------------------------------------------------------

# Order matters: algorithms register themselves in ALGORITHMS, defined by the prelude.
ALGORITHM_FILES = ("sliding_window.lua", "gcra.lua", "sliding_log.lua", "concurrency.lua")
SCRIPT_FILES = ("prelude.lua", *ALGORITHM_FILES, "decide.lua")


def lua_dir() -> Traversable:
    """The scripts as package data, ``aiolimit/lua``, read one way wherever the package is.

    A wheel holds the files there; in a checkout (and an editable install) ``aiolimit/lua`` is a
    committed symlink to the top-level ``lua/``, which stays the single source of truth.
    """
    directory = files("aiolimit") / "lua"
    if not (directory / "decide.lua").is_file():
        raise FileNotFoundError(
            f"aiolimit's Lua scripts are missing from its package data ({directory}): in a "
            "checkout, aiolimit/lua must be the symlink to ../lua (git config core.symlinks)"
        )
    return directory


@dataclass(frozen=True, slots=True)
class Script:
    """A script's source and SHA1, as EVALSHA and SCRIPT LOAD want them."""

    source: str
    sha: str


@dataclass(frozen=True, slots=True)
class Library:
    """The same code as a FUNCTION library (Redis 7+, Valkey): ``code`` for FUNCTION LOAD,
    ``function`` for FCALL. Both names carry a hash of the code, so two versions of aiolimit
    on one server each find their own, and loading one never replaces the other."""

    code: str
    name: str
    function: str
    #: Several calls in one FCALL (``decide_many`` in ``lua/decide.lua``): ``pack_many``.
    many: str
    #: Several calls on several slots of one cluster node in one FCALL, their keys not
    #: declared (``decide_node``, flagged ``allow-cross-slot-keys``): ``pack_many(spread=True)``.
    node: str


def _definitions() -> str:
    base = lua_dir()
    return "\n".join((base / name).read_text(encoding="utf-8") for name in SCRIPT_FILES)


@cache
def decide_script() -> Script:
    """The decision script for EVAL/EVALSHA (built once per process): every definition, then
    one call of ``decide``. The server builds the definitions again on every call."""
    source = _definitions() + "\nreturn decide(KEYS, ARGV)\n"
    return Script(source, hashlib.sha1(source.encode("utf-8")).hexdigest())


@cache
def decide_library() -> Library:
    """The decision code as a FUNCTION library: the definitions are built once per server
    (and kept across calls: the parsed identifier blocks too), and each FCALL only decides.
    Functions are replicated and persisted by the server, unlike cached scripts."""
    # The digest covers the whole library, registrations included: a server holding a library
    # of the same name then holds exactly this code ("already exists" means loaded).
    template = (
        "#!lua name=aiolimit_{digest}\n"
        + _definitions().replace("{", "{{").replace("}", "}}")
        + "\nredis.register_function('aiolimit_decide_{digest}', function(keys, args)\n"
        "  return decide(keys, args)\nend)\n"
        "redis.register_function('aiolimit_many_{digest}', function(keys, args)\n"
        "  return decide_many(keys, args)\nend)\n"
        "redis.register_function{{function_name = 'aiolimit_node_{digest}',\n"
        "  callback = function(keys, args) return decide_node(keys, args) end,\n"
        "  flags = {{'allow-cross-slot-keys'}}}}\n"
    )
    digest = hashlib.sha1(template.encode("utf-8")).hexdigest()[:16]
    code = template.format(digest=digest)
    return Library(
        code,
        f"aiolimit_{digest}",
        f"aiolimit_decide_{digest}",
        f"aiolimit_many_{digest}",
        f"aiolimit_node_{digest}",
    )
