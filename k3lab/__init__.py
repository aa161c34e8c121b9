"""k3lab: convert Moonshot's Kimi-K3 to GGUF losslessly, shard by shard, and look inside while doing so."""

from __future__ import annotations

__version__ = "0.1.0"
