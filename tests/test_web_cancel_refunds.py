"""A request cancelled while its layers are being judged (a request-timeout scope around the
app) is not admitted, so every charge made for it comes back: with three limiters, the first
two admitted it and the third is still deciding (its store answers late) when the scope
cancels the request. The cleanup runs inside the cancelled scope, where every ``await`` is
cancelled again: each refund must be started before the first is awaited."""

from __future__ import annotations

import asyncio

from fastapi import Depends, FastAPI

from aiolimit import Limit, Limiter
from aiolimit.starlette import CLIENT_IP, RateLimit, RateLimitMiddleware
from tests._proxy import Proxy
from tests.test_web_lease_ends import with_request_timeout
from tests.test_web_starlette import serve

IP = "127.0.0.1"
FIVE = [Limit(5, per=60)]


async def test_a_request_cancelled_while_judged_gets_every_earlier_charge_back(
    redis_url: str, standalone_proxy: Proxy, prefix: str
) -> None:
    fast = [Limiter(redis_url, {"ip": FIVE}, prefix=f"{prefix}{i}", deadline=5.0) for i in range(2)]
    # The third limiter's store answers 1.5 s late: the request is cancelled while it decides.
    slow = Limiter(standalone_proxy.url, {"ip": FIVE}, prefix=f"{prefix}2", deadline=5.0)
    limiters = [*fast, slow]
    assert (await slow.peek(f"ip:{IP}")).remaining == 5  # (connected and loaded before)

    app = FastAPI()

    @app.get(
        "/",
        dependencies=[
            Depends(RateLimit(fast[1], keys={"ip": CLIENT_IP})),
            Depends(RateLimit(slow, keys={"ip": CLIENT_IP})),
        ],
    )
    async def root() -> dict[str, bool]:
        return {"ok": True}

    app.add_middleware(RateLimitMiddleware, limiter=fast[0])

    try:
        async with serve(with_request_timeout(app, 0.5)) as client:
            standalone_proxy.delay = 1.5
            response = await client.get("/")
            standalone_proxy.delay = 0.0
            left: list[int] = []
            for _ in range(40):  # (the slow limiter undoes its late charge in the background)
                left = [(await limiter.peek(f"ip:{IP}")).remaining for limiter in limiters]
                if left == [5, 5, 5]:
                    break
                await asyncio.sleep(0.1)
    finally:
        for limiter in limiters:
            await limiter.aclose()
    assert response.status_code == 504
    assert left == [5, 5, 5], f"charges kept for a request that was never admitted: {left}"
