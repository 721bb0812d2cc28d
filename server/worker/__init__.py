"""The model worker: the model built from its files, one forward pass over a step's batch, the CPU
projections and the sampler. Over the core (docs/architecture.md "The engine's layers")."""
