"""kvxferd: a per-node daemon that moves LLM KV caches from prefill to decode engines."""

from kvxfer_protocol.version import PACKAGE_VERSION as __version__

__all__ = ["__version__"]
