"""nxd-ckpt: NxD-compatible, crash-safe, async checkpointing for PyTorch/XLA on Trainium."""
from ._version import __version__
