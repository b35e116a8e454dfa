"""``psflow.distribute.experimental``: TensorFlow's experimental distribution names."""

import importlib as _importlib

from psflow.collective import CommunicationImplementation, CommunicationOptions

CollectiveCommunication = CommunicationImplementation

_LAZY = {
    "coordinator": "psflow.distribute.experimental.coordinator",
    "partitioners": "psflow.distribute.partitioners",
}


def __getattr__(name: str):
    if name in _LAZY:
        return _importlib.import_module(_LAZY[name])
    if name == "ParameterServerStrategy":
        from psflow.distribute.parameter_server_strategy import ParameterServerStrategy

        return ParameterServerStrategy
    if name == "PreemptionCheckpointHandler":
        from psflow.distribute.elastic.preemption import PreemptionCheckpointHandler

        return PreemptionCheckpointHandler
    if name in ("ElasticOptions", "BatchPolicy", "MembershipChange"):
        from psflow.distribute import elastic

        return getattr(elastic, name)
    if name == "MultiWorkerMirroredStrategy":
        from psflow.distribute.multi_worker_mirrored_strategy import MultiWorkerMirroredStrategy

        return MultiWorkerMirroredStrategy
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
