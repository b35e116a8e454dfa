"""``psflow local --mode multi-worker``: N peer processes of one script on loopback.

Example::

    psflow local --mode multi-worker --workers 2 examples/multi_worker_custom_loop.py

starts ``python SCRIPT ARGS`` ``--workers`` times, each with a ``TF_CONFIG``
naming a worker-only cluster on free loopback ports and its own
``worker`` task, as ``MultiWorkerMirroredStrategy`` expects (there is no
parameter server and no separate chief: worker 0 acts as chief).  Every line
a worker writes is copied with its name in front (``[worker:1] ...``); every
worker gets the same random ``PSFLOW_AUTH_TOKEN`` (unless the environment
already configures a token or TLS) and ``--devices-per-worker`` devices.

Exit status: 0 when every worker exited 0, else the status of the first
worker that failed (``128 + N`` for signal N).  When one fails, the others
fail on their own within their collective deadline (a typed error naming
it); after ``--grace`` seconds more the launcher stops them.  With
``--restart on-failure`` the whole group is then started again in its slots,
up to ``--max-restarts`` times.  SIGINT, SIGTERM or SIGHUP stop every worker
and the launcher exits ``128 + signal``.

With ``--elastic`` (scripts whose strategy has ``ElasticOptions``) a worker
that fails or drains is only reported: the others go on without it, and the
launcher's status is that of the last worker to exit.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator, Mapping

from chief.local import (
    gpu_ids,
    host_port,
    pick_ports,
    tf_config,
    worker_device_env,
)
from chief.restart import RestartBook, RestartPolicy
from chief.script import Target
from chief.supervisor import RoleProcess, Supervisor, shell_status
from chief.thread_plan import plan_threads
from psflow.security.config import with_generated_token
from psflow.thread_budget import available_cores

log = logging.getLogger("chief.peers")

_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def _signals_noted(received: list[int]) -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, lambda n, f: received.append(n)) for s in _STOP_SIGNALS}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def worker_cluster(num_workers: int, host: str, ports: list[int]) -> dict[str, list[str]]:
    """The ``TF_CONFIG`` cluster of a worker-only job.

    Example:
        >>> worker_cluster(2, "127.0.0.1", [5000, 5001])
        {'worker': ['127.0.0.1:5000', '127.0.0.1:5001']}
    """
    return {"worker": [host_port(host, p) for p in ports[:num_workers]]}


def run_peers(
    target: Target,
    num_workers: int,
    *,
    devices_per_worker: int | None = None,
    host: str = "127.0.0.1",
    port_base: int | None = None,
    grace: float = 15.0,
    restart: RestartPolicy | None = None,
    environ: Mapping[str, str] | None = None,
    elastic: bool = False,
) -> int:
    """Runs ``num_workers`` peers of ``target``; returns the launcher's exit status.

    With ``restart`` on failure, a failed group is stopped and every worker
    started again in its slot (same ports, ``TF_CONFIG`` and token): a
    collective group cannot go on without a member, so it restarts whole
    (as TensorFlow requires); ``BackupAndRestore`` resumes training.

    Raises:
        InvalidArgumentError: see :func:`chief.local.worker_device_env`.
        UnavailableError: a port from ``port_base`` is taken.
    """
    base_env = with_generated_token(os.environ if environ is None else environ)
    ports = pick_ports(num_workers, host, port_base)
    cluster = worker_cluster(num_workers, host, ports)
    devices = worker_device_env(devices_per_worker, num_workers, gpu_ids(base_env))
    # N peers share the cores, none a PS (a group of "N - 1 workers and a chief" to the plan)
    threads = plan_threads(0, num_workers - 1, None, base_env, cores=available_cores())
    log.info(
        "BLAS threads per worker: %d (%s, %d cores)",
        threads.threads["worker"],
        threads.source,
        threads.cores,
    )
    envs = [
        {
            **threads.env("worker"),
            **base_env,
            "TF_CONFIG": tf_config(cluster, "worker", i),
            **devices[i],
            "PYTHONUNBUFFERED": "1",
        }
        for i in range(num_workers)
    ]
    argv = [sys.executable, *target.argv, *target.args]
    book = RestartBook(restart or RestartPolicy())
    received: list[int] = []
    with _signals_noted(received):
        log.info("%d workers of %s on %s", num_workers, target, ", ".join(cluster["worker"]))
        while True:
            status = _run_group(argv, envs, grace, received, elastic)
            if received:
                return 128 + received[0]
            delay = book.next_delay("group", status, is_chief=False)
            if delay is None:
                return status
            log.warning(
                "the workers failed (status %d): restarting all of them in their slots "
                "(restart %d of %d) in %.1fs",
                status,
                book.used("group"),
                book.policy.max_restarts,
                delay,
            )
            deadline = time.monotonic() + delay
            while time.monotonic() < deadline and not received:
                time.sleep(0.05)
            if received:
                return 128 + received[0]


def _run_group(
    argv: list[str],
    envs: list[dict[str, str]],
    grace: float,
    received: list[int],
    elastic: bool = False,
) -> int:
    """Runs one generation of the workers; returns the first failure's status (0: none).

    ``elastic``: a failed worker is left behind; the status is the last exit's.
    """
    supervisor = Supervisor()
    first_failure: RoleProcess | None = None
    failed_at = 0.0
    last_status = 0
    try:
        for i, env in enumerate(envs):
            supervisor.start(f"worker:{i}", argv, env)
        while any(r.running for r in supervisor.roles):
            if received:
                log.warning("signal %d: stopping the workers", received[0])
                supervisor.stop(grace, escalate=lambda: len(received) > 1)
                return 128 + received[0]
            supervisor.pump(0.1)
            for role in supervisor.poll():
                status = shell_status(role.returncode or 0)
                log.info("%s exited with status %d", role.name, status)
                last_status = status
                if status and elastic:
                    log.warning("%s was lost (status %d); the others go on", role.name, status)
                    continue
                if status and first_failure is None:
                    first_failure, failed_at = role, time.monotonic()
            if first_failure is not None and time.monotonic() - failed_at > grace:
                log.warning("%s failed; stopping the others", first_failure.name)
                break
    finally:
        supervisor.stop(grace)
    if elastic:
        return last_status
    return 0 if first_failure is None else shell_status(first_failure.returncode or 1)
