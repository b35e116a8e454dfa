"""``psflow scale --ps K`` / ``--workers K`` (``python -m chief.scale``): resize a running
``psflow local`` cluster.

Example::

    psflow local --ps-max 3 --ps 2 --workers 2 examples/elastic_fit.py &
    psflow scale --ps 3        # start ps:2; the chief's watch moves a share of shards to it
    psflow scale --ps 1        # the chief drains ps:1 and ps:2; they exit 0 (PSFLOW_DRAINED)

    psflow local --mode multi-worker --elastic --workers 2 --workers-max 3 \
        examples/multi_worker_elastic.py &
    psflow scale --workers 3   # start worker:2; the group admits it at a step boundary
    psflow scale --workers 2   # worker:2 gets SIGTERM: it leaves at the next boundary, exit 0

Finds the launcher through its control directory (:mod:`chief.control`;
``--cluster-dir``, default the one ``psflow local`` uses), checks ``K``
against the launcher's ``--ps-max`` (``--workers-max``), writes a request and
waits (up to ``--timeout`` seconds) for the launcher's answer, which it prints.

Exit status: 0 when the launcher did it; 1 when it could not (a new PS did not
start, a drained one did not exit in time) or did not answer in time; 2 for
bad input - ``K`` below 1 or above ``--ps-max``, no running cluster - in which
case nothing is asked and nothing changes.
"""

from __future__ import annotations

import argparse
import sys
import time
import uuid

from chief.control import ControlDir, default_cluster_dir
from psflow.errors import (
    DeadlineExceededError,
    InvalidArgumentError,
    NotFoundError,
    UnavailableError,
)
from psflow.exit_codes import ExitCode

DEFAULT_TIMEOUT = 300.0


def check_request(count: int, most: int, role: str = "ps") -> int:
    """Returns ``count`` if a launcher with ``--ps-max most`` (``--workers-max``) can run
    that many ``role`` tasks.

    Raises:
        InvalidArgumentError: naming both values.
    """
    flag = "--ps" if role == "ps" else "--workers"
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise InvalidArgumentError(f"{flag} {count!r} must be at least 1")
    if count > most:
        raise InvalidArgumentError(
            f"{flag} {count} is above the cluster's {flag}-max {most} (its ports are reserved "
            f"at start; restart it with a larger {flag}-max)"
        )
    return count


def scale(control: ControlDir, count: int, timeout: float, role: str = "ps") -> dict:
    """Asks the launcher of ``control`` for ``count`` tasks of ``role`` (``ps`` or
    ``worker``); returns its answer.

    Raises:
        NotFoundError: no launcher runs there.
        UnavailableError: the launcher exited before it answered.
        InvalidArgumentError: ``count`` is out of range, or the launcher scales the
            other role (nothing was asked).
        DeadlineExceededError: no answer within ``timeout`` seconds (the
            request stays queued: the launcher may still act on it).
    """
    state = control.state()
    assert state is not None  # not missing_ok
    if state.role != role:
        raise InvalidArgumentError(
            f"the cluster at {control.path} scales its {state.role} tasks, not {role} tasks"
        )
    check_request(count, state.ps_max if role == "ps" else state.workers_max, role)
    request_id = uuid.uuid4().hex
    control.put_request(request_id, count, "num_ps" if role == "ps" else "num_workers")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = control.take_result(request_id)
        if result is not None:
            return result
        if control.state(missing_ok=True) is None:
            raise UnavailableError(f"the launcher at {control.path} exited before it answered")
        time.sleep(0.05)
    raise DeadlineExceededError(
        f"the launcher at {control.path} did not answer within {timeout:g}s (it may still act)"
    )


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="psflow scale",
        description="Start or drain parameter servers of a running `psflow local --ps-max` "
        "cluster, or workers of a `psflow local --mode multi-worker --workers-max` one.",
    )
    wanted = p.add_mutually_exclusive_group(required=True)
    wanted.add_argument("--ps", type=int, metavar="K", help="PS tasks wanted (1..ps-max)")
    wanted.add_argument("--workers", type=int, metavar="K", help="workers wanted (1..workers-max)")
    p.add_argument(
        "--cluster-dir",
        default=None,
        metavar="DIR",
        help="the launcher's control directory (default: psflow local's default)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT,
        metavar="S",
        help=f"seconds to wait for the launcher's answer (default {DEFAULT_TIMEOUT:g})",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``psflow scale``; returns the exit status."""
    args = _parser().parse_args(argv)
    if not args.timeout > 0:
        sys.stderr.write(f"psflow scale: --timeout {args.timeout!r} must be > 0\n")
        return int(ExitCode.USAGE_ERROR)
    control = ControlDir(args.cluster_dir or default_cluster_dir())
    try:
        if args.ps is not None:
            result = scale(control, args.ps, args.timeout)
        else:
            result = scale(control, args.workers, args.timeout, role="worker")
    except (InvalidArgumentError, NotFoundError) as e:
        sys.stderr.write(f"psflow scale: {e}\n")
        return int(ExitCode.USAGE_ERROR)
    except (
        DeadlineExceededError,
        UnavailableError,
        OSError,
    ) as e:  # the launcher may still act: not bad input
        sys.stderr.write(f"psflow scale: {e}\n")
        return int(ExitCode.USER_ERROR)
    stream = sys.stdout if result.get("ok") else sys.stderr
    stream.write(f"psflow scale: {result.get('message')}\n")
    return int(ExitCode.OK) if result.get("ok") else int(ExitCode.USER_ERROR)


if __name__ == "__main__":
    sys.exit(main())
