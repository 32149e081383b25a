"""The inference engine: sampling, jitted prefill/decode steps over the cache, and `generate`."""
