#!/usr/bin/env bash
# The test suite: lint (ruff, pinned), format check, then pytest (its 25 slowest tests listed at the end). Installs what it needs.
# pytest runs in PSFLOW_TEST_WORKERS processes (pytest-xdist; default 4, even on 2 cores: most of
# a test's time is spent waiting on the servers it started). `scripts/test.sh -n 0` runs serially.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh dev
.venv/bin/ruff check .
.venv/bin/ruff format --check .
exec .venv/bin/python -m pytest -q -n "${PSFLOW_TEST_WORKERS:-4}" --dist "${PSFLOW_TEST_DIST:-worksteal}" --durations=25 "$@"
