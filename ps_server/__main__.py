"""``python -m ps_server``: run one parameter-server task.

Examples::

    python -m ps_server --port 0                 # loopback, any free port
    python -m ps_server --bind 0.0.0.0 --port 2222 --task ps:1 \\
        --checkpoint-dir /ckpt --restore /ckpt
    TF_CONFIG='{"cluster": {"ps": ["host:2222"]}, "task": {"type": "ps", "index": 0}}' \\
        python -m ps_server                      # address and task from TF_CONFIG

Once bound it prints one line ``PSFLOW_READY ps port=<port> task=<task> pid=<pid>``
(plus `` metrics_port=<port>`` with ``--metrics-port``, and `` blas_threads=<n>``)
on stdout; logs go to stderr (``--log-format json``: one JSON object per line).

BLAS threads (:mod:`psflow.thread_budget`): 1 unless ``PSFLOW_BLAS_THREADS=N``
(``psflow local`` sets it) or ``OPENBLAS_NUM_THREADS``/``OMP_NUM_THREADS``/
``MKL_NUM_THREADS`` say otherwise; a bad value exits 2.

Security (see :mod:`psflow.security`): a shared token (``PSFLOW_AUTH_TOKEN``,
``PSFLOW_AUTH_TOKEN_FILE`` or ``--auth-token-file``) and/or mutual TLS
(``--tls-cert/--tls-key/--tls-ca`` or ``PSFLOW_TLS_*``).  Binding an address
other machines can reach without either needs ``--insecure``.  SIGTERM: health NOT_SERVING, in-flight calls
finish (``--grace`` seconds), the final checkpoint is written if
``--checkpoint-dir`` is given, exit 0.  A task a resize of the parameter
servers drained (every variable moved away, then the Drain RPC) stops the same
way and prints ``PSFLOW_DRAINED task=<task> pid=<pid>`` before exiting 0, so a
supervisor knows not to restart it.

Data plane (see :mod:`psflow.transport.dataplane`): beside the gRPC port the
task serves Push and Pull over a raw TCP port of its own (``--data-plane
on``, the default; ``--data-port``, default any free port, named
`` data_port=<port>`` in the ready line), with the same token and TLS; clients
learn it over gRPC.  ``--data-advertise host:port`` is the address clients
dial instead (NAT, relays, Kubernetes); open that port between hosts too.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from psflow import serving
from psflow.errors import InvalidArgumentError, OpError
from psflow.ps.store import VariableStore
from psflow.ps.tables import TableRegistry
from psflow.ps.tiered_table import TierOptions
from psflow.security.config import is_loopback
from psflow.security.limits import DEFAULT_MAX_SYNC_CONTRIBUTORS, PSLimits
from psflow.transport import shm

from .server import DataPlaneOptions, serve

log = logging.getLogger("ps_server")


def _from_tf_config() -> tuple[str, int, str]:
    """``(bind, port, task)`` of this task from TF_CONFIG, via the cluster resolver."""
    from psflow.distribute.cluster_resolver import TFConfigClusterResolver  # lazy: optional module

    resolver = TFConfigClusterResolver()
    address = resolver.cluster_spec().task_address(resolver.task_type, resolver.task_id)
    _, _, port = address.rpartition(":")
    return "0.0.0.0", int(port), f"{resolver.task_type}:{resolver.task_id}"


def _cluster_workers() -> int | None:
    """The number of worker tasks in TF_CONFIG's cluster (None: no usable TF_CONFIG).

    A sync step needs one contribution per worker, so this bounds ``num_required``.
    """
    if not os.environ.get("TF_CONFIG"):
        return None
    from psflow.distribute.cluster_resolver import TFConfigClusterResolver  # lazy: optional module

    try:
        spec = TFConfigClusterResolver().cluster_spec().as_dict()
    except (ImportError, OpError, ValueError, KeyError) as e:
        log.warning("TF_CONFIG unusable for the worker count: %s", e)
        return None
    workers = spec.get("worker") or ()
    return max(len(workers), 1)


def _parser() -> argparse.ArgumentParser:
    p = serving.server_parser("ps_server", __doc__, "ps", "seconds to drain calls on SIGTERM")
    p.add_argument("--checkpoint-dir", help="write a final checkpoint here on SIGTERM")
    p.add_argument("--restore", metavar="DIR", help="restore this task's shard from DIR at start")
    p.add_argument("--threads", type=int, default=32, help="RPC worker threads")
    p.add_argument("--chunk-bytes", type=int, default=1 << 20, help="payload bytes per message")
    p.add_argument(
        "--shm",
        choices=("auto", "on", "off"),
        default="auto",
        help="mirror dense values into shared memory for clients on this host "
        "(auto: when bound to loopback and /dev/shm is usable)",
    )
    p.add_argument(
        "--shm-idle",
        type=float,
        default=shm.MIRROR_IDLE_SECONDS,
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
    return p


def _data_plane(args: argparse.Namespace) -> DataPlaneOptions | None:
    """The data plane the flags ask for (None: off).

    Raises:
        InvalidArgumentError: a port out of range or an advertised address
            that is not ``host:port``.
    """
    if args.data_plane == "off":
        return None
    if not 0 <= args.data_port <= 65535:
        raise InvalidArgumentError(f"--data-port {args.data_port} is not a port (0..65535)")
    if args.data_advertise:
        host, sep, port = args.data_advertise.rpartition(":")
        if not host or not sep or not port.isdigit() or not 0 < int(port) <= 65535:
            raise InvalidArgumentError(f"--data-advertise {args.data_advertise!r} is not host:port")
    for flag, value in (
        ("--data-hello-timeout", args.data_hello_timeout),
        ("--data-io-timeout", args.data_io_timeout),
    ):
        if not 0 < value < float("inf"):
            raise InvalidArgumentError(
                f"{flag} must be a finite number of seconds > 0, got {value}"
            )
    if args.data_max_connections < 1:
        raise InvalidArgumentError(
            f"--data-max-connections must be at least 1, got {args.data_max_connections}"
        )
    return DataPlaneOptions(
        port=args.data_port,
        advertise=args.data_advertise,
        max_connections=args.data_max_connections,
        hello_timeout=args.data_hello_timeout,
        io_timeout=args.data_io_timeout,
    )


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit code."""
    args = _parser().parse_args(argv)
    bind, port, task = args.bind, args.port, args.task
    if port is None:
        try:
            tf_bind, port, tf_task = _from_tf_config()
        except (ImportError, OpError, ValueError, KeyError) as e:
            return serving.usage_error("ps_server", f"no --port and no usable TF_CONFIG: {e}")
        bind, task = bind or tf_bind, task or tf_task
    try:
        bind, task, security = serving.setup_process(args, "ps", task, bind)
        data_plane = _data_plane(args)
    except OpError as e:
        return serving.usage_error("ps_server", e)
    limits = PSLimits(
        args.max_tensor_bytes,
        args.max_variables,
        args.max_streams,
        max_streams_per_client=args.max_streams_per_client,
        stream_idle_timeout=args.stream_idle_timeout,
        max_sync_contributors=(
            args.max_sync_contributors or _cluster_workers() or DEFAULT_MAX_SYNC_CONTRIBUTORS
        ),
    )
    mirrors = None
    if args.shm == "on" or (args.shm == "auto" and is_loopback(bind)):
        if not 0 < args.shm_idle < float("inf"):
            return serving.usage_error(
                "ps_server",
                f"--shm-idle must be a finite number of seconds > 0, got {args.shm_idle}",
            )
        why = shm.unavailable_reason()
        if why is None:
            mirrors = shm.MirrorSet(idle=args.shm_idle)
        else:  # one line, at either setting: the wire carries what shm would have
            log.log(
                logging.WARNING if args.shm == "on" else logging.INFO,
                "shared memory is off: %s; values travel over the data plane or gRPC",
                why,
            )
    store = VariableStore(
        task=task,
        max_tensor_bytes=limits.max_tensor_bytes,
        max_variables=limits.max_variables,
        mirrors=mirrors,
        max_sync_contributors=limits.max_sync_contributors,
    )
    try:
        return serve(
            store,
            bind,
            port,
            checkpoint_dir=args.checkpoint_dir,
            restore_dir=args.restore,
            grace=args.grace,
            max_workers=args.threads,
            chunk_bytes=args.chunk_bytes,
            security=security,
            insecure=args.insecure,
            max_streams=limits.max_streams,
            max_streams_per_client=limits.max_streams_per_client,
            stream_idle_timeout=limits.stream_idle_timeout,
            metrics_port=args.metrics_port,
            metrics_bind=args.metrics_bind,
            data_plane=data_plane,
            tables=TableRegistry(
                task,
                TierOptions(args.table_dir, args.table_memory_rows, args.table_memory_bytes),
            ),
        )
    except OpError as e:
        log.error("ps_server failed: %s", e)
        return 1
    finally:
        store.close()  # removes the shared-memory mirrors


if __name__ == "__main__":
    sys.exit(main())
