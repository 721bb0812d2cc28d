"""Structured outputs: a grammar constrains which tokens a sequence may sample next.

The engine side of ``response_format`` / ``structured_outputs`` / tool calls. One narrow interface
hides the grammar library (backend.py, llguidance), which is handed a schema with the keywords
it refuses rewritten into exact equivalents where that is proven (schema_rewrites.py); around it:
the compile pool and cache (compiler.py), the per-step batch bitmask (bitmask.py) and the
engine-facing bookkeeping of a matcher per sequence (manager.py). A request's constraint arrives as plain data
(``SamplingParams.structured_outputs``), so it crosses a process boundary unchanged.

The package imports nothing itself: the HTTP front end reads its settings from
``kvscale.server.config.StructuredOutputsConfig`` and must not pull in manager.py, whose bitmask
work needs torch.
"""
