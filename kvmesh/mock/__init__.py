"""The simulated engine: an OpenAI-compatible server over a paged KV cache with prefix caching."""
