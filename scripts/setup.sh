#!/usr/bin/env bash
# Creates .venv (Python 3.10+) and installs psflow into it, once; later runs reuse it.
# Usage: scripts/setup.sh [EXTRAS]   e.g. scripts/setup.sh dev
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
python="${PYTHON:-python3}"
stamp=".venv/.psflow-installed${extras:+-$extras}"
if [ ! -x .venv/bin/python ]; then
    "$python" -m venv .venv
fi
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    .venv/bin/python -m pip install --quiet --upgrade pip
    .venv/bin/python -m pip install --quiet -e ".${extras:+[$extras]}"
    touch "$stamp"
fi
