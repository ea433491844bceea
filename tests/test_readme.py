"""The README's promises: its quickstart runs, and its two commands are the ones CI uses."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import anyio

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")


def quickstart() -> str:
    match = re.search(r"## Quickstart\n\n```python\n(.*?)```", README, re.S)
    assert match, "README has no Quickstart python block"
    return match.group(1)


async def test_quickstart_runs_against_a_real_server(redis_url: str, prefix: str) -> None:
    """The quickstart, pointed at the test server, runs to the end without error."""
    code = quickstart().replace("redis://127.0.0.1:6379/0", redis_url)
    code = code.replace('prefix="quickstart"', f"prefix={prefix!r}")
    assert redis_url in code
    # The quickstart calls asyncio.run itself, so run it in a worker thread with its own loop.
    await anyio.to_thread.run_sync(lambda: exec(compile(code, "README.md", "exec"), {}))


def test_first_two_commands_are_demo_and_test() -> None:
    """The README's first code block holds the demo and test commands, and CI runs the latter."""
    first = re.search(r"```bash\n(.*?)```", README, re.S)
    assert first
    commands = [line.split("#")[0].strip() for line in first.group(1).splitlines()]
    assert commands[:2] == ["bash dev.sh demo", "bash dev.sh test"]
    assert "bash dev.sh test" in (ROOT / ".ci" / "run").read_text(encoding="utf-8")


def web_example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", README, re.S)
    assert len(blocks) >= 2, "README has no web example"
    return blocks[1]


async def test_web_example_serves_limited_requests(redis_url: str) -> None:
    """The README's FastAPI app answers through the middleware with RateLimit headers."""
    import httpx

    namespace: dict[str, object] = {}
    code = web_example().replace("redis://127.0.0.1:6379/0", redis_url)
    exec(compile(code, "README.md", "exec"), namespace)
    limiter = namespace["limiter"]
    transport = httpx.ASGITransport(app=namespace["api"])  # type: ignore[arg-type]
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            response = await client.get("/report", headers={"x-user": "readme"})
        assert response.status_code == 200
        assert response.json() == {"report": "ready"}
        assert "ratelimit-policy" in response.headers
        assert "ratelimit" in response.headers
        routes = namespace["app"].router.routes()  # type: ignore[attr-defined]
        assert {route.resource.canonical for route in routes} == {"/search"}
    finally:
        await limiter.aclose()  # type: ignore[attr-defined]


def test_limited_example_runs() -> None:
    """The README's limited() example (an outgoing API under a quota) runs as written."""
    blocks = [b for b in re.findall(r"```python\n(.*?)```", README, re.S) if ".limited(" in b]
    assert len(blocks) == 1, "README has one limited() example"
    namespace: dict[str, object] = {}
    exec(compile(blocks[0], "README.md", "exec"), namespace)
    asyncio.run(namespace["main"]())  # type: ignore[operator]
