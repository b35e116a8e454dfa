#!/usr/bin/env bash
# The test suite: lint (ruff, pinned), format check, then pytest (its 25 slowest tests listed at the end). Installs what it needs.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh dev
.venv/bin/ruff check .
.venv/bin/ruff format --check .
exec .venv/bin/python -m pytest -q --durations=25 "$@"
