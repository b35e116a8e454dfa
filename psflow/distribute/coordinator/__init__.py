"""The coordinator of parameter-server training: closures, remote values, workers."""

from psflow.distribute.coordinator.cluster_coordinator import ClusterCoordinator
from psflow.distribute.coordinator.remote_value import (
    PerWorkerValues,
    RemoteValue,
    RemoteValueStatus,
)
