"""Decisions: what the limiter answered, and what the caller should do next."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import MISSING, dataclass, field, fields
from typing import TYPE_CHECKING, Any, NamedTuple

from aiolimit._limits import BaseLimit

if TYPE_CHECKING:
    from aiolimit._lease import Lease
    from aiolimit._rules import IdentifierPlan


class PairDecision(NamedTuple):
    """The verdict of one (identifier, limit) pair within a decision (an immutable tuple).

    ``remaining`` is what is left after this request (if it was admitted). ``retry_after`` is
    how long until this pair alone would admit the same weight (0.0 if it allows it now);
    ``reset_after`` is how long until this pair is back to its full amount.
    """

    identifier: str
    limit: BaseLimit
    allowed: bool
    remaining: int
    retry_after: float
    reset_after: float


class Charge:
    """What an admission charged, kept on its ``Decision`` for ``refund(decision=)``: the
    limiter's protocol that made it, the plans and the weight charged, and per identifier
    the weight not given back yet (made on the first refund). Copies of the decision share
    it, so no copy gives back more than was charged."""

    __slots__ = ("left", "owner", "plans", "weight")

    def __init__(self, owner: object, plans: Sequence[IdentifierPlan], weight: int) -> None:
        self.owner = owner
        self.plans = plans
        self.weight = weight
        self.left: dict[str, int] | None = None

    def __reduce__(self) -> tuple[type[None], tuple[()]]:
        # A pickled (or deep-copied) decision leaves its charge behind (the protocol holds a
        # connection): it reads the same, and a refund through it is refused.
        return (type(None), ())


@dataclass(frozen=True, slots=True)
class Decision:
    """The answer to one call, over every (identifier, limit) pair, all or nothing.

    - ``allowed``: admitted and charged on every pair; if False, nothing was charged anywhere.
    - ``remaining``: the smallest remaining over all pairs, after this request.
    - ``retry_after``: seconds to wait before the same request can pass: 0.0 when allowed,
      otherwise the largest over the refusing pairs.
    - ``reset_after``: seconds until every pair is back to its full amount.
    - ``identifier``/``limit``: the binding pair: the refusing pair with the longest wait, or,
      when allowed, the pair with the least remaining.
    - ``details``: every pair's own verdict.
    - ``degraded``: the store could not be asked and the failure policy decided instead.
    - ``lease``: under a ``Concurrency`` limit, the slots this admission holds; release them.
    - ``denied``: refused by the rules' deny list (``identifier`` says which); waiting cannot
      help (``retry_after`` is infinite).
    - ``shadow_refusals``: the pairs of shadow rules that refused this request; it was admitted
      (and charged under the enforced rules) anyway.
    """

    allowed: bool
    remaining: int
    retry_after: float
    reset_after: float
    identifier: str | None
    limit: BaseLimit | None
    details: tuple[PairDecision, ...] = ()
    degraded: bool = False
    lease: Lease | None = None
    denied: bool = False
    shadow_refusals: tuple[PairDecision, ...] = ()
    #: What an admission charged (see ``Charge``); set by the limiter, not part of the answer.
    _charge: Charge | None = field(default=None, repr=False, compare=False)

    def __bool__(self) -> bool:
        return self.allowed

    @classmethod
    def from_pairs(cls, details: tuple[PairDecision, ...]) -> Decision:
        """Merges per-pair verdicts into the decision for the whole call."""
        if not details:
            return cls(True, 0, 0.0, 0.0, None, None, ())
        binding = details[0]
        allowed = True
        remaining = binding.remaining
        reset_after = binding.reset_after
        for pair in details:
            if pair.remaining < remaining:
                remaining = pair.remaining
            if pair.reset_after > reset_after:
                reset_after = pair.reset_after
            if not pair.allowed:
                if allowed or pair.retry_after > binding.retry_after:
                    binding = pair
                allowed = False
            elif allowed and pair.remaining < binding.remaining:
                binding = pair
        return cls(
            allowed,
            remaining,
            0.0 if allowed else binding.retry_after,
            reset_after,
            binding.identifier,
            binding.limit,
            details,
        )


def _made_decision() -> Callable[..., Decision]:
    """``made_decision(allowed, remaining, retry_after, reset_after, identifier, limit,
    details, charge)``: a ``Decision`` with every other field at its default, and its charge.

    A frozen dataclass's ``__init__`` sets each of its 12 fields through
    ``object.__setattr__`` (about 1.7 µs here); this sets them through the slots' own
    descriptors (about 0.6 µs), and the charge with them rather than after. Every decision the
    store answers is made here. Generated from ``dataclasses.fields(Decision)``, so a field
    added to ``Decision`` is set here too, to its default (``tests/test_decision_make.py``
    compares the two ways field by field).
    """
    given = ("allowed", "remaining", "retry_after", "reset_after", "identifier", "limit",
             "details")  # fmt: skip
    namespace: dict[str, Any] = {"_new": object.__new__, "Decision": Decision}
    lines = [f"def made_decision({', '.join(given)}, charge=None):", "    self = _new(Decision)"]
    for item in fields(Decision):
        setter = f"_set_{item.name}"
        namespace[setter] = getattr(Decision, item.name).__set__
        if item.name in given:
            value = item.name
        elif item.name == "_charge":
            value = "charge"
        elif item.default is not MISSING:
            namespace[f"_default_{item.name}"] = item.default
            value = f"_default_{item.name}"
        else:  # pragma: no cover - a new field without a default must be given: fail loudly
            raise TypeError(f"Decision.{item.name} has no plain default; give it in made_decision")
        lines.append(f"    {setter}(self, {value})")
    lines.append("    return self")
    exec("\n".join(lines), namespace)  # (code made above from the field names alone)
    made: Callable[..., Decision] = namespace["made_decision"]
    return made


made_decision = _made_decision()
