"""The in-process Lua engine behind ``memory://``: runs ``lua/`` on an in-memory keyspace.

Self-contained: it imports nothing from the rest of aiolimit. It implements the Redis commands
the scripts call and no others.
"""
