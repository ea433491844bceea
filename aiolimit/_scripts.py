"""The script loader: builds the one decision script from ``lua/`` and names it by SHA1.

``lua/`` is the single source of truth. The files are concatenated in a fixed order (the
prelude, every algorithm, then the ``decide`` entry point) into one script, so one call judges
any mix of algorithms atomically. It is read and hashed once per process.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import cache
from pathlib import Path

# Order matters: algorithms register themselves in ALGORITHMS, defined by the prelude.
ALGORITHM_FILES = ("sliding_window.lua", "gcra.lua", "sliding_log.lua", "concurrency.lua")
SCRIPT_FILES = ("prelude.lua", *ALGORITHM_FILES, "decide.lua")


def lua_dir() -> Path:
    """``aiolimit/lua`` in an installed wheel, else ``lua/`` beside the package (a checkout)."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "lua", here.parent / "lua"):
        if (candidate / "decide.lua").is_file():
            return candidate
    raise FileNotFoundError(f"aiolimit's Lua scripts are missing (looked in {here}/lua and ../lua)")


@dataclass(frozen=True, slots=True)
class Script:
    """A script's source and SHA1, as EVALSHA and SCRIPT LOAD want them."""

    source: str
    sha: str


@cache
def decide_script() -> Script:
    """The decision script (built once per process)."""
    base = lua_dir()
    source = "\n".join((base / name).read_text(encoding="utf-8") for name in SCRIPT_FILES)
    return Script(source, hashlib.sha1(source.encode("utf-8")).hexdigest())
