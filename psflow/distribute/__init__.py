"""``psflow.distribute``: strategies, distributed values, the coordinator and cluster resolvers."""

from psflow.collective import (
    CommunicationImplementation,
    CommunicationOptions,
    CrossDeviceOps,
    ReductionToOneDevice,
    RingAllReduce,
)
from psflow.distribute import cluster_resolver, coordinator, experimental
from psflow.distribute.distribute_lib import (
    InputContext,
    InputOptions,
    OneDeviceStrategy,
    ReplicaContext,
    RunOptions,
    Strategy,
    StrategyExtended,
    get_replica_context,
    get_strategy,
    has_strategy,
    in_cross_replica_context,
)
from psflow.distribute.mirrored_strategy import MirroredStrategy
from psflow.distribute.multi_worker_mirrored_strategy import MultiWorkerMirroredStrategy
from psflow.distribute.parameter_server_strategy import ParameterServerStrategy
from psflow.distribute.ps.values import ShardedVariable
from psflow.distribute.reduce_util import ReduceOp
from psflow.distribute.sync_on_read import SyncOnReadVariable
from psflow.distribute.values import MirroredVariable, PerReplica
