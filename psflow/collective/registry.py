"""The registry of cross-device op implementations, and the default choice.

Factories are plain functions that import their backend when called, so that
CuPy and NCCL stay optional: ``import psflow.collective`` never imports CuPy.

Example:
    >>> from psflow.collective import create_cross_device_ops
    >>> create_cross_device_ops("reduce_to_one").name
    'reduce_to_one'
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from psflow import errors
from psflow.collective.api import CrossDeviceOps
from psflow.collective.options import CommunicationImplementation, CommunicationOptions

logger = logging.getLogger(__name__)

Factory = Callable[..., CrossDeviceOps]


def _ring(**kwargs: Any) -> CrossDeviceOps:
    from psflow.collective.ring import RingAllReduce

    return RingAllReduce(**kwargs)


def _reduce_to_one(**kwargs: Any) -> CrossDeviceOps:
    from psflow.collective.reduce_to_one import ReductionToOneDevice

    return ReductionToOneDevice(**kwargs)


def _nccl(**kwargs: Any) -> CrossDeviceOps:
    from psflow.collective.nccl import NcclAllReduce

    return NcclAllReduce(**kwargs)


class CrossDeviceOpsRegistry:
    """Names to factories of :class:`CrossDeviceOps`; names are case-insensitive."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._factories: dict[str, Factory] = {}

    def register(self, name: str, factory: Factory) -> None:
        """Registers ``factory`` under ``name``.

        Raises:
            AlreadyExistsError: ``name`` is registered to another factory.
        """
        key = name.strip().lower()
        with self._lock:
            old = self._factories.get(key)
            if old is not None and old is not factory:
                raise errors.AlreadyExistsError(f"cross-device ops {name!r} is already registered")
            self._factories[key] = factory

    def create(self, name: str, **kwargs: Any) -> CrossDeviceOps:
        """Builds the implementation registered under ``name``.

        Raises:
            NotFoundError: no such name (the message lists the registered ones).
        """
        key = str(name).strip().lower()
        with self._lock:
            factory = self._factories.get(key)
            names = sorted(self._factories)
        if factory is None:
            raise errors.NotFoundError(
                f"no cross-device ops named {name!r}; registered: {', '.join(names)}"
            )
        return factory(**kwargs)

    def names(self) -> list[str]:
        """The registered names, sorted."""
        with self._lock:
            return sorted(self._factories)


def _default_registry() -> CrossDeviceOpsRegistry:
    reg = CrossDeviceOpsRegistry()
    reg.register("ring", _ring)
    reg.register("reduce_to_one", _reduce_to_one)
    reg.register("nccl", _nccl)
    return reg


cross_device_ops_registry = _default_registry()
"""The registry ``create_cross_device_ops`` uses (built-ins: ring, reduce_to_one, nccl)."""


def register_cross_device_ops(name: str, factory: Factory) -> None:
    """Registers an implementation under ``name`` (see :class:`CrossDeviceOpsRegistry`)."""
    cross_device_ops_registry.register(name, factory)


def create_cross_device_ops(name: str, **kwargs: Any) -> CrossDeviceOps:
    """Builds the implementation registered under ``name`` with ``kwargs``.

    Raises:
        NotFoundError: no such name; the message lists the registered ones.
    """
    return cross_device_ops_registry.create(name, **kwargs)


def nccl_available() -> bool:
    """Whether CuPy imports, sees a GPU and has NCCL (never raises)."""
    try:
        import cupy
        from cupy.cuda import nccl

        return bool(nccl.available) and cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no CuPy, no driver, no NCCL build
        return False


def default_cross_device_ops(
    devices: Sequence[Any], options: CommunicationOptions | None = None, **kwargs: Any
) -> CrossDeviceOps:
    """The cross-device ops for replicas on ``devices``.

    NCCL for distinct GPUs when CuPy has NCCL, else the ring.  ``options``'
    ``implementation`` forces ``RING`` or ``NCCL``.

    Raises:
        InvalidArgumentError: a device spec cannot be parsed, or no devices.
        FailedPreconditionError: NCCL was asked for and is not available.
    """
    from psflow.collective.copies import device_kind

    if isinstance(devices, str) or not devices:
        raise errors.InvalidArgumentError(f"devices must be a non-empty sequence, got {devices!r}")
    parsed = [device_kind(d) for d in devices]
    impl = (options or CommunicationOptions()).implementation
    if options is not None:
        kwargs.setdefault("options", options)
    if impl is CommunicationImplementation.NCCL:
        return create_cross_device_ops("nccl", **kwargs)
    all_gpu = all(t == "GPU" for t, _ in parsed)
    distinct = len(set(parsed)) == len(parsed)
    auto = impl is CommunicationImplementation.AUTO
    if auto and all_gpu and distinct and len(parsed) > 1 and nccl_available():
        logger.debug("cross-device ops for %s: nccl", devices)
        return create_cross_device_ops("nccl", **kwargs)
    logger.debug("cross-device ops for %s: ring", devices)
    return create_cross_device_ops("ring", **kwargs)
