"""Random sequences of calls, decided by the real limiter and by the reference model alike.

Hypothesis draws rules (random mixes of Limit with dividing and non-dividing precisions,
FixedWindow, SlidingLog, TokenBucket and MinInterval, for two identifier kinds) and a program of
try_acquire / peek / refund calls on random identifier lists (duplicates included) with random
weights, between clock moves: none (time standing still), sub-bucket, several periods, exactly
a refusal's retry_after (or 1 µs short of it), or onto a bucket edge (or 1 µs either side). Every
decision, pair by pair, must equal ``tests/reference.py``'s, on real Redis and on memory://.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from reference import US, Model, Outcome, Verdict, to_us

from aiolimit import Decision, FixedWindow, Limit, Limiter, MinInterval, SlidingLog, TokenBucket
from aiolimit.testing import ManualClock

IDENTIFIERS = ("a:1", "a:1", "a:2", "b:1")  # "a:1" twice as often: it runs out sooner
START_US = 1_700_000_000 * US


# --- what hypothesis draws ------------------------------------------------------------------

periods_ms = st.one_of(
    st.integers(1, 60).map(lambda s: s * 1000),  # whole seconds
    st.integers(1000, 60_000),  # any millisecond
)


KINDS = ("limit", "fixed", "log", "bucket", "interval")


@st.composite
def any_limit(draw: st.DrawFn, kind: str | None = None) -> Any:
    """A Limit (its precision dividing the period or not), FixedWindow, SlidingLog, TokenBucket
    or MinInterval; ``kind`` picks one, else any."""
    if kind is None:
        kind = draw(st.sampled_from(KINDS))
    amount = draw(st.integers(1, 10))
    per_ms = draw(periods_ms)
    if kind == "limit":
        divisors = [per_ms // k for k in range(1, 13) if per_ms % k == 0]
        precision_ms = draw(
            st.one_of(
                st.sampled_from(divisors),  # dividing the period (k = 1: a fixed window)
                st.integers(max(per_ms // 12, 1), per_ms),  # usually not dividing it
            )
        )
        return Limit(amount, per=per_ms / 1000, precision=precision_ms / 1000)
    if kind == "fixed":
        return FixedWindow(amount, per=per_ms / 1000)
    if kind == "log":
        return SlidingLog(amount, per=per_ms / 1000)
    if kind == "bucket":
        return TokenBucket(draw(st.integers(1, 10)), per=per_ms / 1000, burst=amount)
    return MinInterval(draw(st.integers(100, 10_000)) / 1000)


# Two limits of one kind may not share storage (the limiter refuses such rules).
rule = st.lists(any_limit(), min_size=1, max_size=3, unique_by=lambda limit: limit.storage)

ids_lists = st.lists(st.sampled_from(IDENTIFIERS), min_size=1, max_size=3)


@dataclass(frozen=True)
class Scenario:
    rules: dict[str, list[Any]]
    start_offset_us: int
    steps: list[tuple[Any, ...]]


# Mostly acquisitions, so limits run out and refusals, retries and refunds matter.
ACTIONS = ("acquire", "acquire", "acquire", "acquire", "peek", "refund", "advance", "retry", "edge")


@st.composite
def scenarios(draw: st.DrawFn, focus: str) -> Scenario:
    """Kind "a" always has a limit of the ``focus`` algorithm; the rest is random."""
    first = draw(any_limit(focus))
    others = draw(st.lists(any_limit(), max_size=2, unique_by=lambda limit: limit.storage))
    rules = {
        "a": [first, *(limit for limit in others if limit.storage != first.storage)],
        "b": draw(rule),
    }
    periods = [to_us(limit.per) for limits in rules.values() for limit in limits]
    advances = st.one_of(
        st.just(0),  # time standing still
        st.integers(1, 999),  # a few µs
        st.integers(1, min(periods)),  # within the shortest period
        st.integers(0, 3 * max(periods)),  # up to a few of the longest
    )
    steps: list[tuple[Any, ...]] = []
    for _ in range(draw(st.integers(10, 20))):
        action = draw(st.sampled_from(ACTIONS))
        if action == "advance":
            steps.append((action, draw(advances)))
        elif action == "retry":
            steps.append((action, draw(st.sampled_from([0, -1]))))
        elif action == "edge":
            steps.append((action, draw(st.integers(0, 5)), draw(st.sampled_from([-1, 0, 1]))))
        else:
            steps.append((action, draw(ids_lists), draw(st.integers(1, 10))))
    return Scenario(rules, draw(st.integers(0, max(periods))), steps)


# --- comparing ------------------------------------------------------------------------------


def observed(decision: Decision) -> tuple[bool, list[tuple[str, bool, int, int, int]]]:
    return decision.allowed, [
        (
            pair.identifier,
            pair.allowed,
            pair.remaining,
            round(pair.retry_after * US),
            round(pair.reset_after * US),
        )
        for pair in decision.details
    ]


def expected(outcome: Outcome) -> tuple[bool, list[tuple[str, bool, int, int, int]]]:
    return outcome.allowed, [
        (identifier, v.allowed, v.remaining, v.retry_us, v.reset_us)
        for identifier, v in outcome.pairs
    ]


def check_summary(decision: Decision, verdicts: list[Verdict]) -> None:
    """The call's own fields summarise its pairs as the Decision docstring says."""
    refused = [v for v in verdicts if not v.allowed]
    assert decision.remaining == min(v.remaining for v in verdicts)
    assert round(decision.retry_after * US) == max((v.retry_us for v in refused), default=0)
    assert round(decision.reset_after * US) == max(v.reset_us for v in verdicts)


