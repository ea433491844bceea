"""The package's import rules, read from the source: layers import one way only.

adapters (``starlette``, ``aiohttp``, ``_web``, the ``cli``) -> limiter -> protocol (and
leases) -> stores; the embedded engine stands alone; clocks never reach into stores; only the
stores, the connection module and the TIME authority talk to redis-py; no store reads a
call's ARGV.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "aiolimit"

ADAPTERS = ("aiolimit.starlette", "aiolimit.aiohttp", "aiolimit._web", "aiolimit.cli")
STORES = ("aiolimit._stores",)
CLOCKS = ("aiolimit._clock", "aiolimit._authority", "aiolimit.testing")
REDIS_ALLOWED = ("aiolimit._stores", "aiolimit._connection", "aiolimit._authority")
#: What a store may take from the calling-convention module: the script, never the layout.
#: (``resend_args``: the convention's own way to send a call again, the layout hidden in it.)
STORE_MAY_USE_FROM_CALLS = {"decide_library", "decide_script", "Library", "Script", "resend_args"}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _type_checking_only(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return True
    return False


def imports(name: str, path: Path) -> Iterator[tuple[str, set[str]]]:
    """(imported module, names taken from it) for every import executed at run time."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if _type_checking_only(node, parents):
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, set()
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            names = {alias.name for alias in node.names}
            yield base, names
            for alias in node.names:  # "from aiolimit import _x" imports a module too
                yield f"{base}.{alias.name}", set()


def within(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def all_imports() -> list[tuple[str, str, set[str]]]:
    found = modules()
    return [
        (name, target, names)
        for name, path in found.items()
        for target, names in imports(name, path)
        if target in found or target.split(".")[0] == "redis"
    ]


IMPORTS = all_imports()


def violations(rule: str) -> list[str]:
    out = []
    for source, target, names in IMPORTS:
        bad = False
        if rule == "adapters" and not within(source, ADAPTERS):
            bad = within(target, ADAPTERS)
        elif rule == "limiter":
            bad = target == "aiolimit._limiter" and not (
                within(source, ADAPTERS) or source == "aiolimit"
            )
        elif rule == "protocol":
            bad = within(target, ("aiolimit._protocol", "aiolimit._lease")) and (
                within(source, STORES) or within(source, CLOCKS)
            )
        elif rule == "embedded":
            bad = within(source, ("aiolimit._embedded",)) and (
                target.startswith("aiolimit") and not within(target, ("aiolimit._embedded",))
            )
        elif rule == "clocks":
            bad = within(source, CLOCKS) and within(target, STORES)
        elif rule == "redis":
            bad = target.split(".")[0] == "redis" and not within(source, REDIS_ALLOWED)
        elif rule == "argv":
            bad = (
                within(source, STORES)
                and target == "aiolimit._calls"
                and not names <= STORE_MAY_USE_FROM_CALLS
            )
        if bad:
            out.append(f"{source} imports {target} {sorted(names) or ''}")
    return out


@pytest.mark.parametrize(
    "rule",
    ["adapters", "limiter", "protocol", "embedded", "clocks", "redis", "argv"],
)
def test_imports_run_one_way(rule: str) -> None:
    """No module imports against the layering (see the module docstring)."""
    assert violations(rule) == []


def test_the_rules_see_the_imports() -> None:
    """The rules are checked against real edges: the known ones are found."""
    edges = {(source, target) for source, target, _ in IMPORTS}
    assert ("aiolimit._limiter", "aiolimit._protocol") in edges
    assert ("aiolimit._protocol", "aiolimit._stores.base") in edges
    assert ("aiolimit._stores.redis", "redis.asyncio") in edges
    assert ("aiolimit._embedded.store", "aiolimit._embedded.sandbox") in edges


def test_stores_never_read_a_calls_arguments() -> None:
    """Store code never indexes a call's args (the script's ARGV is _calls' business)."""
    for name, path in modules().items():
        if not within(name, STORES):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Subscript):
                target = ast.unparse(node.value)
                assert not target.endswith("args"), f"{name}: {ast.unparse(node)}"
