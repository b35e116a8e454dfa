"""``psflow.train``: checkpoints of variables and optimizer state, local or on parameter servers."""

from psflow.train.checkpoint import Checkpoint, latest_checkpoint
from psflow.train.manager import CheckpointManager
from psflow.train.restore import CheckpointLoadStatus
