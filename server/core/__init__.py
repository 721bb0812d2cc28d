"""The core: which sequences run each step, and the KV cache they run on (blocks, prefix hits, the
host tier). The bottom layer of the engine; it imports no other layer (docs/architecture.md
"The engine's layers")."""
