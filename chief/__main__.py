"""``python -m chief SCRIPT [ARGS]``: run the user's program as the chief task.

Examples::

    python -m chief train.py --epochs 5          # embedded when there is no TF_CONFIG
    python -m chief -m mypackage.train           # a module instead of a script
    TF_CONFIG='{"cluster": {"chief": ["c0:2222"], "ps": ["p0:2222"], "worker": ["w0:2222"]},
                "task": {"type": "chief", "index": 0}}' python -m chief train.py

The program runs in this process as ``__main__`` with ``sys.argv == [SCRIPT,
*ARGS]``.  Before it starts, ``TF_CONFIG`` (when it names a cluster) must be a
valid parameter-server cluster that names this task as its chief; otherwise the
process exits 2 without running anything.

BLAS threads (:mod:`psflow.thread_budget`), set before the program starts and
logged as ``blas_threads=N``: the cores of its container unless
``PSFLOW_BLAS_THREADS=N`` (``psflow local`` sets it) or
``OPENBLAS_NUM_THREADS``/``OMP_NUM_THREADS``/``MKL_NUM_THREADS`` say
otherwise; a bad value exits 2 without running anything.

Exit status (Kubeflow's ``restartPolicy: ExitCode`` reads it, see
``psflow.exit_codes``): 0 on success; the code of ``sys.exit``; for an
exception, its traceback on stderr and ``exit_code_for(error)`` - 138
(retryable) for a lost peer or a missed deadline, 1 for anything else; 130 on
SIGINT and 143 on SIGTERM (both raise inside the program, so ``finally``
blocks run).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import os
import signal
import sys
import threading
import traceback
from collections.abc import Mapping
from typing import Any

from chief.script import Target, run_target, split_command
from psflow.errors import InvalidArgumentError, OpError
from psflow.exit_codes import ExitCode, exit_code_for

log = logging.getLogger("chief")

_VALUE_OPTIONS = {"--log-level", "--dashboard-port", "--dashboard-bind"}


class Terminated(BaseException):
    """Raised in the program's main thread when the chief receives SIGTERM.

    A ``BaseException``, like ``KeyboardInterrupt``, so that ``except
    Exception`` in user code does not swallow it.
    """

    def __init__(self, signum: int) -> None:
        super().__init__(f"received signal {signal.Signals(signum).name}")
        self.signum = signum


def check_chief_task(environ: Mapping[str, str] | None = None) -> str | None:
    """Checks ``TF_CONFIG`` for a chief; returns ``"chief:0"``, or None when embedded.

    No ``TF_CONFIG`` (or no cluster in it, and no task or the chief task) means
    embedded mode.

    Raises:
        InvalidArgumentError: ``TF_CONFIG`` is invalid, is not a parameter-server
            cluster, or names another task (the message names it).
        TaskNotFoundError: the cluster has no chief task.
    """
    from psflow.distribute.cluster_resolver import (
        TFConfigClusterResolver,
        task_string,
        validate_ps_cluster,
    )

    resolver = TFConfigClusterResolver(environ=environ)
    spec = resolver.cluster_spec()
    task_type, task_id = resolver.task_type, resolver.task_id
    if task_type is not None and task_type != "chief":
        hint = {"ps": "python -m ps_server", "worker": "python -m worker"}.get(task_type)
        raise InvalidArgumentError(
            f"TF_CONFIG['task'] names this task {task_string(task_type, task_id)}, not the "
            "chief" + (f"; start {task_type} tasks with `{hint}`" if hint else "")
        )
    if not spec.jobs:
        return None
    if task_type is None:
        raise InvalidArgumentError(
            "TF_CONFIG has a cluster but no 'task'; the chief needs "
            '"task": {"type": "chief", "index": 0}'
        )
    validate_ps_cluster(spec, task_type=task_type, task_id=task_id)
    return task_string(task_type, task_id)


def _raise_terminated(signum: int, frame: object) -> None:
    raise Terminated(signum)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m chief",
        usage="python -m chief [--log-level LEVEL] [--dashboard-port PORT] "
        "(SCRIPT | -m MODULE) [ARGS...]",
        description="Run a program (a script or -m MODULE) as the chief task of a psflow "
        "cluster, or embedded when TF_CONFIG names no cluster.",
    )
    p.add_argument(
        "--log-level",
        default="INFO",
        type=str.upper,
        choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
        help="level of the chief's own messages",
    )
    p.add_argument(
        "--dashboard-port",
        type=int,
        metavar="PORT",
        help="serve the live dashboard at http://BIND:PORT/ (0: a free port; default: off)",
    )
    p.add_argument(
        "--dashboard-bind",
        default="127.0.0.1",
        metavar="ADDR",
        help="address of the dashboard (default 127.0.0.1; others need PSFLOW_AUTH_TOKEN)",
    )
    return p


def _listed_ps(path: str) -> list[str]:
    """The PS addresses the cluster file at ``path`` lists now."""
    from psflow.distribute.cluster_resolver import read_cluster_file

    spec = read_cluster_file(path)
    return (
        [spec.task_address("ps", i) for i in spec.task_indices("ps")] if "ps" in spec.jobs else []
    )


def _start_dashboard(port: int, bind: str, environ: Mapping[str, str] | None = None) -> Any:
    """The chief's dashboard over TF_CONFIG's cluster (empty when embedded), or None on error.

    The environment's credentials authenticate its probes and, beyond
    loopback, guard the page.
    """
    from psflow.dashboard.app import start_dashboard
    from psflow.dashboard.job_status import LAUNCHER_DIR_ENV
    from psflow.distribute.cluster_resolver import TFConfigClusterResolver
    from psflow.distribute.cluster_resolver.cluster_file import CLUSTER_FILE_ENV
    from psflow.security.config import SecurityConfig

    env = os.environ if environ is None else environ
    try:
        security = SecurityConfig.from_environment(environ)
        spec = TFConfigClusterResolver(environ=environ).cluster_spec()
        cluster = {
            job: [spec.task_address(job, i) for i in spec.task_indices(job)]
            for job in spec.jobs
            if job in ("ps", "worker")
        }
        # elastic parameter servers (psflow local --ps-max): the page follows the view
        path = env.get(CLUSTER_FILE_ENV)
        ps_view = None if not path else functools.partial(_listed_ps, path)
        dashboard = start_dashboard(
            cluster,
            port=port,
            bind=bind,
            security=security,
            ps_view=ps_view,
            launcher_dir=env.get(LAUNCHER_DIR_ENV) or None,  # under psflow local
        )
    except (OpError, ValueError) as e:
        log.error("cannot start the dashboard: %s", e)
        return None
    log.info("dashboard at %s", dashboard.url)
    return dashboard


def _configure_logging(level: str) -> None:
    # The chief's own logger only: the user's program configures the root logger.
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s role=chief: %(message)s"))
        log.addHandler(handler)
        log.propagate = False
    log.setLevel(level)


def _exit_status(code: object) -> int:
    """The process status for ``SystemExit(code)``, as the interpreter computes it."""
    if code is None:
        return int(ExitCode.OK)
    if isinstance(code, int):
        return code & 0xFF
    sys.stderr.write(f"{code}\n")
    return int(ExitCode.USER_ERROR)


def _print_user_traceback(error: BaseException) -> None:
    """Prints ``error``'s traceback without the frames of this launcher and ``runpy``."""
    tb = error.__traceback__
    ours = (os.path.dirname(os.path.abspath(__file__)), "<frozen runpy>")
    while tb is not None and tb.tb_frame.f_code.co_filename.startswith(ours):
        tb = tb.tb_next
    traceback.print_exception(type(error), error, tb or error.__traceback__)


