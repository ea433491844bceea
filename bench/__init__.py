"""Benchmarks for aiolimit and its peers (run from the repo root: ``python -m bench.bench``).

``bench._measure`` holds the measuring helpers (timing loop, percentiles, client CPU, INFO
commandstats deltas, client-side command counts, key cleanup, MEMORY USAGE); ``bench._peers``
holds one adapter per limiter library. Other benchmarks (cluster, web) reuse both.
"""
