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

import logging

from psflow import serving
from psflow.errors import OpError
from psflow.ps.store import VariableStore
from psflow.security.config import is_loopback
from psflow.transport import shm

from .options import ServerOptions, ShmMode, parse, parser
from .server import serve

log = logging.getLogger("ps_server")


def _mirrors(options: ServerOptions) -> shm.MirrorSet | None:
    """The shared-memory mirrors ``options.shm`` asks for and this host allows."""
    if options.shm is ShmMode.OFF or (
        options.shm is ShmMode.AUTO and not is_loopback(options.bind)
    ):
        return None
    why = shm.unavailable_reason()
    if why is None:
        return shm.MirrorSet(idle=options.shm_idle)
    # one line, at either setting: the wire carries what shm would have
    log.log(
        logging.WARNING if options.shm is ShmMode.ON else logging.INFO,
        "shared memory is off: %s; values travel over the data plane or gRPC",
        why,
    )
    return None


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit code."""
    args = parser(__doc__).parse_args(argv)
    try:
        options = parse(args)
        _, _, security = serving.setup_process(args, "ps", options.task, options.bind)
    except OpError as e:
        return serving.usage_error("ps_server", e)
    limits = options.limits
    store = VariableStore(
        task=options.task,
        max_tensor_bytes=limits.max_tensor_bytes,
        max_variables=limits.max_variables,
        mirrors=_mirrors(options),
        max_sync_contributors=limits.max_sync_contributors,
    )
    try:
        return serve(store, options, security=security)
    except OpError as e:
        log.error("ps_server failed: %s", e)
        return 1
    finally:
        store.close()  # removes the shared-memory mirrors


if __name__ == "__main__":
    serving.exit_process(main())
