"""A PS task's options (:mod:`ps_server.options`): parsed once from flags and an
injected environment, frozen, and a bad value refused with its flag named."""

from __future__ import annotations

import dataclasses
import json

import pytest

from ps_server.options import DataPlaneOptions, ServerOptions, ShmMode, parse, parser
from psflow.errors import InvalidArgumentError


def _parse(*argv: str, environ: dict[str, str] | None = None) -> ServerOptions:
    return parse(parser("test").parse_args(list(argv)), environ or {})


def _tf_config(task_index: int, workers: int) -> dict[str, str]:
    cluster = {
        "ps": ["10.0.0.1:2222", "10.0.0.2:2223"],
        "worker": [f"10.0.1.{k}:2222" for k in range(workers)],
    }
    spec = {"cluster": cluster, "task": {"type": "ps", "index": task_index}}
    return {"TF_CONFIG": json.dumps(spec)}


def test_flags_become_one_frozen_object() -> None:
    options = _parse(
        "--port", "0", "--task", "ps:3", "--threads", "8", "--shm", "off",
        "--data-port", "7000", "--data-advertise", "relay:9000", "--max-streams", "5",
        "--grace", "2.5", "--checkpoint-dir", "/ckpt",
    )  # fmt: skip
    assert (options.bind, options.port, options.task) == ("127.0.0.1", 0, "ps:3")
    assert (options.threads, options.grace, options.checkpoint_dir) == (8, 2.5, "/ckpt")
    assert options.shm is ShmMode.OFF
    assert options.limits.max_streams == 5
    assert options.data_plane == DataPlaneOptions(port=7000, advertise="relay:9000")
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.port = 1  # type: ignore[misc]


def test_data_plane_off_is_none() -> None:
    assert _parse("--port", "0", "--data-plane", "off").data_plane is None


def test_address_task_and_worker_count_come_from_the_injected_environment() -> None:
    options = _parse(environ=_tf_config(1, workers=3))
    assert (options.bind, options.port, options.task) == ("0.0.0.0", 2223, "ps:1")
    # a sync step needs one contribution per worker: the cluster's worker count bounds it
    assert options.limits.max_sync_contributors == 3
    # explicit flags win over the environment
    explicit = _parse(
        "--port", "0", "--bind", "127.0.0.1", "--max-sync-contributors", "7",
        environ=_tf_config(1, workers=3),
    )  # fmt: skip
    assert (explicit.bind, explicit.port, explicit.limits.max_sync_contributors) == (
        "127.0.0.1",
        0,
        7,
    )


def test_no_port_and_no_tf_config_is_named() -> None:
    with pytest.raises(InvalidArgumentError, match="no --port and no usable TF_CONFIG"):
        _parse(environ={})


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--data-port", "70000"], "--data-port 70000"),
        (["--data-advertise", "nohostport"], "--data-advertise 'nohostport'"),
        (["--data-hello-timeout", "0"], "--data-hello-timeout must be"),
        (["--data-io-timeout", "inf"], "--data-io-timeout must be"),
        (["--data-max-connections", "0"], "--data-max-connections must be at least 1, got 0"),
        (["--shm-idle", "-1"], "--shm-idle must be a finite number of seconds > 0, got -1"),
        (["--threads", "0"], "--threads must be at least 1, got 0"),
        (["--chunk-bytes", "-4"], "--chunk-bytes must be at least 1, got -4"),
        (["--grace", "nan"], "--grace must be a finite number >= 0, got nan"),
    ],
)
def test_a_bad_value_is_refused_naming_its_flag_and_value(argv: list[str], named: str) -> None:
    with pytest.raises(InvalidArgumentError) as raised:
        _parse("--port", "0", *argv)
    assert named in str(raised.value)


def test_options_built_in_code_are_checked_too() -> None:
    with pytest.raises(InvalidArgumentError, match="--port 65536 is not a port"):
        ServerOptions(port=65536)
    with pytest.raises(InvalidArgumentError, match="--data-max-connections"):
        DataPlaneOptions(max_connections=0)