def run_chief(target: Target, environ: Mapping[str, str] | None = None) -> int:
    """Checks the task, runs ``target`` as ``__main__``; returns the exit status (never raises)."""
    if target.path is not None and not os.path.isfile(target.path):
        log.error("cannot run %s: script %r does not exist", target, target.path)
        return int(ExitCode.USAGE_ERROR)
    try:
        task = check_chief_task(environ)
    except (OpError, ValueError) as e:
        log.error("cannot run %s as the chief: %s", target, e)
        return int(ExitCode.USAGE_ERROR)
    log.info("running %s as %s", target, task or "the chief (embedded: no cluster)")
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        run_target(target)
        status = int(ExitCode.OK)
    except SystemExit as e:
        status = _exit_status(e.code)
    except KeyboardInterrupt:
        log.warning("interrupted (SIGINT)")
        status = 128 + signal.SIGINT
    except Terminated as e:
        log.warning("stopped by %s", signal.Signals(e.signum).name)
        status = 128 + e.signum
    except BaseException as e:
        _print_user_traceback(e)
        status = int(exit_code_for(e))
        kind = "retryable" if status == ExitCode.RETRYABLE else "not retryable"
        log.error("%s failed with %s: exit %d (%s)", target, type(e).__name__, status, kind)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
    return status


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit code."""
    argv = sys.argv[1:] if argv is None else argv
    parser = _parser()
    try:
        own, target = split_command(argv, _VALUE_OPTIONS)
    except InvalidArgumentError as e:
        parser.print_usage(sys.stderr)
        sys.stderr.write(f"python -m chief: {e}\n")
        return int(ExitCode.USAGE_ERROR)
    args = parser.parse_args(own)
    _configure_logging(args.log_level)
    from psflow import memory, thread_budget

    try:
        thread_budget.start_process_budget("chief", logger=log)
    except InvalidArgumentError as e:
        sys.stderr.write(f"python -m chief: {e}\n")
        return int(ExitCode.USAGE_ERROR)

    memory.ensure_tuned()  # the chief's embedded mode and its pulls move megabyte buffers too
    if args.dashboard_port is None:
        return run_chief(target)
    dashboard = _start_dashboard(args.dashboard_port, args.dashboard_bind)
    if dashboard is None:
        return int(ExitCode.USAGE_ERROR)
    try:
        return run_chief(target)
    finally:
        dashboard.close()


if __name__ == "__main__":
    sys.exit(main())
