"""Cross-device collectives: ring all-reduce, reduction to one device, NCCL.

Replicas hand in raw arrays (NumPy on logical CPU devices, CuPy on GPUs) in one
of two styles:

* a **batch call** from one thread on every replica's arrays:
  ``RingAllReduce().all_reduce([[g0_r0, g1_r0], [g0_r1, g1_r1]])``;
* a **collective call** from each of N replica threads on a shared
  :class:`Communicator`: ``comm.all_reduce(rank, [g0, g1])``.

Example:
    >>> import numpy as np
    >>> import psflow.collective as coll
    >>> ops = coll.default_cross_device_ops(["/cpu:0", "/cpu:1"])
    >>> ops.all_reduce([[np.ones(2)], [np.ones(2)]], coll.ReduceOp.MEAN)[0][0]
    array([1., 1.])
"""

from psflow.collective.api import CrossDeviceOps
from psflow.collective.communicator import Communicator
from psflow.collective.options import (
    DEFAULT_TIMEOUT_SECONDS,
    CommunicationImplementation,
    CommunicationOptions,
)
from psflow.collective.reduce_op import ReduceOp
from psflow.collective.reduce_to_one import ReductionToOneDevice
from psflow.collective.registry import (
    CrossDeviceOpsRegistry,
    create_cross_device_ops,
    cross_device_ops_registry,
    default_cross_device_ops,
    nccl_available,
    register_cross_device_ops,
)
from psflow.collective.ring import RingAllReduce


def __getattr__(name: str):
    # NcclAllReduce's module imports nothing heavy, but keep it off the eager path.
    if name == "NcclAllReduce":
        from psflow.collective.nccl import NcclAllReduce

        return NcclAllReduce
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "DEFAULT_TIMEOUT_SECONDS",
    "CommunicationImplementation",
    "CommunicationOptions",
    "Communicator",
    "CrossDeviceOps",
    "CrossDeviceOpsRegistry",
    "NcclAllReduce",
    "ReduceOp",
    "ReductionToOneDevice",
    "RingAllReduce",
    "create_cross_device_ops",
    "cross_device_ops_registry",
    "default_cross_device_ops",
    "nccl_available",
    "register_cross_device_ops",
]
