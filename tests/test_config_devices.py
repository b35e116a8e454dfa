"""``psflow.config``: physical and logical devices, their configuration, and its errors."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest

import psflow as pf
from psflow import config, errors
from tests.conftest import ROOT, child_env


@pytest.fixture(autouse=True)
def clean_config(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every test starts with no configuration and no PSFLOW_NUM_CPU_DEVICES, and leaves none."""
    monkeypatch.delenv("PSFLOW_NUM_CPU_DEVICES", raising=False)
    monkeypatch.setattr(config, "_logical", {})
    monkeypatch.setattr(config, "_visible", {})
    yield


def cpu() -> config.PhysicalDevice:
    return config.list_physical_devices("CPU")[0]


def test_physical_devices_list_one_cpu_and_every_gpu() -> None:
    devices = config.list_physical_devices()
    assert devices[0] == config.PhysicalDevice("/physical_device:CPU:0", "CPU")
    gpus = config.list_physical_devices("GPU")
    assert gpus == [d for d in devices if d.device_type == "GPU"]
    assert [d.name for d in gpus] == [f"/physical_device:GPU:{i}" for i in range(len(gpus))]
    assert config.list_physical_devices("cpu") == [devices[0]]  # any case


def test_one_logical_cpu_by_default() -> None:
    assert config.list_logical_devices("CPU") == [config.LogicalDevice("/device:CPU:0", "CPU")]
    assert config.get_logical_device_configuration(cpu()) is None
    assert pf.distribute.MirroredStrategy().num_replicas_in_sync == max(
        1, len(config.list_logical_devices("GPU"))
    )


def test_set_logical_device_configuration_splits_the_cpu() -> None:
    configs = [config.LogicalDeviceConfiguration(memory_limit=64) for _ in range(3)]
    config.set_logical_device_configuration(cpu(), configs)
    assert [d.name for d in config.list_logical_devices("CPU")] == [
        "/device:CPU:0",
        "/device:CPU:1",
        "/device:CPU:2",
    ]
    assert config.get_logical_device_configuration(cpu()) == configs
    if not config.list_logical_devices("GPU"):
        assert config.default_devices() == [f"/device:CPU:{i}" for i in range(3)]
        assert pf.distribute.MirroredStrategy().num_replicas_in_sync == 3
    # configuring again is allowed in psflow (TensorFlow allows it only before initialization)
    config.set_virtual_device_configuration(cpu(), [config.LogicalDeviceConfiguration()] * 2)
    assert len(config.list_logical_devices("CPU")) == 2
    config.set_logical_device_configuration(cpu(), None)
    assert len(config.list_logical_devices("CPU")) == 1


def test_environment_variable_sets_the_logical_cpu_count(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PSFLOW_NUM_CPU_DEVICES", "4")
    assert len(config.list_logical_devices("CPU")) == 4
    # an explicit configuration wins over the environment
    config.set_logical_device_configuration(cpu(), [config.LogicalDeviceConfiguration()] * 2)
    assert len(config.list_logical_devices("CPU")) == 2


@pytest.mark.parametrize(("raw", "pattern"), [("abc", "'abc'"), ("0", "got 0"), ("-2", "got -2")])
def test_bad_environment_variable_is_named(
    monkeypatch: pytest.MonkeyPatch, raw: str, pattern: str
) -> None:
    monkeypatch.setenv("PSFLOW_NUM_CPU_DEVICES", raw)
    with pytest.raises(errors.InvalidArgumentError, match=f"PSFLOW_NUM_CPU_DEVICES.*{pattern}"):
        config.list_logical_devices()


@pytest.mark.parametrize(
    ("device", "logical", "pattern"),
    [
        (config.PhysicalDevice("/physical_device:CPU:9", "CPU"), None, "CPU:9"),
        ("/physical_device:CPU:0", None, "'/physical_device:CPU:0'"),
        (None, [], "at least one logical device"),
    ],
)
def test_bad_configuration_is_rejected_and_changes_nothing(
    device: object, logical: object, pattern: str
) -> None:
    config.set_logical_device_configuration(cpu(), [config.LogicalDeviceConfiguration()] * 2)
    with pytest.raises(errors.InvalidArgumentError, match=pattern):
        config.set_logical_device_configuration(device or cpu(), logical)  # type: ignore[arg-type]
    assert len(config.list_logical_devices("CPU")) == 2


def test_visible_devices() -> None:
    assert config.get_visible_devices("CPU") == [cpu()]
    config.set_visible_devices([cpu()], "CPU")
    assert config.get_visible_devices() == [cpu(), *config.list_physical_devices("GPU")]
    config.set_visible_devices([], "GPU")
    assert config.get_visible_devices("GPU") == []
    assert config.list_logical_devices("GPU") == []


def test_experimental_namespace() -> None:
    exp = config.experimental
    assert exp.list_physical_devices("CPU") == [cpu()]
    assert exp.list_logical_devices("CPU") == config.list_logical_devices("CPU")
    exp.set_memory_growth(cpu(), True)
    assert exp.get_memory_growth(cpu()) is True


def test_mirrored_strategy_in_a_process_configured_by_environment() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "seeds" / "mirrored_num_replicas.py")],
        capture_output=True,
        text=True,
        timeout=120,
        env=child_env({"PSFLOW_NUM_CPU_DEVICES": "3", "CUDA_VISIBLE_DEVICES": ""}),
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["3"]
