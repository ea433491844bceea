"""The ``aiolimit`` command line: what an operator asks of a running limiter's Redis.

``pip install 'aiolimit-redis[cli]'``, then::

    aiolimit inspect user:42 ip:203.0.113.7   # each pair's state now, with TTL and memory
    aiolimit reset user:42 --yes              # forget what is stored for it
    aiolimit rules check rules.toml           # validate a rules file
    aiolimit rules push rules.toml            # show the diff, confirm, publish to every process
    aiolimit rules show                       # the rules document in Redis
    aiolimit bench --seconds 5                # a short load with a progress bar and a summary

The server comes from ``--url`` or ``AIOLIMIT_URL`` (default ``redis://127.0.0.1:6379/0``,
``redis+cluster://`` for a cluster), the key prefix from ``--prefix`` or ``AIOLIMIT_PREFIX``
(default ``aiolimit``). ``--json`` prints one JSON document on stdout instead of tables, on
every path (an error is ``{"error": ..., "exit_code": n}``). ``--timeout`` (default 5 s) bounds
the wait for any one answer of the server.

Exit codes: 0 done; 1 invalid input (rules that do not validate, an identifier without
limits, no rules document); 2 wrong usage; 3 the server cannot be reached or failed;
4 not done on purpose (a push or reset not confirmed, or the rules changed meanwhile).
"""

from __future__ import annotations

import asyncio
import difflib
import json
import math
import secrets
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Annotated, Any, NoReturn, TypeVar

try:
    import typer
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
    from rich.table import Table
except ImportError as exc:  # pragma: no cover - depends on what is installed
    raise SystemExit(
        f"the aiolimit command line needs typer and rich: pip install 'aiolimit-redis[cli]' ({exc})"
    ) from exc

from aiolimit._connection import CLUSTER_SCHEMES, scheme_of
from aiolimit._errors import AiolimitError, BackendError, ConfigurationError, InvalidRequestError
from aiolimit._follow import (
    Document,
    fingerprint,
    parse_document,
    publish,
    read_document,
    read_overrides,
    read_raw_document,
    split,
)
from aiolimit._limiter import Limiter
from aiolimit._ruleset import RulesError, RuleSet

OK, INVALID, USAGE, UNREACHABLE, NOT_DONE = 0, 1, 2, 3, 4
DEFAULT_URL = "redis://127.0.0.1:6379/0"
#: Seconds to wait for any one answer of the server before giving up with exit 3.
DEFAULT_TIMEOUT = 5.0

