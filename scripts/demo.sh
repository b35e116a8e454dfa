#!/usr/bin/env bash
# The main job: a local cluster of separate processes (2 parameter servers,
# 2 workers, the chief) trains a digits classifier and reports its test accuracy.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/psflow local --ps 2 --workers 2 examples/digits_ps.py --min-accuracy 0.95 "$@"
