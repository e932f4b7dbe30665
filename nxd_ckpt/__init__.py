"""nxd-ckpt: NxD-compatible, crash-safe, async checkpointing for PyTorch/XLA on Trainium."""
from ._version import __version__
from .api import (finalize_checkpoint, has_checkpoint, list_checkpoints, load_checkpoint, newest_checkpoint,
                  release_host_buffers, save_checkpoint, save_stats)
from .errors import (CheckpointArgumentError, CheckpointError, CheckpointNotFoundError, CorruptCheckpointError,
                     IncompleteCheckpointError, RankFailureError, StateMismatchError, TopologyMismatchError,
                     UnsafeCheckpointError)

__all__ = [
    "__version__", "save_checkpoint", "load_checkpoint", "finalize_checkpoint", "has_checkpoint",
    "list_checkpoints", "newest_checkpoint", "release_host_buffers", "save_stats", "CheckpointError", "CheckpointArgumentError",
    "CheckpointNotFoundError", "CorruptCheckpointError", "IncompleteCheckpointError", "RankFailureError",
    "StateMismatchError", "TopologyMismatchError", "UnsafeCheckpointError",
]
