"""Helpers for tests and the demo: a reference ZeRO-1-format Adam that runs on CPU-XLA."""
from .zero1_adam import ZeroOneAdam, ZeroOneEPAdam, shard_of, unshard

__all__ = ["ZeroOneAdam", "ZeroOneEPAdam", "shard_of", "unshard"]
