#!/usr/bin/env bash
# The README's test command: set up ./.venv, lint and type check (scripts/lint.sh), then run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
# Bytecode is written as Python does by default, so the suite's many processes compile torch once,
# not each (see scripts/setup_env.sh).
unset PYTHONDONTWRITEBYTECODE
bash scripts/setup_env.sh test
bash scripts/lint.sh
exec .venv/bin/python -m pytest -q -n 2 --dist loadfile "$@"
