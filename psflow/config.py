"""Devices: ``psflow.config`` with TensorFlow's ``tf.config`` names.

Without GPUs the CPU can be split into N *logical* devices, which is how
MirroredStrategy is exercised on machines with no accelerator::

    cpu = pf.config.list_physical_devices("CPU")[0]
    pf.config.set_logical_device_configuration(cpu, [pf.config.LogicalDeviceConfiguration()] * 4)

A whole process can be configured with the environment variable
``PSFLOW_NUM_CPU_DEVICES=4`` instead. GPUs are found through CuPy when it
imports and a driver is present; they too can be split into logical devices.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

from psflow import backend, errors, settings


@dataclasses.dataclass(frozen=True)
class PhysicalDevice:
    """A device of this machine (``/physical_device:CPU:0``)."""

    name: str
    device_type: str


@dataclasses.dataclass(frozen=True)
class LogicalDevice:
    """A device computations are placed on (``/device:CPU:1``)."""

    name: str
    device_type: str


@dataclasses.dataclass(frozen=True)
class LogicalDeviceConfiguration:
    """One logical device carved out of a physical one (``memory_limit`` is recorded only)."""

    memory_limit: int | None = None
    experimental_priority: int | None = None
    experimental_device_ordinal: int | None = None


_lock = threading.Lock()
_logical: dict[str, list[LogicalDeviceConfiguration]] = {}
_visible: dict[str, list[PhysicalDevice]] = {}


def _env_cpu_count() -> int:
    return settings.current().num_cpu_devices


def list_physical_devices(device_type: str | None = None) -> list[PhysicalDevice]:
    """The machine's devices: one CPU, and every GPU CuPy sees."""
    devices = [PhysicalDevice("/physical_device:CPU:0", "CPU")]
    devices += [
        PhysicalDevice(f"/physical_device:GPU:{i}", "GPU") for i in range(backend.gpu_count())
    ]
    if device_type is not None:
        devices = [d for d in devices if d.device_type == device_type.upper()]
    return devices


def get_visible_devices(device_type: str | None = None) -> list[PhysicalDevice]:
    """The physical devices psflow may use (all unless restricted)."""
    out = []
    for kind in ("CPU", "GPU"):
        if device_type is not None and device_type.upper() != kind:
            continue
        out += _visible.get(kind, list_physical_devices(kind))
    return out


def set_visible_devices(devices: Any, device_type: str | None = None) -> None:
    """Restricts the physical devices of a type psflow may use."""
    devices = [devices] if isinstance(devices, PhysicalDevice) else list(devices)
    kinds = {device_type.upper()} if device_type else {d.device_type for d in devices} or {"GPU"}
    with _lock:
        for kind in kinds:
            _visible[kind] = [d for d in devices if d.device_type == kind]
        _update_gpu_map()


def set_logical_device_configuration(
    device: PhysicalDevice, logical_devices: list[LogicalDeviceConfiguration] | None
) -> None:
    """Splits a physical device into logical devices (``None`` undoes it).

    Raises:
        InvalidArgumentError: an unknown device or an empty list.
    """
    if not isinstance(device, PhysicalDevice) or device not in list_physical_devices():
        raise errors.InvalidArgumentError(f"Unknown physical device {device!r}")
    with _lock:
        if logical_devices is None:
            _logical.pop(device.name, None)
        else:
            configs = list(logical_devices)
            if not configs:
                raise errors.InvalidArgumentError(
                    f"{device.name}: give at least one logical device"
                )
            _logical[device.name] = configs
        _update_gpu_map()


set_virtual_device_configuration = set_logical_device_configuration


def get_logical_device_configuration(
    device: PhysicalDevice,
) -> list[LogicalDeviceConfiguration] | None:
    """The logical split of a physical device, or ``None``."""
    return _logical.get(device.name)


def list_logical_devices(device_type: str | None = None) -> list[LogicalDevice]:
    """Logical devices: CPUs (split by configuration or ``PSFLOW_NUM_CPU_DEVICES``) and GPUs."""
    out: list[LogicalDevice] = []
    cpu = PhysicalDevice("/physical_device:CPU:0", "CPU")
    n_cpu = len(_logical[cpu.name]) if cpu.name in _logical else _env_cpu_count()
    out += [LogicalDevice(f"/device:CPU:{i}", "CPU") for i in range(n_cpu)]
    n_gpu = len(_gpu_map())
    out += [LogicalDevice(f"/device:GPU:{i}", "GPU") for i in range(n_gpu)]
    if device_type is not None:
        out = [d for d in out if d.device_type == device_type.upper()]
    return out


def _gpu_map() -> list[int]:
    mapping: list[int] = []
    for dev in get_visible_devices("GPU"):
        index = int(dev.name.rsplit(":", 1)[1])
        mapping += [index] * len(_logical.get(dev.name, [None]))
    return mapping


def _update_gpu_map() -> None:
    if backend.gpu_count():
        backend.set_gpu_map(_gpu_map())


class experimental:  # noqa: N801 - TensorFlow's namespace tf.config.experimental
    """``tf.config.experimental`` functions kept for compatibility."""

    list_physical_devices = staticmethod(list_physical_devices)
    list_logical_devices = staticmethod(list_logical_devices)
    set_visible_devices = staticmethod(set_visible_devices)
    get_visible_devices = staticmethod(get_visible_devices)

    @staticmethod
    def set_memory_growth(device: PhysicalDevice, enable: bool) -> None:
        """Accepted; CuPy's memory pool grows on demand anyway."""

    @staticmethod
    def get_memory_growth(device: PhysicalDevice) -> bool:
        """Always True: CuPy's pool grows on demand."""
        return True


def default_devices() -> list[str]:
    """MirroredStrategy's default: every logical GPU, else every logical CPU device."""
    gpus = list_logical_devices("GPU")
    devices = gpus or list_logical_devices("CPU")
    return [d.name for d in devices]
