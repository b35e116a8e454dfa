"""``psflow.distribute.experimental.coordinator``: TensorFlow's coordinator namespace."""

from psflow.distribute.coordinator import (
    ClusterCoordinator,
    PerWorkerValues,
    RemoteValue,
    RemoteValueStatus,
)
