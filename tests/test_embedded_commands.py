"""The embedded engine's command table is exactly what ``lua/`` calls, plus DEL for ``reset``.

If a script starts calling a command the engine lacks, or the engine keeps one no script
calls, this fails: the engine does what the scripts need, not all of Redis.
"""

from __future__ import annotations

import re

from aiolimit._calls import SCRIPT_FILES, lua_dir
from aiolimit._embedded.commands import COMMANDS

CALL = re.compile(r"redis\.p?call\(\s*")
NAMED_CALL = re.compile(r"""redis\.p?call\(\s*(['"])([A-Za-z]+)\1""")
#: The prelude's helper that sends a long argument list in slices: call_batched('ZADD', ...).
BATCHED_CALL = re.compile(r"""call_batched\(\s*(['"])([A-Za-z]+)\1""")
#: redis.call(command, ...) inside call_batched itself: the only calls with a variable name.
VARIABLE_CALL = re.compile(r"redis\.p?call\(\s*command\b")
#: Not called by a script: the limiter's reset deletes an identifier's keys with DEL.
FOR_RESET = {"DEL"}
#: Plain strings: no script keeps one since op records moved into the identifiers' hashes,
#: but the differential tests plant and read values with them (and plant wrong types).
FOR_TESTS = {"GET", "SET"}


def script_commands() -> set[str]:
    """Every command name in a redis.call / redis.pcall of the shipped scripts."""
    names: set[str] = set()
    for name in SCRIPT_FILES:
        source = (lua_dir() / name).read_text(encoding="utf-8")
        calls, named = CALL.findall(source), NAMED_CALL.findall(source)
        variable = VARIABLE_CALL.findall(source) if name == "prelude.lua" else []
        assert len(calls) == len(named) + len(variable), (
            f"{name}: a redis.call whose command is not a literal"
        )
        names.update(command.upper() for _, command in named)
        names.update(command.upper() for _, command in BATCHED_CALL.findall(source))
    return names


def test_the_scripts_call_commands() -> None:
    """The scan finds the commands (TIME included), so an empty match cannot pass silently."""
    assert {"TIME", "HSET", "ZADD", "PEXPIRE"} <= script_commands()


def test_command_table_is_what_the_scripts_call() -> None:
    """The engine implements each command the scripts call, plus DEL (reset) and GET/SET
    (the tests' plain strings), and nothing else."""
    table = {name.decode().upper() for name in COMMANDS}
    assert table == script_commands() | FOR_RESET | FOR_TESTS
