"""A parameter-server task's options: one frozen object, parsed once.

:func:`parse` turns ``python -m ps_server``'s flags and the environment (an
injectable mapping: ``TF_CONFIG`` for the address and the worker count) into a
:class:`ServerOptions`, checking every value and naming the flag of a bad one;
:func:`ps_server.server.serve` and :func:`ps_server.server.create_server`
take that object instead of a parameter per setting.  The process-wide setup
(logging, security credentials, thread budget) stays in ``__main__``.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import logging
import math
from collections.abc import Mapping

from psflow import serving, settings
from psflow.errors import InvalidArgumentError, OpError
from psflow.ps.tiered_table import TierOptions
from psflow.security.limits import DEFAULT_MAX_SYNC_CONTRIBUTORS, PSLimits
from psflow.transport.dataplane.loop import Limits
from psflow.transport.options import DEFAULT_CHUNK_BYTES, DEFAULT_MAX_MESSAGE_BYTES
from psflow.transport.shm import MIRROR_IDLE_SECONDS

__all__ = ["DataPlaneOptions", "ServerOptions", "ShmMode", "parse", "parser"]

log = logging.getLogger("ps_server")


class ShmMode(enum.Enum):
    """Whether dense values are mirrored into shared memory for clients on this host."""

    AUTO = "auto"  # when bound to loopback and /dev/shm is usable
    ON = "on"
    OFF = "off"


@dataclasses.dataclass(frozen=True)
class DataPlaneOptions:
    """The raw TCP data plane a PS runs beside its gRPC port (see
    :mod:`psflow.transport.dataplane`).

    Attributes:
        port: its port (0: any free one).
        advertise: ``host:port`` clients dial instead of the gRPC host and
            ``port`` (NAT, relays, Kubernetes services); "" for none.
        max_connections: authenticated connections served at once.
        idle_timeout: seconds a connection may wait for its next call.
        hello_timeout: seconds from accept by which a connection must authenticate.
        io_timeout: seconds a frame may take to arrive whole once it began.
    """

    port: int = 0
    advertise: str = ""
    # the data plane's own defaults (one place for them)
    max_connections: int = Limits.max_connections
    idle_timeout: float = Limits.idle_timeout
    hello_timeout: float = Limits.hello_timeout
    io_timeout: float = Limits.io_timeout

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise InvalidArgumentError(f"--data-port {self.port} is not a port (0..65535)")
        if self.advertise:
            host, sep, port = self.advertise.rpartition(":")
            if not host or not sep or not port.isdigit() or not 0 < int(port) <= 65535:
                raise InvalidArgumentError(f"--data-advertise {self.advertise!r} is not host:port")
        for flag, value in (
            ("--data-hello-timeout", self.hello_timeout),
            ("--data-io-timeout", self.io_timeout),
            ("data-plane idle timeout", self.idle_timeout),
        ):
            _check_seconds(flag, value)
        if self.max_connections < 1:
            raise InvalidArgumentError(
                f"--data-max-connections must be at least 1, got {self.max_connections}"
            )


@dataclasses.dataclass(frozen=True)
class ServerOptions:
    """Everything a parameter-server task is told, checked.

    Attributes:
        bind: the address the gRPC port (and the data plane) bind.
        port: the gRPC port (0: any free one).
        task: this task's name (``ps:0``...).
        checkpoint_dir: where a final checkpoint is written on SIGTERM (None: none).
        restore_dir: where this task's shard is restored from at start (None: nowhere).
        grace: seconds in-flight calls get to finish on SIGTERM.
        threads: gRPC worker threads (at least ``max_streams + 2`` are started).
        chunk_bytes: payload bytes per message of a streamed reply.
        max_message_bytes: the gRPC message size limit (and the data plane's frame payload).
        insecure: serve a non-loopback address without authentication.
        limits: the PS's limits (tensor size, variables, streams, sync contributors).
        metrics_port: the Prometheus port (0: any free one; None: no metrics).
        metrics_bind: the metrics port's address (None: ``bind``).
        shm: whether dense values are mirrored into shared memory.
        shm_idle: seconds a mirror nobody reads keeps following its variable.
        data_plane: the raw TCP data plane (None: off).
        tier: the dynamic tables' disk tier (its default budget 0: all in memory).
    """

    bind: str = "127.0.0.1"
    port: int = 0
    task: str = "ps:0"
    checkpoint_dir: str | None = None
    restore_dir: str | None = None
    grace: float = 10.0
    threads: int = 32
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    insecure: bool = False
    limits: PSLimits = dataclasses.field(default_factory=PSLimits)
    metrics_port: int | None = None
    metrics_bind: str | None = None
    shm: ShmMode = ShmMode.AUTO
    shm_idle: float = MIRROR_IDLE_SECONDS
    data_plane: DataPlaneOptions | None = dataclasses.field(default_factory=DataPlaneOptions)
    tier: TierOptions = dataclasses.field(default_factory=TierOptions)

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise InvalidArgumentError(f"--port {self.port} is not a port (0..65535)")
        for flag, value in (("--threads", self.threads), ("--chunk-bytes", self.chunk_bytes)):
            if value < 1:
                raise InvalidArgumentError(f"{flag} must be at least 1, got {value}")
        _check_seconds("--shm-idle", self.shm_idle)
        if not 0 <= self.grace < math.inf:
            raise InvalidArgumentError(f"--grace must be a finite number >= 0, got {self.grace}")


def _check_seconds(flag: str, value: float) -> None:
    if not 0 < value < math.inf:
        raise InvalidArgumentError(f"{flag} must be a finite number of seconds > 0, got {value}")


def parser(doc: str) -> argparse.ArgumentParser:
    """``python -m ps_server``'s flags (the common server flags, then the PS's own);
    ``doc``: the help text."""
    p = serving.server_parser("ps_server", doc, "ps", "seconds to drain calls on SIGTERM")
    p.add_argument("--checkpoint-dir", help="write a final checkpoint here on SIGTERM")
    p.add_argument("--restore", metavar="DIR", help="restore this task's shard from DIR at start")
    p.add_argument("--threads", type=int, default=ServerOptions.threads, help="RPC threads")
    p.add_argument("--chunk-bytes", type=int, default=1 << 20, help="payload bytes per message")
    p.add_argument(
        "--shm",
        choices=[m.value for m in ShmMode],
        default=ShmMode.AUTO.value,
        help="mirror dense values into shared memory for clients on this host "
        "(auto: when bound to loopback and /dev/shm is usable)",
    )
    p.add_argument(
        "--shm-idle",
        type=float,
        default=MIRROR_IDLE_SECONDS,
        metavar="SECONDS",
        help="a mirror no client on this host read for this long stops following its "
        "variable (no copy per update) until a client reads it again",
    )
    p.add_argument(
        "--data-plane",
        choices=("on", "off"),
        default="on",
        help="serve Push and Pull over a raw TCP port beside gRPC (default on)",
    )
    p.add_argument("--data-port", type=int, default=0, help="the data plane's port (0: any)")
    p.add_argument(
        "--data-advertise",
        default="",
        metavar="HOST:PORT",
        help="address clients dial for the data plane (default: the gRPC host, --data-port)",
    )
    p.add_argument(
        "--data-max-connections",
        type=int,
        default=DataPlaneOptions.max_connections,
        metavar="N",
        help="authenticated data-plane connections at once; at the limit the one idle "
        "longest makes room (connections still in their handshake have a budget of their own)",
    )
    p.add_argument(
        "--data-hello-timeout",
        type=float,
        default=DataPlaneOptions.hello_timeout,
        metavar="SECONDS",
        help="a data-plane connection must authenticate this soon after it is accepted",
    )
    p.add_argument(
        "--data-io-timeout",
        type=float,
        default=DataPlaneOptions.io_timeout,
        metavar="SECONDS",
        help="a data-plane frame must arrive whole (a reply be taken) this soon after it began",
    )
    p.add_argument(
        "--table-memory-rows",
        type=int,
        default=0,
        metavar="N",
        help="rows of each dynamic table shard kept in memory, the rest on local disk "
        "(tables whose config names a budget keep theirs; 0: all in memory)",
    )
    p.add_argument(
        "--table-memory-bytes",
        type=int,
        default=0,
        metavar="BYTES",
        help="the same budget in bytes of rows, slots and bookkeeping",
    )
    p.add_argument(
        "--table-dir",
        metavar="DIR",
        help="where the disk tier's stores live (default: the system's temporary directory)",
    )
    p.add_argument(
        "--table-store",
        default=TierOptions().backend,
        metavar="NAME",
        help="the disk tier's store: log (append-only segments, the default) or lmdb",
    )
    return p


def parse(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> ServerOptions:
    """The options of :func:`parser`'s ``args``; what the flags leave open comes from
    ``environ`` (the process environment by default): the address and task from
    ``TF_CONFIG`` without ``--port``, the sync-step bound from its worker count.

    Raises:
        InvalidArgumentError: a bad value (the message names its flag), or no
            ``--port`` and no usable ``TF_CONFIG``.
    """
    environ = settings.environ() if environ is None else environ
    bind, port, task = args.bind, args.port, args.task
    if port is None:
        try:
            tf_bind, port, tf_task = _from_tf_config(environ)
        except (ImportError, OpError, ValueError, KeyError) as e:
            raise InvalidArgumentError(f"no --port and no usable TF_CONFIG: {e}") from e
        bind, task = bind or tf_bind, task or tf_task
    data_plane = None
    if args.data_plane == "on":
        data_plane = DataPlaneOptions(
            port=args.data_port,
            advertise=args.data_advertise,
            max_connections=args.data_max_connections,
            hello_timeout=args.data_hello_timeout,
            io_timeout=args.data_io_timeout,
        )
    limits = PSLimits(
        args.max_tensor_bytes,
        args.max_variables,
        args.max_streams,
        max_streams_per_client=args.max_streams_per_client,
        stream_idle_timeout=args.stream_idle_timeout,
        max_sync_contributors=(
            args.max_sync_contributors or _cluster_workers(environ) or DEFAULT_MAX_SYNC_CONTRIBUTORS
        ),
    )
    return ServerOptions(
        bind=bind or "127.0.0.1",
        port=port,
        task=task or "ps:0",
        checkpoint_dir=args.checkpoint_dir,
        restore_dir=args.restore,
        grace=args.grace,
        threads=args.threads,
        chunk_bytes=args.chunk_bytes,
        insecure=args.insecure,
        limits=limits,
        metrics_port=args.metrics_port,
        metrics_bind=args.metrics_bind,
        shm=ShmMode(args.shm),
        shm_idle=args.shm_idle,
        data_plane=data_plane,
        tier=TierOptions(
            args.table_dir, args.table_memory_rows, args.table_memory_bytes, args.table_store
        ),
    )


def _from_tf_config(environ: Mapping[str, str]) -> tuple[str, int, str]:
    """``(bind, port, task)`` of this task from TF_CONFIG, via the cluster resolver."""
    from psflow.distribute.cluster_resolver import TFConfigClusterResolver  # lazy: optional module

    resolver = TFConfigClusterResolver(environ=environ)
    address = resolver.cluster_spec().task_address(resolver.task_type, resolver.task_id)
    _, _, port = address.rpartition(":")
    return "0.0.0.0", int(port), f"{resolver.task_type}:{resolver.task_id}"


def _cluster_workers(environ: Mapping[str, str]) -> int | None:
    """The number of worker tasks in TF_CONFIG's cluster (None: no usable TF_CONFIG).

    A sync step needs one contribution per worker, so this bounds ``num_required``.
    """
    if not environ.get("TF_CONFIG"):
        return None
    from psflow.distribute.cluster_resolver import TFConfigClusterResolver  # lazy: optional module

    try:
        spec = TFConfigClusterResolver(environ=environ).cluster_spec().as_dict()
    except (ImportError, OpError, ValueError, KeyError) as e:
        log.warning("TF_CONFIG unusable for the worker count: %s", e)
        return None
    workers = spec.get("worker") or ()
    return max(len(workers), 1)
