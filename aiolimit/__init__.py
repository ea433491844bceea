"""aiolimit: asyncio-native distributed rate limiting on Redis and Redis Cluster.

Several identifiers, each under several limits, decided all or nothing in one script call per
slot. See the README for the quickstart.
"""

from aiolimit._algorithms import Concurrency, FixedWindow, MinInterval, SlidingLog, TokenBucket
from aiolimit._authority import AuthorityClock
from aiolimit._clock import Clock, LocalClock, ServerClock
from aiolimit._decision import Decision, PairDecision
from aiolimit._errors import (
    AiolimitError,
    BackendError,
    BackendUnavailable,
    ConfigurationError,
    InvalidRequestError,
    LeaseExpired,
    RateLimited,
    UsageError,
    WeightNeverFits,
)
from aiolimit._lease import Lease
from aiolimit._limiter import Acquisition, Limiter, LimiterStatistics
from aiolimit._limits import BaseLimit, Limit, parse_limits
from aiolimit._ruleset import Override, RulesError, RuleSet

__all__ = [
    "Acquisition",
    "AiolimitError",
    "AuthorityClock",
    "BackendError",
    "BackendUnavailable",
    "BaseLimit",
    "Clock",
    "Concurrency",
    "ConfigurationError",
    "Decision",
    "FixedWindow",
    "InvalidRequestError",
    "Lease",
    "LeaseExpired",
    "Limit",
    "Limiter",
    "LimiterStatistics",
    "LocalClock",
    "MinInterval",
    "Override",
    "PairDecision",
    "RateLimited",
    "RuleSet",
    "RulesError",
    "ServerClock",
    "SlidingLog",
    "TokenBucket",
    "UsageError",
    "WeightNeverFits",
    "parse_limits",
]
__version__ = "0.2.0"
