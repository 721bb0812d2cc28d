"""The entry points: `kvscale serve`'s HTTP front end (the OpenAI API), the CLI commands and the offline
`LLM`. The top layer of the engine (docs/architecture.md "The engine's layers")."""
