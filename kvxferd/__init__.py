"""kvxferd: a per-node daemon that moves LLM KV caches from prefill to decode engines."""

__version__ = "0.1.0"
