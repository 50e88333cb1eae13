#!/usr/bin/env bash
# The README's test command: set up ./.venv, lint and type check (scripts/lint.sh), then run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
# Bytecode is written as Python does by default, so the suite's many processes compile torch once,
# not each (see scripts/setup_env.sh).
unset PYTHONDONTWRITEBYTECODE
# One intra-op thread per process: the two test workers and the ranks they fork share two cores,
# and tiny tensors gain nothing from a second thread (tests/zoo + tests/dispatch: 158-165 s with
# one, 170-178 s with PyTorch's default of one per core, interleaved runs).
export OMP_NUM_THREADS=1
bash scripts/setup_env.sh test
bash scripts/lint.sh
exec .venv/bin/python -m pytest -q -n 2 --dist loadfile "$@"
