#!/usr/bin/env bash
# The test suite: lint (ruff, pinned), format check, then pytest (its 25 slowest tests listed at the end). Installs what it needs.
# pytest runs in PSFLOW_TEST_WORKERS processes (pytest-xdist, default 4): one at a time the tests
# keep 0.8 of a core busy (1144 s of CPU in 1446 s on 2 cores), the rest is waiting on the servers
# they start; 4 processes took 548 s there, 3 took 570 s. `scripts/test.sh -n 0` runs serially.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh dev
.venv/bin/ruff check .
.venv/bin/ruff format --check .
exec .venv/bin/python -m pytest -q -n "${PSFLOW_TEST_WORKERS:-4}" --dist "${PSFLOW_TEST_DIST:-worksteal}" --durations=25 "$@"
