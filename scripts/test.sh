#!/usr/bin/env bash
# The README's test command: set up ./.venv, lint and type check (scripts/lint.sh), then run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh test
bash scripts/lint.sh
exec .venv/bin/python -m pytest -q -n 2 --dist loadfile "$@"
