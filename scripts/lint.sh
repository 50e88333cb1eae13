#!/usr/bin/env bash
# Lint and type check (configured in pyproject.toml): ruff over the code, tests, benchmarks and
# examples, mypy over vescale/. Needs ./.venv (scripts/setup_env.sh test); scripts/test.sh runs it
# before the tests, so a lint failure fails CI in seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python -m ruff check --no-cache vescale tests benchmarks examples
.venv/bin/python -m mypy
