"""The framework-neutral web core that ``aiolimit.starlette`` and ``aiolimit.aiohttp`` adapt."""