app = typer.Typer(
    name="aiolimit",
    help="Inspect and operate aiolimit's rate limits in Redis.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
rules_app = typer.Typer(help="Rules as data: check a file, push it to Redis, show what is there.")
app.add_typer(rules_app, name="rules")

out = Console()
err = Console(stderr=True)
T = TypeVar("T")


class Settings:
    url: str = DEFAULT_URL
    prefix: str = "aiolimit"
    json: bool = False
    timeout: float = DEFAULT_TIMEOUT


settings = Settings()


@app.callback()
def options(
    url: Annotated[
        str, typer.Option(envvar="AIOLIMIT_URL", help="The Redis (or Redis Cluster) URL.")
    ] = DEFAULT_URL,
    prefix: Annotated[
        str, typer.Option(envvar="AIOLIMIT_PREFIX", help="The limiters' key prefix.")
    ] = "aiolimit",
    json_output: Annotated[
        bool, typer.Option("--json", help="One JSON document on stdout instead of tables.")
    ] = False,
    timeout: Annotated[
        float,
        typer.Option(
            envvar="AIOLIMIT_TIMEOUT",
            min=0.01,
            max=300,
            help="Seconds to wait for any one answer of the server (then exit 3).",
        ),
    ] = DEFAULT_TIMEOUT,
) -> None:
    settings.url, settings.prefix, settings.json = url, prefix, json_output
    settings.timeout = timeout


# -- plumbing ------------------------------------------------------------------------------


def fail(code: int, message: str, **fields: Any) -> NoReturn:
    """Ends the command with ``code``: with ``--json``, one document (``fields`` and the
    error) on stdout, and nothing else is printed there."""
    if settings.json:
        emit({**fields, "error": message, "exit_code": code})
    else:
        err.print(f"[bold red]error:[/] {message}", highlight=False, markup=True)
    raise typer.Exit(code)


def run(work: Callable[[], Awaitable[T]]) -> T:
    """Runs one command's coroutine; the library's errors become exit codes."""
    try:
        return asyncio.run(_bounded(work))
    except (RulesError, InvalidRequestError) as exc:
        fail(INVALID, str(exc))
    except BackendError as exc:
        fail(UNREACHABLE, f"{settings.url}: {exc}")
    except TimeoutError:
        fail(UNREACHABLE, f"{settings.url}: no answer within {settings.timeout:g} s")
    except ConfigurationError as exc:
        fail(INVALID, str(exc))
    except AiolimitError as exc:  # pragma: no cover - any other library error
        fail(INVALID, str(exc))


async def _bounded(work: Callable[[], Awaitable[T]]) -> T:
    return await work()


def open_limiter(rules: RuleSet | None = None, **options: Any) -> Limiter:
    """A limiter on the configured server; the rules document there wins over ``rules``.

    No per-decision deadline but a socket timeout: every read and write of every command
    (the rules document, a push's staging, a reset's UNLINK) gives up after ``--timeout``
    seconds, so a server that stopped answering ends the command with exit 3.
    """
    fallback = rules if rules is not None else {"*": "1/second"}
    return Limiter(
        _store(settings), fallback, prefix=settings.prefix, follow_rules=True, deadline=None,
        socket_timeout=settings.timeout, rules_interval=3600, **options,
    )  # fmt: skip


def _store(settings: Any) -> Any:
    """The server URL, or for a cluster its store: a cluster client retries redirections and
    failovers for its own budget (5 s by default), which ``--timeout`` bounds too."""
    if scheme_of(settings.url) in CLUSTER_SCHEMES:
        from aiolimit._stores.cluster import ClusterStore

        return ClusterStore.from_url(
            settings.url, socket_timeout=settings.timeout, deadline=settings.timeout
        )
    return settings.url


def load_rules(load: Callable[[], RuleSet], what: str = "") -> RuleSet:
    """Rules from an option or a file; ones that do not validate are exit 1."""
    try:
        return load()
    except RulesError as exc:
        text = str(exc)
        fail(INVALID, text if not what or text.startswith(what) else f"{what}: {text}")


def emit(document: Any) -> None:
    print(json.dumps(document, indent=2, sort_keys=True, default=str))


def seconds_text(seconds: float) -> str:
    if math.isinf(seconds):
        return "never"
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 120:
        return f"{seconds:.1f} s"
    return f"{seconds / 60:.1f} min"


def confirmed(question: str, yes: bool) -> bool:
    if yes:
        return True
    if not sys.stdin.isatty():
        return False
    return typer.confirm(question, default=False)


# -- inspect / reset -----------------------------------------------------------------------


@app.command()
def inspect(
    identifiers: Annotated[list[str], typer.Argument(help="Identifiers, e.g. user:42 ip:1.2.3.4")],
    rules_file: Annotated[
        Path | None,
        typer.Option("--rules", help="Rules file to judge by when Redis holds no rules document."),
    ] = None,
    limits: Annotated[
        str | None,
        typer.Option(help='Limits for every identifier instead, e.g. "10/second;100/minute".'),
    ] = None,
) -> None:
    """Every (identifier, limit) pair's state now: remaining, reset, TTL and memory."""
    fallback = None
    if rules_file is not None:
        fallback = load_rules(lambda: RuleSet.from_file(rules_file), str(rules_file))
    elif limits is not None:
        fallback = load_rules(lambda: RuleSet.from_mapping({"kinds": {"*": limits}}), "--limits")

    async def work() -> list[dict[str, Any]]:
        async with open_limiter(fallback) as limiter:
            await limiter.peek(identifiers[0])  # reads the rules document, if any
            if limiter.statistics().rules_version is None and fallback is None:
                fail(INVALID, "no rules document in Redis under this prefix: pass --rules FILE "
                     "or --limits, or push rules first")  # fmt: skip
            report = []
            for identifier in identifiers:
                decision = await limiter.peek(identifier)
                keys = limiter.storage_keys(identifier)
                ttl = [await limiter.store.command("PTTL", key) for key in keys]
                memory = [await limiter.store.command("MEMORY", "USAGE", key) for key in keys]
                report.append(
                    {
                        "identifier": identifier,
                        "denied": decision.denied,
                        "exempt": not decision.details and not decision.denied,
                        "keys": [
                            {"key": k, "ttl_ms": t, "memory_bytes": m or 0}
                            for k, t, m in zip(keys, ttl, memory, strict=True)
                        ],
                        "pairs": [
                            {
                                "limit": str(pair.limit),
                                "amount": pair.limit.amount,
                                "remaining": pair.remaining,
                                "reset_after": pair.reset_after,
                                "allowed": pair.allowed,
                                "retry_after": pair.retry_after,
                            }
                            for pair in decision.details
                        ],
                    }
                )
            return report

    report = run(work)
    if settings.json:
        emit({"identifiers": report})
        return
    for entry in report:
        table = Table(title=f"[bold]{entry['identifier']}[/]", title_justify="left")
        for column in ("limit", "remaining", "resets in", "next 1 in"):
            table.add_column(column, justify="right" if column != "limit" else "left")
        for pair in entry["pairs"]:
            table.add_row(
                pair["limit"],
                f"{pair['remaining']} / {pair['amount']}",
                seconds_text(pair["reset_after"]),
                "now" if pair["allowed"] else seconds_text(pair["retry_after"]),
            )
        if entry["denied"]:
            table.add_row("[red]denied by the rules[/]", "-", "-", "never")
        elif entry["exempt"]:
            table.add_row("[green]exempt (allow list)[/]", "-", "-", "now")
        out.print(table)
        for key in entry["keys"]:
            ttl = key["ttl_ms"]
            state = "absent" if ttl == -2 else ("no expiry" if ttl == -1 else f"TTL {ttl} ms")
            out.print(f"  {key['key']}: {state}, {key['memory_bytes']} bytes", highlight=False)


@app.command()
def reset(
    identifiers: Annotated[list[str], typer.Argument(help="Identifiers to forget.")],
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask.")] = False,
) -> None:
    """Forgets everything stored for the identifiers (their budgets start full)."""
    if not confirmed(f"Reset {len(identifiers)} identifier(s) under {settings.prefix!r}?", yes):
        fail(NOT_DONE, "not confirmed (pass --yes when not at a terminal)")

    async def work() -> None:
        async with open_limiter(RuleSet.from_mapping({"kinds": {"*": "1/second"}})) as limiter:
            await limiter.reset(identifiers)

    run(work)
    if settings.json:
        emit({"reset": identifiers})
    else:
        out.print(f"reset {', '.join(identifiers)}", highlight=False)


# -- rules ---------------------------------------------------------------------------------


def describe(
    rules: RuleSet, overrides: int | None = None, version: str | None = None
) -> dict[str, Any]:
    return {
        "version": rules.version if version is None else version,
        "shadow": rules.shadow,
        "kinds": {kind: [str(limit) for limit in limits] for kind, limits in rules.kinds.items()},
        "shadow_kinds": sorted(rules.shadow_kinds),
        "overrides": len(rules.exact) if overrides is None else overrides,
        "networks": len(rules.networks),
    }


def print_rules(rules: RuleSet, overrides: int | None = None, version: str | None = None) -> None:
    version = rules.version if version is None else version
    table = Table(title=f"rules {version[:12]}", title_justify="left")
    table.add_column("kind")
    table.add_column("limits")
    table.add_column("shadow")
    for kind, limits in rules.kinds.items():
        shadow = "yes" if rules.shadow or kind in rules.shadow_kinds else ""
        table.add_row(kind, ", ".join(map(str, limits)), shadow)
    out.print(table)
    count = len(rules.exact) if overrides is None else overrides
    out.print(f"{count} identifier override(s), {len(rules.networks)} network rule(s)")


@rules_app.command("check")
def rules_check(
    file: Annotated[Path, typer.Argument(help="A .toml or .json rules file.")],
) -> None:
    """Validates a rules file (exit 1 and the key at fault when it is not valid)."""
    rules = load_rules(lambda: RuleSet.from_file(file), str(file))
    if settings.json:
        emit({"valid": True, **describe(rules)})
    else:
        out.print(f"[green]valid[/] {file}", highlight=False)
        print_rules(rules)


def rules_lines(rules: RuleSet | None) -> list[str]:
    """The rules as sorted lines, one fact each: what the push diff compares."""
    if rules is None:
        return []
    lines = [f"shadow (whole limiter): {'yes' if rules.shadow else 'no'}"]
    for kind, limits in rules.kinds.items():
        shadow = " (shadow)" if kind in rules.shadow_kinds else ""
        lines.append(f"kind {kind}{shadow}: {', '.join(map(str, limits))}")
    entries = [*rules.exact.items(), *((f"{k}:{n}", o) for k, n, o in rules.networks)]
    for identifier, override in entries:
        if override.deny:
            lines.append(f"deny {identifier}")
        elif override.exempt and override.limits is None and override.scale is None:
            lines.append(f"allow {identifier}")
        else:
            parts = []
            if override.limits is not None:
                parts.append("limits " + ", ".join(map(str, override.limits)))
            if override.scale is not None:
                parts.append(f"scale {override.scale:g}")
            if override.shadow:
                parts.append("shadow")
            lines.append(f"override {identifier}: {'; '.join(parts)}")
    return sorted(lines)


def stored_rules(document: Document | None, overrides: dict[str, str]) -> RuleSet | None:
    """The rules in Redis as one RuleSet: the document and its identifier overrides."""
    if document is None:
        return None
    canonical = json.loads(json.dumps(document.raw["rules"]))
    canonical["overrides"] = {
        **canonical.get("overrides", {}),
        **{identifier: json.loads(value) for identifier, value in overrides.items()},
    }
    return RuleSet.from_mapping(canonical)


@rules_app.command("push")
def rules_push(
    file: Annotated[Path, typer.Argument(help="A .toml or .json rules file.")],
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Publish without asking.")] = False,
) -> None:
    """Shows the diff against the rules in Redis, then publishes the file to every process."""
    try:
        rules = RuleSet.from_file(file)
    except RulesError as exc:
        text = str(exc) if str(exc).startswith(str(file)) else f"{file}: {exc}"
        fail(INVALID, f"{text} (nothing was pushed)")

    async def current() -> tuple[bytes | None, Document | None, dict[str, str]]:
        async with open_limiter() as limiter:
            raw = await read_raw_document(limiter.store, settings.prefix)
            try:
                document = None if raw is None else parse_document(raw)
            except RulesError:
                return raw, None, {}  # invalid (e.g. a newer format): replaced as a whole
            overrides = await read_overrides(limiter.store, settings.prefix) if document else {}
            return raw, document, overrides

    raw, document, overrides = run(current)
    before = rules_lines(stored_rules(document, overrides))
    if raw is not None and document is None:
        try:
            parse_document(raw)
        except RulesError as exc:
            before = [f"invalid document in Redis (replaced as a whole): {exc}"]
    diff = list(
        difflib.unified_diff(before, rules_lines(rules), "in Redis", str(file), lineterm="", n=1)
    )
    if document is not None and document.version == rules.version:
        if settings.json:
            emit({"pushed": False, "unchanged": True, "version": rules.version})
        else:
            out.print(f"unchanged: Redis already holds version {rules.version[:12]}")
        return
    if not settings.json:
        for line in diff[:400]:
            style = "green" if line.startswith("+") else "red" if line.startswith("-") else None
            out.print(line, style=style, highlight=False, markup=False)
        if len(diff) > 400:
            out.print(f"... {len(diff) - 400} more diff lines")
    if not confirmed("Publish these rules to every limiter?", yes):
        fail(NOT_DONE, "not confirmed (pass --yes when not at a terminal); nothing was pushed",
             pushed=False, diff=diff)  # fmt: skip
    # The compare-and-set names what the diff was made against: its version, none, or the
    # bytes of a document that could not be read (its version cannot be trusted).
    if raw is None:
        expect = ""
    elif document is None:
        expect = fingerprint(raw)
    else:
        expect = document.version

    async def push() -> bool:
        async with open_limiter() as limiter:
            return await publish(limiter.store, settings.prefix, rules, expect=expect)

    if not run(push):
        fail(NOT_DONE, "the rules in Redis changed since the diff was made; nothing was pushed")
    _, exact = split(rules)
    if settings.json:
        emit({"pushed": True, "version": rules.version, "overrides": len(exact), "diff": diff})
    else:
        out.print(f"[green]pushed[/] version {rules.version[:12]} ({len(exact)} overrides)")


@rules_app.command("show")
def rules_show(
    overrides: Annotated[
        bool, typer.Option("--overrides", help="Also list every identifier override.")
    ] = False,
) -> None:
    """The rules document in Redis under the prefix (exit 1 when there is none)."""

    async def work() -> tuple[Document | None, dict[str, str]]:
        async with open_limiter() as limiter:
            document = await read_document(limiter.store, settings.prefix)
            listed = await read_overrides(limiter.store, settings.prefix) if overrides else {}
            return document, listed

    document, listed = run(work)
    if document is None:
        fail(INVALID, f"no rules document under prefix {settings.prefix!r}")
    if settings.json:
        shown = {
            **describe(document.rules, document.override_count, document.version),
            "rules": document.raw,
        }
        if overrides:
            shown["identifier_overrides"] = {k: json.loads(v) for k, v in listed.items()}
        emit(shown)
        return
    print_rules(document.rules, document.override_count, document.version)
    for identifier, value in sorted(listed.items()):
        out.print(f"  {identifier}: {value}", highlight=False)


# -- bench ---------------------------------------------------------------------------------


@app.command()
def bench(
    seconds: Annotated[float, typer.Option(min=0.1, max=600, help="How long to load.")] = 5.0,
    concurrency: Annotated[int, typer.Option(min=1, max=10_000, help="Tasks at once.")] = 32,
    identifiers: Annotated[int, typer.Option(min=1, help="Distinct identifiers.")] = 1000,
    limits: Annotated[str, typer.Option(help="The limits each identifier gets.")] = "100/second",
) -> None:
    """A short load against the server, with a progress bar and a summary table.

    Keys go under ``<prefix>:bench:<random>`` and are deleted at the end.
    """
    rules = load_rules(lambda: RuleSet.from_mapping({"kinds": {"*": limits}}), "--limits")
    prefix = f"{settings.prefix}:bench:{secrets.token_hex(4)}"

    async def work() -> dict[str, Any]:
        latencies: list[float] = []
        counts = {"allowed": 0, "refused": 0, "errors": 0}
        async with Limiter(
            _store(settings), rules, prefix=prefix, deadline=None, socket_timeout=settings.timeout
        ) as limiter:
            await limiter.peek("bench:0")  # connect first: a dead server fails here, at once
            started = time.perf_counter()
            deadline = started + seconds

            async def worker(index: int) -> None:
                n = index
                while time.perf_counter() < deadline:
                    n += concurrency
                    at = time.perf_counter()
                    try:
                        decision = await limiter.try_acquire(f"bench:{n % identifiers}")
                    except BackendError:
                        counts["errors"] += 1
                        continue
                    latencies.append(time.perf_counter() - at)
                    counts["allowed" if decision.allowed else "refused"] += 1

            tasks = [asyncio.create_task(worker(i)) for i in range(concurrency)]
            with Progress(
                TextColumn("load"), BarColumn(), TextColumn("{task.fields[rate]}"),
                TimeRemainingColumn(), console=err, disable=settings.json, transient=True,
            ) as progress:  # fmt: skip
                bar = progress.add_task("load", total=seconds, rate="")
                while not all(task.done() for task in tasks):
                    await asyncio.sleep(0.1)
                    elapsed = min(seconds, time.perf_counter() - started)
                    rate = f"{len(latencies) / max(elapsed, 1e-9):,.0f} decisions/s"
                    progress.update(bar, completed=elapsed, rate=rate)
            await asyncio.gather(*tasks)
            elapsed = time.perf_counter() - started
            for start in range(0, identifiers, 500):
                await limiter.reset(
                    [f"bench:{i}" for i in range(start, min(identifiers, start + 500))]
                )
        latencies.sort()

        def quantile(q: float) -> float:
            return (
                latencies[min(len(latencies) - 1, int(q * len(latencies)))] * 1000
                if latencies
                else 0
            )

        total = counts["allowed"] + counts["refused"]
        return {
            "server": settings.url,
            "seconds": round(elapsed, 3),
            "concurrency": concurrency,
            "identifiers": identifiers,
            "limits": limits,
            "decisions": total,
            "decisions_per_second": round(total / elapsed, 1),
            **counts,
            "p50_ms": round(quantile(0.5), 3),
            "p99_ms": round(quantile(0.99), 3),
            "max_ms": round(latencies[-1] * 1000, 3) if latencies else 0,
        }

    summary = run(work)
    if settings.json:
        emit(summary)
        return
    table = Table(title="aiolimit bench", title_justify="left")
    table.add_column("measure")
    table.add_column("value", justify="right")
    for name in ("server", "seconds", "concurrency", "identifiers", "limits", "decisions",
                 "decisions_per_second", "allowed", "refused", "errors", "p50_ms", "p99_ms",
                 "max_ms"):  # fmt: skip
        value = summary[name]
        if name == "decisions_per_second":
            value = f"{value:,.0f}"
        table.add_row(
            name.replace("_", " "), f"{value:,}" if isinstance(value, int) else str(value)
        )
    out.print(table)


def main() -> None:
    """The console script's entry point."""
    app()


if __name__ == "__main__":
    main()
