"""``python -m tests.gpu_worker ARGS``: a worker process whose GPU is the strict CuPy double.

It takes ``python -m worker``'s arguments; every closure it runs computes on
the double's device, so a host array reaching a device kernel fails the step
as it would on a real GPU.
"""

from __future__ import annotations

import sys

from tests import strict_cupy


def main(argv: list[str]) -> int:
    """Runs ``worker.__main__.main`` with the double installed (one GPU)."""
    with strict_cupy.installed(devices=1):
        from worker.__main__ import main as worker_main

        return worker_main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
