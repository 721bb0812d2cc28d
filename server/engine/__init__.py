"""The engine: the core process's step loop and what runs around it (outputs, stats, KV events), and
the front end's client of that process. Under the entry points, over the worker and the core
(docs/architecture.md "The engine's layers")."""
