"""kvlink: move LLM KV caches from prefill to decode instances over NIXL."""
__version__ = "0.1.0"
