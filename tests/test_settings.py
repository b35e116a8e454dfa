"""psflow.settings: the PSFLOW_* process variables, parsed once, validated, injectable."""

from __future__ import annotations

import doctest

import pytest

from psflow import errors, settings


def test_settings_doctests():
    result = doctest.testmod(settings)
    assert result.failed == 0 and result.attempted > 0


def test_defaults_when_nothing_is_set():
    assert settings.ProcessSettings.from_environment({}) == settings.ProcessSettings()


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("PSFLOW_NUM_CPU_DEVICES", "two", "PSFLOW_NUM_CPU_DEVICES must be an integer, got 'two'"),
        ("PSFLOW_NUM_CPU_DEVICES", "0", "PSFLOW_NUM_CPU_DEVICES must be >= 1, got 0"),
        ("PSFLOW_CLOSURE_TIMEOUT", "soon", "PSFLOW_CLOSURE_TIMEOUT must be a number, got 'soon'"),
        ("PSFLOW_CLOSURE_TIMEOUT", "-1", "PSFLOW_CLOSURE_TIMEOUT must be > 0, got -1.0"),
        ("PSFLOW_CLOSURE_TIMEOUT", "nan", "PSFLOW_CLOSURE_TIMEOUT must be > 0, got nan"),
    ],
)
def test_a_bad_value_is_a_typed_error_naming_the_variable(name, value, message):
    with pytest.raises(errors.InvalidArgumentError) as info:
        settings.current({name: value})
    assert str(info.value) == message


@pytest.mark.parametrize("off", ["0", "false", "No", " off "])
def test_switches_turn_off_on_any_spelling_of_off(off):
    s = settings.ProcessSettings.from_environment({"PSFLOW_SHM": off, "PSFLOW_MALLOC_TUNING": off})
    assert (s.shm, s.malloc_tuning) == (False, False)


def test_current_follows_a_changed_environment(monkeypatch):
    monkeypatch.setenv("PSFLOW_NUM_CPU_DEVICES", "3")
    assert settings.current().num_cpu_devices == 3
    monkeypatch.setenv("PSFLOW_NUM_CPU_DEVICES", "5")
    assert settings.current().num_cpu_devices == 5


@pytest.mark.parametrize("value", [None, "1", "0", "off", " No "])
def test_compiled_kernels_reads_its_own_variable_as_current_does(monkeypatch, value):
    if value is None:
        monkeypatch.delenv("PSFLOW_COMPILED_KERNELS", raising=False)
    else:
        monkeypatch.setenv("PSFLOW_COMPILED_KERNELS", value)
    assert settings.compiled_kernels() is settings.current().compiled_kernels
    env = {} if value is None else {"PSFLOW_COMPILED_KERNELS": value}
    assert (
        settings.compiled_kernels(env)
        is settings.ProcessSettings.from_environment(env).compiled_kernels
    )
    # a bad value of another variable is that variable's business, not every kernel call's
    monkeypatch.setenv("PSFLOW_NUM_CPU_DEVICES", "two")
    with pytest.raises(errors.InvalidArgumentError):
        settings.current()
    assert settings.compiled_kernels() is (value is None or value.strip().lower() == "1")
