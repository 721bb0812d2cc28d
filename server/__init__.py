"""kvscale.server: the inference engine (paged KV cache, scheduler, model runner) and its HTTP server."""
