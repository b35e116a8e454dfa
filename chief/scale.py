"""``psflow scale --ps K`` (``python -m chief.scale``): resize a running ``psflow local`` cluster.

Example::

    psflow local --ps-max 3 --ps 2 --workers 2 examples/elastic_fit.py &
    psflow scale --ps 3        # start ps:2; the chief's watch moves a share of shards to it
    psflow scale --ps 1        # the chief drains ps:1 and ps:2; they exit 0 (PSFLOW_DRAINED)

Finds the launcher through its control directory (:mod:`chief.control`;
``--cluster-dir``, default the one ``psflow local`` uses), checks ``K``
against the launcher's ``--ps-max``, writes a request and waits (up to
``--timeout`` seconds) for the launcher's answer, which it prints.

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


def check_request(num_ps: int, ps_max: int) -> int:
    """Returns ``num_ps`` if a launcher with ``--ps-max ps_max`` can run that many PS tasks.

    Raises:
        InvalidArgumentError: naming both values.
    """
    if isinstance(num_ps, bool) or not isinstance(num_ps, int) or num_ps < 1:
        raise InvalidArgumentError(f"--ps {num_ps!r} must be at least 1")
    if num_ps > ps_max:
        raise InvalidArgumentError(
            f"--ps {num_ps} is above the cluster's --ps-max {ps_max} (its ports are reserved at "
            "start; restart it with a larger --ps-max)"
        )
    return num_ps


def scale(control: ControlDir, num_ps: int, timeout: float) -> dict:
    """Asks the launcher of ``control`` for ``num_ps`` PS tasks; returns its answer.

    Raises:
        NotFoundError: no launcher runs there.
        UnavailableError: the launcher exited before it answered.
        InvalidArgumentError: ``num_ps`` is out of range (nothing was asked).
        DeadlineExceededError: no answer within ``timeout`` seconds (the
            request stays queued: the launcher may still act on it).
    """
    state = control.state()
    assert state is not None  # not missing_ok
    check_request(num_ps, state.ps_max)
    request_id = uuid.uuid4().hex
    control.put_request(request_id, num_ps)
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
        description="Start or drain parameter servers of a running `psflow local --ps-max` cluster.",
    )
    p.add_argument("--ps", type=int, required=True, metavar="K", help="PS tasks wanted (1..ps-max)")
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
        result = scale(control, args.ps, args.timeout)
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
