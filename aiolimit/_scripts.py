"""The script loader: builds the one decision script from ``lua/`` and names it by SHA1.

``lua/`` is the single source of truth. The files are concatenated in a fixed order (the
prelude, every algorithm, then the ``decide`` entry point) into one script, so one call judges
any mix of algorithms atomically. It is read and hashed once per process.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import cache
from importlib.resources import files
from importlib.resources.abc import Traversable

# Order matters: algorithms register themselves in ALGORITHMS, defined by the prelude.
ALGORITHM_FILES = ("sliding_window.lua", "gcra.lua", "sliding_log.lua", "concurrency.lua")
SCRIPT_FILES = ("prelude.lua", *ALGORITHM_FILES, "decide.lua")


def lua_dir() -> Traversable:
    """The scripts as package data, ``aiolimit/lua``, read one way wherever the package is.

    A wheel holds the files there; in a checkout (and an editable install) ``aiolimit/lua`` is a
    committed symlink to the top-level ``lua/``, which stays the single source of truth.
    """
    directory = files("aiolimit") / "lua"
    if not (directory / "decide.lua").is_file():
        raise FileNotFoundError(
            f"aiolimit's Lua scripts are missing from its package data ({directory}): in a "
            "checkout, aiolimit/lua must be the symlink to ../lua (git config core.symlinks)"
        )
    return directory


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