def edge_advance(limits: list[Any], pick: int, delta: int, now: int) -> int:
    """How far to move onto a bucket edge (windows) or one period on (the others), +- 1 µs."""
    limit = limits[pick % len(limits)]
    if isinstance(limit, (Limit, FixedWindow)):
        width = to_us(limit.precision if isinstance(limit, Limit) else limit.per)
        return (now // width + 1) * width + delta - now
    return max(to_us(limit.per) + delta, 0)


async def run(url: str, scenario: Scenario) -> None:
    clock = ManualClock(start=(START_US + scenario.start_offset_us) / US)
    model = Model(scenario.rules)
    all_limits = [limit for limits in scenario.rules.values() for limit in limits]
    prefix = f"p-{uuid.uuid4().hex[:8]}"
    refused: tuple[list[str], int, int, int] | None = None  # ids, weight, retry µs, step
    async with Limiter(url, scenario.rules, prefix=prefix, clock=clock) as limiter:
        calls = {"acquire": limiter.try_acquire, "peek": limiter.peek, "refund": limiter.refund}

        async def call(number: int, action: str, ids: list[str], weight: int) -> Outcome:
            now = await clock.now_us()
            assert now is not None
            decision = await calls[action](ids, weight)
            outcome: Outcome = getattr(model, action)(ids, weight, now)
            where = f"step {number}: {action}({ids}, {weight}) at +{now - START_US} µs"
            assert observed(decision) == expected(outcome), where
            check_summary(decision, [verdict for _, verdict in outcome.pairs])
            limits = [limit for i in dict.fromkeys(ids) for limit in model.limits_for(i)]
            for limit, (_, verdict) in zip(limits, outcome.pairs, strict=True):
                event(f"{action} {type(limit).__name__} {'ok' if verdict.allowed else 'refused'}")
            return outcome

        for number, step in enumerate(scenario.steps):
            now = await clock.now_us()
            assert now is not None
            action = step[0]
            if action in calls:
                ids, weight = step[1], 1 + (step[2] - 1) % model.max_weight(step[1])
                outcome = await call(number, action, ids, weight)
                if action == "acquire" and not outcome.allowed:
                    retry = max(v.retry_us for _, v in outcome.pairs if not v.allowed)
                    refused = (ids, weight, retry, number)
            elif action == "advance":
                clock.advance(step[1] / US)
            elif action == "edge":
                clock.advance(edge_advance(all_limits, step[1], step[2], now) / US)
            elif refused is not None:
                # Wait the refusal's retry_after (or 1 µs less) and ask again.
                ids, weight, retry, at = refused
                clock.advance((retry + step[1]) / US)
                outcome = await call(number, "acquire", ids, weight)
                if at == number - 1:  # nothing happened in between: retry_after is exact
                    assert outcome.allowed == (step[1] == 0), f"step {number}: retry_after"
                refused = None


@settings(
    max_examples=12,  # x 5 algorithms in focus = 60 programs per store
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
@pytest.mark.parametrize("focus", KINDS)
def test_every_decision_matches_the_reference_model(
    store_url: str, focus: str, data: st.DataObject
) -> None:
    """Random programs of acquire/peek/refund and clock moves decide exactly as the model does."""
    scenario = data.draw(scenarios(focus), label="scenario")
    asyncio.run(run(store_url, scenario))


# --- the model itself, against numbers worked out by hand ------------------------------------


def test_model_sliding_window_by_hand() -> None:
    """The model's sliding counter: 4/10 s in 1 s buckets, refused until the oldest bucket goes."""
    model = Model({"*": [Limit(4, per=10, precision=1)]})
    t = START_US + 2_500_000
    assert model.acquire(["x"], 3, t).allowed
    assert model.acquire(["x"], 1, t + 5 * US).pairs[0][1] == Verdict(True, 0, 0, 9_500_000)
    refused = model.acquire(["x"], 2, t + 6 * US).pairs[0][1]
    # bucket 2 (3 units) leaves at 12 s; now is 8.5 s
    assert refused == Verdict(False, 0, 3_500_000, 8_500_000)


def test_model_token_bucket_by_hand() -> None:
    """The model's GCRA: 3/s with burst 2: the third at once waits ceil(1/3 s) in µs."""
    model = Model({"*": [TokenBucket(3, per=1, burst=2)]})
    assert model.acquire(["x"], 2, START_US).pairs[0][1] == Verdict(True, 0, 0, 666_667)
    assert model.acquire(["x"], 1, START_US).pairs[0][1] == Verdict(False, 0, 333_334, 666_667)
    assert model.acquire(["x"], 1, START_US + 333_334).allowed
