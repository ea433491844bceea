"""The README's promises: its quickstart runs, and its two commands are the ones CI uses."""

from __future__ import annotations

import asyncio
import re
import time
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


def web_examples() -> tuple[str, str]:
    """The README's FastAPI block and its aiohttp block (which uses the FastAPI one's limiter)."""
    blocks = re.findall(r"```python\n(.*?)```", README, re.S)
    fastapi = [b for b in blocks if "RateLimitMiddleware" in b]
    aiohttp = [b for b in blocks if "rate_limit_middleware" in b]
    assert len(fastapi) == 1 and len(aiohttp) == 1, "README has one FastAPI and one aiohttp example"
    return fastapi[0], aiohttp[0]


def one_field_set(headers: list[tuple[str, str]]) -> dict[str, int]:
    """The single RateLimit field's remaining per policy; asserts the policies match it."""
    policies = [v for k, v in headers if k.lower() == "ratelimit-policy"]
    limits = [v for k, v in headers if k.lower() == "ratelimit"]
    assert len(policies) == 1 and len(limits) == 1, headers
    names = [item.split(";")[0].strip().strip('"') for item in policies[0].split(",")]
    assert len(names) == len(set(names)), names
    left = {}
    for item in limits[0].split(","):
        name, *params = item.strip().split(";")
        left[name.strip('"')] = int(dict(p.split("=") for p in params)["r"])
    assert sorted(left) == sorted(names)
    return left


async def test_web_examples_give_one_field_set_under_uvicorn_and_aiohttp(
    redis_url: str, prefix: str
) -> None:
    """The README's web apps, run as written under real uvicorn and aiohttp servers."""
    import httpx
    import uvicorn
    from aiohttp import web

    fastapi_code, aiohttp_code = web_examples()
    # The README's per-minute limits are calendar-aligned: start well inside a minute.
    into_minute = time.time() % 60
    if into_minute > 55:
        await asyncio.sleep(60.05 - into_minute)
    namespace: dict[str, object] = {}
    code = fastapi_code.replace("redis://127.0.0.1:6379/0", redis_url).replace(
        "on_error=", f"prefix={prefix!r}, on_error="
    )
    exec(compile(code, "README.md", "exec"), namespace)
    exec(compile(aiohttp_code, "README.md", "exec"), namespace)
    limiter = namespace["limiter"]
    config = uvicorn.Config(
        namespace["api"], host="127.0.0.1", port=0, log_level="critical", lifespan="on"
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    runner = web.AppRunner(namespace["app"], access_log=None)  # type: ignore[arg-type]
    try:
        with anyio.fail_after(10):
            while not server.started:
                assert not task.done()
                await asyncio.sleep(0.005)
        port = server.servers[0].sockets[0].getsockname()[1]
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        aio_port = runner.addresses[0][1]
        user = {"x-user": "readme"}
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            reports = [await client.get("/report", headers=user) for _ in range(6)]
            health = await client.get("/health")
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{aio_port}") as client:
            search = await client.get("/search")
            ping = await client.get("/ping")
        assert [r.status_code for r in reports] == [200] * 5 + [429]
        assert reports[0].json() == {"report": "ready"}
        first = one_field_set(reports[0].headers.multi_items())
        assert first["user-100-per-60s"] == 99 and first["GET__report-5-per-3600s"] == 4
        last = one_field_set(reports[4].headers.multi_items())
        assert last["user-100-per-60s"] == 95 and last["GET__report-5-per-3600s"] == 0
        refused = reports[5]
        assert refused.headers["content-type"] == "application/problem+json"
        assert refused.json()["violated-policies"] == ["GET__report-5-per-3600s"]
        # The refusal charged nothing: the user still has 95 of 100.
        assert (await limiter.peek("user:readme")).remaining == 95  # type: ignore[attr-defined]
        assert "ratelimit" not in health.headers
        found = one_field_set(search.headers.multi_items())
        assert found["GET__search-30-per-60s"] == 25  # weight 5, on its own limit too
        assert ping.status_code == 200 and "ratelimit" not in ping.headers
    finally:
        server.should_exit = True
        await task  # the lifespan closed the limiter
        await runner.cleanup()
    assert limiter._closed  # type: ignore[attr-defined]


def test_limited_example_runs() -> None:
    """The README's limited() example (an outgoing API under a quota) runs as written."""
    blocks = [b for b in re.findall(r"```python\n(.*?)```", README, re.S) if ".limited(" in b]
    assert len(blocks) == 1, "README has one limited() example"
    namespace: dict[str, object] = {}
    exec(compile(blocks[0], "README.md", "exec"), namespace)
    asyncio.run(namespace["main"]())  # type: ignore[operator]
