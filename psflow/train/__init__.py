"""``psflow.train``: checkpoints of variables and optimizer state, local or on parameter servers."""

from psflow.train.checkpoint import Checkpoint, CheckpointLoadStatus, latest_checkpoint
from psflow.train.manager import CheckpointManager
