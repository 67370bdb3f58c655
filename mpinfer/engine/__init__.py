"""The engine: rank 0's queue and step loop (engine.py), what runs next (scheduler.py) over the
KV cache's blocks (blocks.py), every rank's step runner (runner.py), sampling (sampling.py),
the request types (request.py) and incremental detokenization (detok.py). Nothing here knows
HTTP or terminals."""
